"""The entry point ``moe`` and its autograd Functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ..ops import megakernel_fwd
from ..ops.schedule import schedule_capacity
from ..validate import MoEInputError, check_inputs
from .config import MoEConfig
from .workspace import (ThreadGroup,
                        WorkspaceKey, get_workspace)
from .backward import moe_backward
from .forward import MegaSaved, moe_forward
from .forward_mega import moe_forward_mega


@dataclass(frozen=True)
class ThreadRank:
    """The ``group`` argument in the CPU test harness: rank ``rank`` of a ``ThreadGroup``."""

    group: ThreadGroup
    rank: int


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


# Stage timing (tabby profile): None, or an object with .mark(name) called at stage boundaries.

class _TabbyMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, ws, cfg):
        y, saved = moe_forward(ws, cfg, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra)
        ctx.ws, ctx.cfg, ctx.saved = ws, cfg, saved
        ctx.w_dtype = topk_weights.dtype
        ctx.has_extra = extra is not None
        ctx.save_for_backward(w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        w_gate, w_up, w_down = ctx.saved_tensors
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.cfg, dy.contiguous(), ctx.saved, w_gate, w_up, w_down)
        ctx.saved = None
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dy if ctx.has_extra else None, None, None)


class _TabbyMoEMega(torch.autograd.Function):
    """The megakernel forward. The shared expert runs inside the kernel, so its gradients are made
    here: recomputed in the backward with the same torch ops the default path differentiates."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, ws, cfg, save):
        shared = (s_gate, s_up, s_down) if s_gate is not None else None
        y, saved = moe_forward_mega(ws, cfg, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, save)
        ctx.ws, ctx.cfg, ctx.saved = ws, cfg, saved
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
        dx, dtopk, dwg, dwu, dwd = moe_backward(ctx.ws, ctx.cfg, dy, saved, w_gate, w_up, w_down)
        ctx.saved = None
        dsg = dsu = dsd = None
        if s_gate is not None:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(True)
                sg, su, sd = (t.detach().requires_grad_(True) for t in (s_gate, s_up, s_down))
                out = (F.silu(xd @ sg.t()) * (xd @ su.t())) @ sd.t()
                dxs, dsg, dsu, dsd = torch.autograd.grad(out, (xd, sg, su, sd), dy)
            dx = dx + dxs
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dsg, dsu, dsd, None, None, None)


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config: MoEConfig | None = None):
    """Tabby's MoE layer (same arguments as ``tabby.moe_reference``; see tabby/validate.py).

    x [T, H] bf16; topk_idx [T, k] int; topk_weights [T, k] float; w_gate, w_up [E_local, I, H],
    w_down [E_local, H, I] bf16; shared None or (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]).
    ``group``: the expert-parallel process group (None: one rank). Returns y [T, H] bf16.
    No host synchronization: expert ids are checked on the device and reported by
    ``check_errors`` (or at once with ``config.debug``).
    """
    cfg = config or MoEConfig()
    rank, W, pg, tg = _group_info(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W,
                        check_ids=False, dtypes=(torch.bfloat16,))
    if W > 1 and tg is None and x.device.type != "cuda":
        raise MoEInputError("Tabby across processes needs CUDA tensors (GPU symmetric memory); on the CPU "
                            "run one rank, or the thread harness of tests/harness.py")
    if dims.T == 0:
        raise MoEInputError("x has no tokens (T = 0)")
    key = WorkspaceKey(dims.T, dims.H, dims.k, dims.E_local, dims.I, W, x.dtype, str(x.device))
    if cfg.overlap_publish not in (False, True):
        raise MoEInputError(f"MoEConfig: overlap_publish={cfg.overlap_publish!r} must be True or False")
    if cfg.megakernel:
        try:
            megakernel_fwd.check_order(cfg.ring_rows // cfg.tile_m, cfg.tile_m, cfg.group_m(dims.H, dims.I),
                                       cfg.fwd_prefetch, cfg.fwd_down_lag, cfg.fwd_fill_split,
                                       cfg.fwd_pull_cols or cfg.pull_cols)
            if cfg.fwd_fill_stages is not None and cfg.fwd_fill_stages < 1:
                raise ValueError(f"fwd_fill_stages={cfg.fwd_fill_stages} must be >= 1")
            if cfg.fwd_align_tiles is not None and cfg.fwd_align_tiles < 1:
                raise ValueError(f"fwd_align_tiles={cfg.fwd_align_tiles} must be >= 1")
            if cfg.fwd_down_cols is not None:
                megakernel_fwd.down_col_tiles(1, cfg.fwd_down_cols)  # raises on a bad value
            if cfg.fwd_num_warps not in (None, 4, 8):
                raise ValueError(f"fwd_num_warps={cfg.fwd_num_warps} must be 4 or 8 (one or two warpgroups)")
        except ValueError as e:
            raise MoEInputError(f"MoEConfig(megakernel=True): {e}") from None
    ws = get_workspace(key, rank, group=pg, thread_group=tg)
    if rank == 0 and tg is None and not getattr(ws, "memory_reported", False):
        ws.memory_reported = True
        print("[tabby] " + memory_report(dims, cfg), flush=True)
    if cfg.megakernel:
        sh = tuple(w.contiguous() for w in shared) if shared is not None else (None, None, None)
        # keep what the backward needs only when there will be one
        save = cfg.fwd_save_for_backward and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, *sh))
        return _TabbyMoEMega.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                                   w_down, *sh, ws, cfg, save)
    extra = None
    if shared is not None:
        sg, su, sd = shared
        extra = (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return _TabbyMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up,
                           w_down, extra, ws, cfg)


def memory_report(dims, cfg: MoEConfig) -> str:
    """Worst-case routed-buffer sizes (every (token, k) of every rank to this rank), known at setup."""

    R = schedule_capacity(dims.world_size, dims.T, dims.k, dims.E_local, cfg.tile_m,
                          cfg.align_tiles(dims.T, dims.k, dims.E_local))
    H, I, MiB = dims.H, dims.I, 2 ** 20
    kept = R * (2 * H + 4 * I + 4 + 4)  # xs, g|u, row weight, row_src: kept per layer for the backward
    fwd = R * 2 * I  # h
    bwd = R * (2 * H + 4 * I + 2 * I + 4 * 2 + 4 * triton.cdiv(I, 64))  # dys, dg|du, hw, dw rows, dw partials
    if cfg.token_pull_on(dims.T, dims.k, H, I, dims.E_local * dims.world_size):  # the tokens kept, not xs
        kept += dims.world_size * dims.T * 2 * H - R * 2 * H
        bwd += R * 2 * H  # the routed rows gathered from them for the weight gradient
    ring = cfg.ring_rows * 2 * (H + I)
    mode = (f"megakernel forward keeps only the schedule and a {ring / MiB:.1f} MiB ring; its backward "
            f"recomputes the routed rows" if cfg.megakernel and not cfg.fwd_save_for_backward else
            f"megakernel ring {ring / MiB:.1f} MiB; a differentiated forward keeps {kept / MiB:.1f} MiB per layer "
            f"for the backward (without autograd: only the ring)" if cfg.megakernel else
            f"kept per layer for the backward {kept / MiB:.1f} MiB, forward transient {fwd / MiB:.1f} MiB")
    return (f"routed rows sized for the worst case: R_max={R} rows; {mode}; backward transient "
            f"{(bwd + (kept if cfg.megakernel and not cfg.fwd_save_for_backward else 0)) / MiB:.1f} MiB")


def check_errors():
    """Raise ``TabbyDeviceError`` if any cached workspace of this process recorded an error (host sync)."""
    from .workspace import _CACHE

    for ws in list(_CACHE.values()):
        ws.check_errors()

