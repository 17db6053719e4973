"""The entry points ``moe`` / ``moe_with_probe`` and their autograd Functions.

A call checks its inputs, finds the workspace of its group and shape (``workspace.py``) and the
plan of its shape and config (``plan.py``; both made once and cached), then runs the forward of
the plan's path: ``forward_mega.moe_forward_mega`` (the megakernel, the default) or
``forward.moe_forward`` (the sync-free path). The backward (``backward.py``) serves both.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton

from ..ops import check_device
from ..ops.schedule import schedule_capacity
from ..validate import MoEDims, MoEInputError, check_inputs
from .backward import moe_backward
from .config import MoEConfig
from .forward import MegaSaved, moe_forward
from .forward_mega import moe_forward_mega
from .plan import Plan, make_plan
from .probe import Probe
from .threads import ThreadRank
from .workspace import WorkspaceKey, cached_workspaces, get_workspace

log = logging.getLogger("tabby")


def _group_info(group):
    """(rank, world size, torch process group or None, thread group or None).

    ``group=None`` means one rank, as in ``moe_reference`` (even when a default group exists).
    """
    if isinstance(group, ThreadRank):
        return group.rank, group.group.world_size, None, group.group
    if group is None:
        return 0, 1, None, None
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group), group, None


class _TabbyMoE(torch.autograd.Function):
    """The sync-free forward; the shared expert's output enters as ``extra`` (plain PyTorch outside)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, ws, plan, probe):
        y, saved = moe_forward(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, probe=probe)
        ctx.ws, ctx.plan, ctx.saved, ctx.probe = ws, plan, saved, probe
        ctx.w_dtype = topk_weights.dtype
        ctx.has_extra = extra is not None
        ctx.save_for_backward(w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down = ctx.saved_tensors
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.plan, dy.contiguous(), ctx.saved, w_gate, w_up, w_down,
                                                probe=ctx.probe)
        ctx.saved = None
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dy if ctx.has_extra else None, None, None, None)


class _TabbyMoEMega(torch.autograd.Function):
    """The megakernel forward. The shared expert runs inside the kernel, so its gradients are made
    here: recomputed in the backward with the same torch ops the sync-free path differentiates."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, ws, plan, save, probe):
        shared = (s_gate, s_up, s_down) if s_gate is not None else None
        y, saved = moe_forward_mega(ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, save,
                                    probe=probe)
        ctx.ws, ctx.plan, ctx.saved, ctx.probe = ws, plan, saved, probe
        ctx.w_dtype = topk_weights.dtype
        ctx.save_for_backward(w_gate, w_up, w_down, x, topk_weights, s_gate, s_up, s_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down, x, topk_weights, s_gate, s_up, s_down = ctx.saved_tensors
        dy = dy.contiguous()
        saved = ctx.saved
        if isinstance(saved, MegaSaved):  # x and topk_weights came back through save_for_backward
            saved = MegaSaved(saved.sched, x, topk_weights)
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.plan, dy, saved, w_gate, w_up, w_down, probe=ctx.probe)
        ctx.saved = None
        dsg = dsu = dsd = None
        if s_gate is not None:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(True)
                sg, su, sd = (t.detach().requires_grad_(True) for t in (s_gate, s_up, s_down))
                out = (F.silu(xd @ sg.t()) * (xd @ su.t())) @ sd.t()
                dxs, dsg, dsu, dsd = torch.autograd.grad(out, (xd, sg, su, sd), dy)
            dx = dx + dxs
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dsg, dsu, dsd, None, None, None, None)


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config: MoEConfig | None = None):
    """Tabby's MoE layer (same arguments as ``tabby.moe_reference``; see tabby/validate.py).

    x [T, H] bf16; topk_idx [T, k] int; topk_weights [T, k] float; w_gate, w_up [E_local, I, H],
    w_down [E_local, H, I] bf16; shared None or (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]).
    ``group``: the expert-parallel process group (None: one rank; a ``ThreadRank`` for simulated
    ranks). Returns y [T, H] bf16. No host synchronization: expert ids are checked on the device and
    reported by ``check_errors`` (or at once with ``config.debug``).
    """
    return _moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, None)


def moe_with_probe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None,
                   config: MoEConfig | None = None, *, probe: Probe):
    """``moe`` with measurement hooks (``Probe``: stage timer, ticket trace, ablations), for the tools."""
    return _moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, probe)


def _plan_for(ws, dims: MoEDims, config: MoEConfig, I_s: int, device) -> Plan:
    """The cached plan of this workspace for ``config`` and ``I_s`` (the environment variables the
    config defers to are part of the key: they are read at each call)."""
    key = (config, I_s, os.environ.get("TABBY_MAX_WAIT_MS"), os.environ.get("TABBY_MAX_WAIT_POLLS"),
           os.environ.get("TABBY_DEBUG"))
    plan = ws.plans.get(key)
    if plan is None:
        plan = ws.plans[key] = make_plan(dims, config, device, I_s)
        if ws.rank == 0:
            log.info("%s", memory_report(plan))
    return plan


def _moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, probe):
    config = config or MoEConfig()
    if not isinstance(config, MoEConfig):
        raise MoEInputError(f"config must be a tabby.MoEConfig, got {type(config).__name__}")
    rank, W, pg, tg = _group_info(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W,
                        check_ids=False, dtypes=(torch.bfloat16,))
    check_device(x.device)
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory); on the CPU "
                            "run one rank, or simulated ranks (tabby.functional.threads.run_ranks)")
    if dims.T == 0:
        raise MoEInputError("x has no tokens (T = 0)")
    key = WorkspaceKey(dims.T, dims.H, dims.k, dims.E_local, dims.I, W, x.dtype, str(x.device))
    ws = get_workspace(key, rank, group=pg, thread_group=tg)
    I_s = shared[0].shape[0] if shared is not None else 0
    plan = _plan_for(ws, dims, config, I_s, x.device)
    if probe is not None:
        probe.plan = plan
    if plan.megakernel:
        sh = tuple(w.contiguous() for w in shared) if shared is not None else (None, None, None)
        # keep what the backward needs only when there will be one
        save = plan.save_for_backward and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, *sh))
        return _TabbyMoEMega.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                                   w_down, *sh, ws, plan, save, probe)
    extra = None
    if shared is not None:
        sg, su, sd = shared
        extra = (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return _TabbyMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                           w_down, extra, ws, plan, probe)


def memory_report(plan: Plan) -> str:
    """Worst-case routed-buffer sizes of a plan (every (token, k) of every rank to this rank)."""
    d = plan.dims
    R = schedule_capacity(d.world_size, d.T, d.k, d.E_local, plan.tile_m, plan.align_tiles)
    H, I, MiB = d.H, d.I, 2 ** 20
    kept = R * (2 * H + 4 * I + 4 + 4)  # xs, g|u, row weight, row_src: kept per layer for the backward
    fwd = R * 2 * I  # h
    bwd = R * (2 * H + 4 * I + 2 * I + 4 * 2 + 4 * triton.cdiv(I, 64))  # dys, dg|du, hw, dw rows, dw partials
    mega = plan.mega
    if mega is not None and mega.token_pull:  # the tokens kept, not xs
        kept += d.world_size * d.T * 2 * H - R * 2 * H
        bwd += R * 2 * H  # the routed rows gathered from them for the weight gradient
    recompute = mega is not None and not plan.save_for_backward
    if mega is None:
        mode = f"kept per layer for the backward {kept / MiB:.1f} MiB, forward transient {fwd / MiB:.1f} MiB"
    else:
        ring = mega.ring_rows * 2 * (H + I)
        mode = (f"megakernel forward keeps only the schedule and a {ring / MiB:.1f} MiB ring; its backward "
                f"recomputes the routed rows" if recompute else
                f"megakernel ring {ring / MiB:.1f} MiB; a differentiated forward keeps {kept / MiB:.1f} MiB per "
                f"layer for the backward (without autograd: only the ring)")
    return (f"T={d.T} H={H} I={I} k={d.k} E_local={d.E_local} EP{d.world_size}: routed rows sized for the worst "
            f"case: R_max={R} rows; {mode}; backward transient {(bwd + (kept if recompute else 0)) / MiB:.1f} MiB")


def check_errors():
    """Raise ``TabbyDeviceError`` if any cached workspace of this process recorded an error (host sync)."""
    for ws in cached_workspaces():
        ws.check_errors()
