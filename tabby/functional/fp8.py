"""The FP8 layer, ``MoEConfig(precision="fp8", megakernel=False)``: the sync-free path of
``forward.py`` with the routed experts' GEMMs in FP8 (the recipe: tabby/reference_fp8.py,
docs/fp8.md), and the bf16 backward of ``backward.py``.

Forward, on every rank (no host sync; the steps not named here are forward.py's):

    publish + schedule, dispatch   as the bf16 path: xs [R, H] bf16 rows pulled from their ranks
    quantize                       xs per 1x128 -> xq [R, H] E4M3 + scales (used row tiles only)
    gate/up                        FP8 GEMMs, fp32 promotion per 128 of K; h = silu(g) * u in fp32,
                                   quantized per 1x128 in the epilogue; g | u kept bf16
    down                           FP8 GEMM, rows pushed bf16 to their origin
    signal+wait, combine           unchanged (bf16 rows, fp32 sum in k order)

Quantizing the routed rows gives the bits that quantizing x once and gathering would (the
tiles are per token), with k times the (small, memory-bound) work.

Weights: the FP8 copies (E4M3 + 128x128 block scales) of w_gate, w_up and w_down are made once
per weight version and cached: a cached copy is used while the tensor is the same object, at
the same address, with the same ``_version`` (an optimizer's in-place step increments it). A
change through ``.data`` does not increment ``_version``: call :func:`clear_weight_cache` after one.

Backward: ``backward.moe_backward`` as it is, in bf16 from the bf16 weights, with the g | u of the
FP8 forward: the gradient of the high-precision layer evaluated at the FP8 forward's activations
("FP8 forward, bf16 backward"; ``reference_fp8.moe_reference_fp8`` defines it). The shared
expert stays in bf16 (plain PyTorch, as on the bf16 sync-free path).
"""
from __future__ import annotations

import weakref

import torch

from ..ops import fp8, gemm_fp8
from ..validate import MoEInputError
from .backward import moe_backward
from .forward import KeptRows
from .plan import Plan
from .probe import Probe, mark
from .steps import _finish_forward, _publish_and_schedule, _pull_rows

FP8_BLOCK = fp8.BLOCK

# (device, data_ptr) -> (weakref to the weight, its _version, shape, strides, E4M3 copy, scales)
_weight_cache: dict = {}


def clear_weight_cache() -> None:
    """Forget every cached FP8 weight copy (needed only after changing a weight through ``.data``)."""
    _weight_cache.clear()


def fp8_weight(w: torch.Tensor):
    """(E4M3 [E, N, K], fp32 scales [E, N/128, K/128]) of the weight ``w`` [E, N, K], from the cache
    when ``w`` has not changed since it was quantized (same object, address, shape and version)."""
    key = (str(w.device), w.data_ptr())
    hit = _weight_cache.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == (w.shape, w.stride()):
        return hit[3], hit[4]
    q, s = fp8.quantize_blocks(w.detach().contiguous())

    def forget(_ref, key=key):
        entry = _weight_cache.get(key)
        if entry is not None and entry[0] is _ref:
            del _weight_cache[key]

    _weight_cache[key] = (weakref.ref(w, forget), w._version, (w.shape, w.stride()), q, s)
    return q, s


def check_fp8(dims, plan: Plan) -> None:
    """Raise ``MoEInputError`` where the FP8 path cannot run this shape or plan."""
    if dims.H % FP8_BLOCK or dims.I % FP8_BLOCK:
        raise MoEInputError(f"precision='fp8' needs H and I multiples of {FP8_BLOCK} (the recipe's 1x128 and "
                            f"128x128 tiles), got H={dims.H}, I={dims.I}")
    if plan.megakernel:
        raise MoEInputError("precision='fp8' runs on the path of separate launches only (megakernel=False)")
    if plan.tile_m % 16:
        raise MoEInputError(f"precision='fp8' needs a routed tile height (Tuning.tile_m) that is a multiple of 16, "
                            f"got {plan.tile_m}")


def moe_forward_fp8(ws, plan: Plan, x, topk_idx, topk_weights, w_fp8, extra=None, keep=True,
                    probe: Probe | None = None):
    """FP8 forward on one rank; ``w_fp8`` = ((wg_q, wg_s), (wu_q, wu_s), (wd_q, wd_s)). Returns (y [T, H],
    ``KeptRows`` for ``moe_backward``; with ``keep`` False g | u is not stored and the rows are
    not usable by a backward)."""
    T, H = x.shape
    TK = topk_idx.numel()
    (wg_q, wg_s), (wu_q, wu_s), (wd_q, wd_s) = w_fp8
    sched = _publish_and_schedule(ws, plan, x, topk_idx, topk_weights, wg_q.shape[0], probe=probe)
    xs = x.new_empty((sched.R_max, H))
    row_w = torch.empty(sched.R_max, dtype=torch.float32, device=x.device)
    _pull_rows(plan, sched, ws.ptrs["x_pub"], xs, TK, sched.k, ws.ptrs["w_pub"], row_w)
    mark(probe, "fwd:dispatch")
    xq, x_scale = fp8.quantize_rows(xs, num_tiles=sched.num_tiles, tile_rows=plan.tile_m)
    mark(probe, "fwd:quantize")
    hq, h_scale, gu = gemm_fp8.gate_up_swiglu_fp8(
        xq, x_scale, wg_q, wg_s, wu_q, wu_s, sched.tile_expert, sched.num_tiles, save_gu=keep,
        config=gemm_fp8.default_config_fp8(gemm_fp8.KIND_GATE_UP, BM=plan.tile_m))
    mark(probe, "fwd:gate_up")
    gemm_fp8.down_push_fp8(hq, h_scale, wd_q, wd_s, sched.tile_expert, sched.num_tiles, sched.row_src,
                           ws.ptrs["y_in"], TK,
                           config=gemm_fp8.default_config_fp8(gemm_fp8.KIND_ROWS, H, BM=plan.tile_m))
    mark(probe, "fwd:down+push")
    return _finish_forward(ws, plan, x, topk_weights, extra, probe=probe), KeptRows(sched, xs, gu, row_w)


class _TabbyMoEFP8(torch.autograd.Function):
    """The FP8 forward and the bf16 backward; the shared expert's output enters as ``extra``."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra, ws, plan, keep, probe):
        w_fp8 = tuple(fp8_weight(w) for w in (w_gate, w_up, w_down))
        y, saved = moe_forward_fp8(ws, plan, x, topk_idx, topk_weights, w_fp8, extra, keep=keep, probe=probe)
        ctx.ws, ctx.plan, ctx.saved, ctx.probe = ws, plan, saved if keep else None, probe
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
        return (dx, None, dtopk.to(ctx.w_dtype), dwg, dwu, dwd, dy if ctx.has_extra else None, None, None, None,
                None)


def moe_fp8(ws, plan: Plan, dims, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, probe=None):
    """``tabby.moe`` with ``precision="fp8"``, after the inputs, workspace and plan (``moe._moe``)."""
    check_fp8(dims, plan)
    extra = None
    if shared is not None:
        sg, su, sd = shared
        extra = (torch.nn.functional.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, topk_weights, w_gate, w_up, w_down, extra))
    return _TabbyMoEFP8.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate, w_up, w_down,
                              extra, ws, plan, keep, probe)
