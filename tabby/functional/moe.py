"""The entry points ``moe`` / ``moe_with_probe`` and their autograd Functions.

A call checks its inputs, finds the workspace of its group and shape (``workspace.py``) and the
plan of its shape and config (``plan.py``; both made once and cached), then runs the forward of
the plan's path: ``forward_mega.moe_forward_mega`` (the megakernel, the default) or
``forward.moe_forward`` (the sync-free path). The backward (``backward.py``) serves both.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ..ops import check_device
from ..ops.schedule import schedule_capacity
from ..validate import MoEDims, MoEInputError, TabbyMemoryError, check_inputs
from .backward import gate_up_wgrad_first, moe_backward
from .config import MoEConfig
from .forward import MegaSaved, moe_forward
from .forward_mega import moe_forward_mega
from .fp8 import fp8_passes, gate_up_k
from .plan import Plan, make_plan
from .probe import Probe
from .threads import ThreadRank
from .workspace import (TabbyDeviceError, WorkspaceKey, cached_workspaces, get_workspace, peek_workspace,
                        workspace_bytes)

log = logging.getLogger("tabby")


def group_info(group):
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
    """The path of separate launches: ``passes`` = (forward, backward), bf16
    (``forward.moe_forward``, ``backward.moe_backward``) or FP8 (``fp8.fp8_passes``); the shared
    expert's output enters as ``extra`` (plain PyTorch outside)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, ws, plan, passes, probe):
        y, saved = passes[0](ws, plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, probe=probe)
        ctx.ws, ctx.plan, ctx.saved, ctx.probe, ctx.backward_pass = ws, plan, saved, probe, passes[1]
        ctx.w_dtype = topk_weights.dtype
        ctx.has_extra = extra is not None
        ctx.save_for_backward(w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None  # a backward runs once: it frees the kept rows as it goes
        dx, dtopk, dwg, dwu, dwd = ctx.backward_pass(ctx.ws, ctx.plan, dy.contiguous(), saved, w_gate, w_up,
                                                     w_down, probe=ctx.probe, owned=True)
        del saved
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dy if ctx.has_extra else None, None, None, None,
                None)


_BF16_PASSES = (moe_forward, moe_backward)


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
        saved, ctx.saved = ctx.saved, None  # a backward runs once: it frees the kept rows as it goes
        if isinstance(saved, MegaSaved):  # x and topk_weights came back through save_for_backward
            saved = MegaSaved(saved.sched, x, topk_weights)
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.plan, dy, saved, w_gate, w_up, w_down, probe=ctx.probe,
                                                owned=True)
        del saved
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


def _plan_key(config: MoEConfig, I_s: int):
    """The key of a plan in its workspace: the config and ``I_s``, and the environment variables the
    config defers to (they are read at each call)."""
    return (config, I_s, os.environ.get("TABBY_MAX_WAIT_MS"), os.environ.get("TABBY_MAX_WAIT_POLLS"),
            os.environ.get("TABBY_DEBUG"))


def workspace_key(dims: MoEDims, world_size: int, x: torch.Tensor, config: MoEConfig) -> WorkspaceKey:
    """The key of the workspace a call uses: its shapes, dtype and device, and whether it carries the
    FP8 dispatch's buffers (any precision but bf16)."""
    return WorkspaceKey(dims.T, dims.H, dims.k, dims.E_local, dims.I, world_size, x.dtype, str(x.device),
                        fp8=config.precision != "bf16")


def workspace_and_plan(key: WorkspaceKey, dims: MoEDims, config: MoEConfig, I_s: int, device, rank, pg, tg,
                        differentiated: bool = True):
    """The cached workspace of this group and shape and its plan for ``config`` and ``I_s``.

    Where either is new, the memory the call needs is first compared with what the device has free
    (``check_memory``); a workspace is created only when every rank of the group agrees on the shapes
    and has the memory (``get_workspace``), so that no rank waits for a peer that gave up. The
    check counts the backward when the call is ``differentiated`` (the first call of a plan decides)."""
    ws = peek_workspace(key, rank, group=pg, thread_group=tg)
    if ws is not None:
        return ws, _plan_for(ws, dims, config, I_s, device, differentiated=differentiated)
    plan = make_plan(dims, config, device, I_s)
    shortfall = memory_shortfall(plan, device, new_workspace=key, differentiated=differentiated)
    ws = get_workspace(key, rank, group=pg, thread_group=tg, fits=shortfall is None, shortfall=shortfall,
                       join_timeout_s=config.resolved_max_wait_ms() / 1e3)
    return ws, _plan_for(ws, dims, config, I_s, device, plan)


def _plan_for(ws, dims: MoEDims, config: MoEConfig, I_s: int, device, plan: Plan | None = None,
              differentiated: bool = True) -> Plan:
    """The cached plan of ``ws`` for ``config`` and ``I_s``. A new one (``plan``: made already and
    its memory checked) is checked against the free device memory first (``TabbyMemoryError``)."""
    key = _plan_key(config, I_s)
    cached = ws.plans.get(key)
    if cached is not None:
        return cached
    if plan is None:
        plan = make_plan(dims, config, device, I_s)
        shortfall = memory_shortfall(plan, device, differentiated=differentiated)
        if shortfall is not None:
            raise TabbyMemoryError(shortfall)
    ws.plans[key] = plan
    if ws.rank == 0:
        log.info("%s", memory_report(plan))
    return plan


class _EmptyMoE(torch.autograd.Function):
    """The layer on a rank with no tokens (T = 0): y [0, H]; dx [0, H], router-weight gradients
    [0, k] and zero weight gradients (no token reaches an expert when every rank has T = 0, which
    the group's shape agreement requires)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down):
        ctx.like = (x, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down)
        return x.new_empty((0, x.shape[1]))

    @staticmethod
    def backward(ctx, dy):
        grads = tuple(None if t is None else torch.zeros_like(t) for t in ctx.like)
        ctx.like = None
        return grads


def _moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config, probe):
    config = config or MoEConfig()
    if not isinstance(config, MoEConfig):
        raise MoEInputError(f"config must be a tabby.MoEConfig, got {type(config).__name__}")
    rank, W, pg, tg = group_info(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W,
                        check_ids=False, dtypes=(torch.bfloat16,))
    check_device(x.device)
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory); on the CPU "
                            "run one rank, or simulated ranks (tabby.functional.threads.run_ranks)")
    key = workspace_key(dims, W, x, config)
    I_s = shared[0].shape[0] if shared is not None else 0
    if dims.T == 0:
        if W > 1:  # take part in the group's shape agreement (made once per shape): a peer with tokens is reported
            get_workspace(key, rank, group=pg, thread_group=tg, join_timeout_s=config.resolved_max_wait_ms() / 1e3)
        sh = tuple(shared) if shared is not None else (None, None, None)
        return _EmptyMoE.apply(x, topk_weights, w_gate, w_up, w_down, *sh)
    differentiated = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, *(shared or ())))
    ws, plan = workspace_and_plan(key, dims, config, I_s, x.device, rank, pg, tg, differentiated)
    if probe is not None:
        probe.plan = plan
    passes = _BF16_PASSES
    if config.precision != "bf16":  # the FP8 experts, on the path of separate launches (fp8.py)
        passes = fp8_passes(dims, plan, config.precision, keep=differentiated)
    elif plan.megakernel:
        sh = tuple(w.contiguous() for w in shared) if shared is not None else (None, None, None)
        save = plan.save_for_backward and differentiated  # keep what the backward needs only when there is one
        return _TabbyMoEMega.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                                   w_down, *sh, ws, plan, save, probe)
    extra = None
    if shared is not None:
        sg, su, sd = shared
        extra = (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return _TabbyMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                           w_down, extra, ws, plan, passes, probe)


@dataclass(frozen=True)
class MemoryNeeds:
    """Worst-case bytes of one call of a plan on one rank (every (token, k) of every rank routed
    to this rank's experts)."""

    R_max: int  # routed rows the buffers are sized for
    kept: int  # what a differentiated forward keeps for the backward (per layer)
    forward: int  # the forward's transient routed rows (the sync-free path's h)
    backward: int  # the backward's transient buffers (with the recomputed rows when nothing is kept): the
    # larger of tabby.moe's (dg|du over the kept g|u) and the registered operator's (backward.moe_backward, owned)
    ring: int  # the megakernel's ring (0 on the sync-free path)
    recompute: bool  # the megakernel keeps nothing: its backward recomputes the routed rows
    fp8_weights: int = 0  # the FP8 copies of the layer's weights, cached while the weights live
    backward_moe: int = 0  # tabby.moe's own backward transient (<= backward, which the check uses)

    def held(self) -> int:
        """Bytes a differentiated call holds from its forward to its backward: the ring, the
        routed rows unless the backward recomputes them, and the weights' FP8 copies."""
        return self.ring + (0 if self.recompute else self.kept) + self.fp8_weights

    def peak(self, differentiated: bool = True) -> int:
        """Bytes of one call at its high point: without autograd the ring and the forward's
        transient; differentiated, what it holds and the larger of the passes' transients (a
        backward that recomputes the routed rows makes them again: the same peak, held less long)."""
        if not differentiated:
            return self.ring + self.fp8_weights + self.forward
        return self.held() + max(self.forward, self.backward)


def fp8_transposes_bytes(d) -> int:
    """The cached transposed E4M3 weight copies of ``cache_fp8_transposes``: W_down^T and
    [W_gate^T | W_up^T] with each half padded (``gate_up_k``), one byte a value."""
    return d.E_local * d.H * (d.I + 2 * gate_up_k(d.I))


def memory_needs(plan: Plan) -> MemoryNeeds:
    """The worst-case buffer sizes of a plan (``MemoryNeeds``)."""
    d = plan.dims
    R = schedule_capacity(d.world_size, d.T, d.k, d.E_local, plan.tile_m, plan.align_tiles)
    H, I = d.H, d.I
    kept = R * (2 * H + 4 * I + 4 + 4)  # xs, g|u, row weight, row_src: kept per layer for the backward
    fwd = R * 2 * I  # h
    small = R * (4 * 2 + 4 * triton.cdiv(I, 64))  # dw rows, dw partials
    # tabby.moe's backward owns the kept rows: dg|du over g|u, so dys and hw on top of them; the registered
    # operator's reads them (autograd's saved inputs): dys, dg|du and hw (backward.moe_backward's ``owned``)
    bwd_owned = R * (2 * H + 2 * I) + small
    bwd_op = R * (2 * H + 4 * I + 2 * I) + small
    mega = plan.mega
    if mega is not None and mega.token_pull:  # the tokens kept, not xs
        kept += d.world_size * d.T * 2 * H - R * 2 * H
        # the routed rows gathered from them for the weight gradient: a new buffer where the gate/up
        # weight gradient goes first, else dys's (the operator's order: dW_down first)
        if gate_up_wgrad_first(R, H, I, d.E_local, d.world_size * d.T):
            bwd_owned += R * 2 * H
    bwd = max(bwd_owned, bwd_op)
    recompute = mega is not None and not plan.save_for_backward
    ring = mega.ring_rows * 2 * (H + I) if mega is not None else 0
    fp8_weights = 0
    if plan.precision != "bf16":
        def rows_fp8(C):  # R rows of C E4M3 bytes and an fp32 scale per 1x128 tile, a partial last one too
            return R * (C + 4 * triton.cdiv(C, 128))

        Ip = gate_up_k(I)  # the gate/up dgrad's K halves, padded
        fwd = rows_fp8(H) + rows_fp8(I)  # the routed rows and h in E4M3 (h never bf16)
        fp8_weights = 3 * d.E_local * I * H  # the three weights' 128x128-block copies
        if plan.precision == "fp8":
            kept += rows_fp8(H) - R * 2 * H  # the rows kept in E4M3 with their scales, not bf16
            bwd -= R * 2 * H  # dy rows pulled in E4M3 (counted below), never bf16
            # dy rows and dg|du (halves padded) per 1x128; dy, hw, dg|du, xs per 128x1 (R a multiple of
            # 128: 33/32 byte a value)
            bwd += rows_fp8(H) + 2 * rows_fp8(Ip) + R * (H + I + 2 * I + H) * 33 // 32
            # the transposes, W_down^T and [W_gate^T | W_up^T] (halves padded): cached with the copies,
            # or made in the backward, each dropped after its GEMM (the larger counts)
            if plan.cache_fp8_transposes:
                fp8_weights += fp8_transposes_bytes(d)
            else:
                bwd += d.E_local * H * max(I, 2 * Ip)
    return MemoryNeeds(R_max=R, kept=kept, forward=fwd if mega is None else 0,
                       backward=bwd + (kept if recompute else 0), ring=ring, recompute=recompute,
                       fp8_weights=fp8_weights,
                       backward_moe=(bwd_owned if plan.precision != "fp8" else bwd) + (kept if recompute else 0))


def memory_report(plan: Plan) -> str:
    """Worst-case routed-buffer sizes of a plan (every (token, k) of every rank to this rank)."""
    d = plan.dims
    n = memory_needs(plan)
    MiB = 2 ** 20
    if plan.mega is None:
        mode = (f"kept per layer for the backward {n.kept / MiB:.1f} MiB, forward transient "
                f"{n.forward / MiB:.1f} MiB")
    else:
        mode = (f"megakernel forward keeps only the schedule and a {n.ring / MiB:.1f} MiB ring; its backward "
                f"recomputes the routed rows" if n.recompute else
                f"megakernel ring {n.ring / MiB:.1f} MiB; a differentiated forward keeps {n.kept / MiB:.1f} MiB per "
                f"layer for the backward (without autograd: only the ring)")
    copies = ""
    if n.fp8_weights:
        what = "with their transposes" if plan.precision == "fp8" and plan.cache_fp8_transposes else "forward's only"
        copies = f"; the weights' E4M3 copies ({what}) {n.fp8_weights / MiB:.1f} MiB, held while the weights live"
    return (f"T={d.T} H={d.H} I={d.I} k={d.k} E_local={d.E_local} EP{d.world_size}: routed rows sized for the worst "
            f"case: R_max={n.R_max} rows; {mode}; backward transient {n.backward / MiB:.1f} MiB (tabby.moe's, "
            f"which frees the kept rows as it goes: {n.backward_moe / MiB:.1f} MiB){copies}")


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can use: free in the driver plus what PyTorch's caching
    allocator holds unused; None where it is not known (CPU tensors) or not to be asked (while a
    CUDA graph is captured): no check."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def memory_shortfall(plan: Plan, device, new_workspace: WorkspaceKey | None = None,
                     differentiated: bool = True) -> str | None:
    """None if one call of ``plan`` fits in the free memory of ``device`` (``free_device_bytes``),
    else the message of the ``TabbyMemoryError`` to raise: GiB needed and free, and what lowers it.
    ``new_workspace``: the key of a workspace the call would also create (its symmetric buffers);
    ``differentiated``: the call's backward counts too (``MemoryNeeds.peak``)."""
    free = free_device_bytes(torch.device(device))
    if free is None:
        return None
    n = memory_needs(plan)
    sym = workspace_bytes(new_workspace) if new_workspace is not None else 0
    need = sym + n.peak(differentiated)
    if need <= free:
        return None
    d, GiB = plan.dims, 2 ** 30
    ways = [(f"fewer tokens per call (the routed rows are sized for every token of every rank: T={d.T} x k={d.k} "
             f"x EP{d.world_size})")]
    if differentiated and plan.mega is not None and plan.save_for_backward:
        ways.append(f"MoEConfig(save_for_backward=False) (each layer then holds only its ring between its forward "
                    f"and backward, {n.kept / GiB:.2f} GiB less per layer, where other layers' kept rows take "
                    f"the memory; the backward recomputes the rows)")
    if differentiated and plan.mega is None:
        ways.append("MoEConfig(megakernel=True, save_for_backward=False) (each layer holds only a ring between its "
                    "forward and backward)")
    if plan.precision == "fp8" and plan.cache_fp8_transposes:
        ways.append(f"MoEConfig(cache_fp8_transposes=False) (the weights' transposed E4M3 copies not held, "
                    f"{fp8_transposes_bytes(d) / GiB:.2f} GiB less: the dgrads read the forward's copies transposed, slower)")
    if plan.mega is not None:
        ways.append(f"a smaller ring, Tuning(ring_rows=...) (now {plan.mega.ring_rows} rows, {n.ring / GiB:.2f} GiB)")
    ways.append("tabby.free_workspaces() to release the buffers of shapes no longer used")
    parts = (f"held from forward to backward {n.held() / GiB:.2f} GiB (ring {n.ring / GiB:.2f}), transient "
             f"{max(n.forward, n.backward) / GiB:.2f} GiB" if differentiated else
             f"ring {n.ring / GiB:.2f} GiB, transient {n.forward / GiB:.2f} GiB")
    return (f"tabby.moe at T={d.T} H={d.H} I={d.I} k={d.k} E_local={d.E_local} EP{d.world_size} on {device} needs "
            f"{need / GiB:.2f} GiB for a {'differentiated ' if differentiated else ''}call (worst case, "
            f"R_max={n.R_max} routed rows: {parts}, symmetric buffers {sym / GiB:.2f} GiB) but {free / GiB:.2f} GiB "
            f"are free. To lower it: " + "; ".join(ways))


def check_errors():
    """Raise ``TabbyDeviceError`` if any cached workspace of this process recorded an error (host
    sync). Every record is read and cleared; the error names each one."""
    found = []
    for ws in cached_workspaces():
        try:
            ws.check_errors()
        except TabbyDeviceError as e:
            found.append(str(e))
    if found:
        raise TabbyDeviceError("; ".join(found))
