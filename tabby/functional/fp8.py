"""The FP8 layer, ``MoEConfig(precision="fp8" | "fp8-forward", megakernel=False)``: the sync-free
path of ``forward.py`` with the routed experts' GEMMs in FP8 (the recipe: tabby/reference_fp8.py,
docs/fp8.md); "fp8" also runs the backward's GEMMs in FP8 (``moe_backward_fp8``), "fp8-forward"
the bf16 backward of ``backward.py``.

Forward, on every rank (no host sync; the steps not named here are forward.py's):

    publish + schedule             as the bf16 path, but x is published quantized per 1x128 (E4M3
                                   xq_pub + scales xs_pub: each token quantized once, at its source)
    dispatch                       xq [R, H] E4M3 rows and their scales pulled from their ranks (half
                                   the bytes of bf16 rows)
    gate/up                        FP8 GEMMs, fp32 promotion per 128 of K; h = silu(g) * u in fp32,
                                   quantized per 1x128 in the epilogue; g | u kept bf16
    down                           FP8 GEMM, rows pushed bf16 to their origin
    signal+wait, combine           unchanged (bf16 rows, fp32 sum in k order)

The FP8 backward keeps xq and its scales for its weight gradients (the 128x1 tiles of the
dequantized rows: DeepSeek-V3's FP8 activation cache). "fp8-forward", whose bf16 backward reads
bf16 rows, pulls xs [R, H] bf16 instead and quantizes the routed rows (the same bits: the tiles
are per token).

Weights: the FP8 copies (E4M3 + 128x128 block scales) of w_gate, w_up and w_down are made once
per weight version and cached: a cached copy is used while the tensor is the same object, at
the same address, with the same ``_version`` (an optimizer's in-place step increments it). A
change through ``.data`` does not increment ``_version``: call :func:`clear_weight_cache` after one.
The FP8 backward's dgrads read the weights transposed (FP8 wgmma reads B only K-major):
``MoEConfig(cache_fp8_transposes=True)`` (the default) caches those copies too, made with the
forward's from one read of each weight; with False (a byte less per parameter held) the dgrads
read the forward's copies and transpose each 128 x 128 block in shared memory on sm_90
(slower than cached copies, faster than making them), and elsewhere each backward transposes the
copies and drops them: the plan's ``Plan.fp8.dgrad`` (``heuristics.fp8_dgrad``; overridable
through ``Tuning.fp8_dgrad``). Every GEMM runs the kernel the plan names (``Plan.fp8``).

Backward: "fp8": ``moe_backward_fp8`` (``reference_fp8.moe_backward_reference_fp8`` defines it).
"fp8-forward": ``backward.moe_backward`` as it is, in bf16 from the bf16 weights, with the g | u of
the FP8 forward: the gradient of the high-precision layer evaluated at the FP8 forward's
activations (``reference_fp8.moe_reference_fp8``'s autograd defines it). The shared expert stays
in bf16 (plain PyTorch, as on the bf16 sync-free path).
"""
from __future__ import annotations

import functools
import weakref

import torch

from ..ops import comm, quantize, sync
from ..ops.gemm import bf16 as gemm
from ..ops.gemm import fp8 as gemm_fp8
from ..validate import MoEInputError
from .backward import moe_backward
from .forward import KeptRows
from .memory import gate_up_k, layer_buffers
from .plan import CACHED_TRANSPOSES, TRANSPOSE_IN_KERNEL, Plan
from .probe import Probe, mark
from .steps import finish_backward, finish_forward, publish_and_schedule, pull_routed_rows, signal_and_wait
from .workspace import BWD, BWD_READY

FP8_BLOCK = quantize.BLOCK
FP8_ALIGN = 16  # H and I: multiples of 16 E4M3 bytes (tensor descriptors, 16-byte async copies and pushes)

# key -> (weak references to the source weights, their (shape, strides, _version), the derived tensors)
_weight_cache: dict = {}


def clear_weight_cache() -> None:
    """Forget every cached FP8 weight copy (needed only after changing a weight through ``.data``)."""
    _weight_cache.clear()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _lookup(kind: str, weights):
    """The cached ``kind`` of ``weights`` if it is still theirs (the same tensors, shapes, strides,
    offsets and ``_version``s), else None, a stale entry dropped first (so that it and its
    successor are never held at once). A view (e.g. one half of a fused gate_up weight, made
    afresh at each call) is followed through its base tensor, whose ``_version`` it shares. While
    a CUDA graph is being captured nothing is cached: the graph quantizes the weights at each
    replay (the optimizer may have changed them in place), so nothing is found either."""
    if _capturing():
        return None
    key, owners, state = _cache_key(kind, weights)
    hit = _weight_cache.get(key)
    if hit is not None and all(r() is o for r, o in zip(hit[0], owners)) and hit[1] == state:
        return hit[2]
    if hit is not None:
        del _weight_cache[key], hit
    return None


def _store(kind: str, weights, value):
    """Cache ``value`` as the ``kind`` of ``weights`` until one of them changes or is freed
    (nothing while a CUDA graph is captured); returns ``value``."""
    if _capturing():
        return value
    key, owners, state = _cache_key(kind, weights)

    def forget(ref, key=key):
        entry = _weight_cache.get(key)
        if entry is not None and any(r is ref for r in entry[0]):
            del _weight_cache[key]

    _weight_cache[key] = (tuple(weakref.ref(o, forget) for o in owners), state, value)
    return value


def _cache_key(kind: str, weights):
    owners = tuple(w if w._base is None else w._base for w in weights)
    key = (kind,) + tuple((str(w.device), w.data_ptr()) for w in weights)
    state = tuple((w.shape, w.stride(), w.storage_offset(), w._version) for w in weights)
    return key, owners, state


def _cached(kind: str, weights, make, hold: bool = True):
    """``make()`` of ``weights``, found in the cache or made; kept there per weight version where
    ``hold`` (``_lookup``, ``_store``), else made for this use only."""
    value = _lookup(kind, weights)
    if value is None:
        value = make()
        if hold:
            _store(kind, weights, value)
    return value


def fp8_weight(w: torch.Tensor):
    """(E4M3 [E, N, K], fp32 scales [E, ceil(N/128), ceil(K/128)]) of the weight ``w`` [E, N, K],
    cached per version."""
    return _cached("blocks", (w,), lambda: quantize.quantize_blocks(w.detach().contiguous()))


def _gate_up_t_buffer(E: int, I: int, H: int, device):
    """The gate/up dgrad's B values, E4M3 [E, H, 2Ip] (``fp8_gate_up_t``), with its padding columns
    zeroed, and the two halves' [E, H, I] views that receive the transposed values."""
    Ip = gate_up_k(I)
    q = torch.empty(E, H, 2 * Ip, dtype=quantize.E4M3, device=device)
    if Ip > I:
        q.view(torch.uint8).view(E, H, 2, Ip)[..., I:].zero_()
    return q, (q[:, :, :I], q[:, :, Ip:Ip + I])


def _gate_up_t_scales(gate_scales: torch.Tensor, up_scales: torch.Tensor) -> torch.Tensor:
    """The gate/up dgrad's B scales [E, ceil(H/128), 2Ip/128]: each half's 128x128 block scales
    [E, Ip/128, ceil(H/128)] transposed (a block's scale serves both orientations), side by side."""
    return torch.cat([gate_scales.transpose(-2, -1), up_scales.transpose(-2, -1)], dim=-1)


def fp8_weight_t(w: torch.Tensor, *, hold: bool):
    """``fp8_weight(w)`` transposed: (E4M3 [E, K, N], scales [E, ceil(K/128), ceil(N/128)]), exactly:
    the down dgrad's B. Cached with the forward's copy where ``hold`` (one byte per parameter
    between steps); else made from that copy and dropped after its GEMM."""
    return _cached("t", (w,), lambda: gemm_fp8.transpose_blocks(*fp8_weight(w)), hold)


def fp8_gate_up_t(w_gate: torch.Tensor, w_up: torch.Tensor, *, hold: bool):
    """[W_gate^T | W_up^T] quantized, (E4M3 [E, H, 2Ip], scales [E, ceil(H/128), 2Ip/128]), Ip =
    ``gate_up_k(I)``: the gate/up dgrad's B (dxs = dg @ W_gate + du @ W_up is one GEMM over K =
    2Ip); cached where ``hold``, as ``fp8_weight_t``. Each half is its weight's 128x128
    quantization transposed (``fp8_weight_t``'s values), followed by Ip - I zero columns where 128
    does not divide I: every K block of 128 then lies in one half and takes that half's scale,
    and the padding's products are zeros (``reference_fp8.gate_up_grad_operands_ref`` defines the
    operand; ``quantize_gate_up_grad`` lays out A alike)."""
    def make():
        (gq, gs), (uq, us) = fp8_weight(w_gate), fp8_weight(w_up)  # [E, I, H], [E, ceil(I/128), ceil(H/128)]
        E, I, H = gq.shape
        q, (g_t, u_t) = _gate_up_t_buffer(E, I, H, gq.device)
        gemm_fp8.transpose_blocks(gq, gs, out=g_t)
        gemm_fp8.transpose_blocks(uq, us, out=u_t)
        return q, _gate_up_t_scales(gs, us)

    return _cached("gate_up_t", (w_gate, w_up), make, hold)


def fp8_layer_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, transposed: bool):
    """The forward's E4M3 copies of the three weights, ``fp8_weight`` of each. With ``transposed``
    (an FP8 backward follows and holds its operands) the backward's two transposed operands are
    cached too (``fp8_weight_t``, ``fp8_gate_up_t``): where none of the five is cached, both
    orientations of each weight come from one read of it (``quantize_blocks``'s ``out_t``: four
    bytes moved a parameter, against five for quantizing and then transposing)."""
    ws3 = (w_gate, w_up, w_down)
    # every entry of the layer looked up first: stale ones (after an optimizer step) are dropped
    # before their successors are made, whichever are made now
    found = [_lookup("blocks", (w,)) for w in ws3] + [_lookup("t", (w_down,)), _lookup("gate_up_t", (w_gate, w_up))]
    if transposed and not _capturing() and all(v is None for v in found):
        E, I, H = w_gate.shape
        dt = torch.empty(E, I, H, dtype=quantize.E4M3, device=w_down.device)  # W_down [E, H, I] transposed
        down = quantize.quantize_blocks(w_down.detach().contiguous(), out_t=dt)
        gu_q, halves = _gate_up_t_buffer(E, I, H, w_gate.device)
        gate, up = (quantize.quantize_blocks(w.detach().contiguous(), out_t=half) for w, half in zip((w_gate, w_up), halves))
        _store("t", (w_down,), (dt, down[1].transpose(-2, -1).contiguous()))
        _store("gate_up_t", (w_gate, w_up), (gu_q, _gate_up_t_scales(gate[1], up[1])))
        return tuple(_store("blocks", (w,), v) for w, v in zip(ws3, (gate, up, down)))
    return tuple(fp8_weight(w) for w in ws3)  # (the backward makes and holds what is missing)


def quantize_gate_up_grad(dgu: torch.Tensor, I: int, row_src: torch.Tensor, num_tiles: torch.Tensor, tile_rows: int,
                          outputs=None):
    """dg | du [R, 2I] -> both of its FP8 forms, from one read (``quantize.quantize_rows_and_cols``):
    - the gate/up dgrad's A: (E4M3 [R, 2Ip], scales [R, 2Ip/128]), Ip = ``gate_up_k(I)``, in
      ``fp8_gate_up_t``'s layout: dg and du each quantized per 1x128 on its own (where 128 does not
      divide I each ends in a partial tile, with its own scale) into its half, the Ip - I padding
      columns of each half zeros (E4M3 garbage could be NaN, and NaN * 0 is not 0); rows past
      ``num_tiles`` row tiles are not quantized (as ``quantize.quantize_rows``);
    - the weight gradients' operand: (E4M3 [2I, R] transposed, scales [R/128, 2I]) per 128x1,
      padding rows zeros (``quantize.quantize_cols``), dW_gate's the first I rows, dW_up's the rest.
    ``tile_rows``: a multiple of 128 (an FP8 backward's routed tile height). ``outputs``: the four
    tensors (q, scales, transposed q, its scales) given, else made here."""
    Ip = gate_up_k(I)
    R = dgu.shape[0]
    nb = Ip // FP8_BLOCK
    if outputs is None:
        outputs = (torch.empty(R, 2 * Ip, dtype=quantize.E4M3, device=dgu.device),
                   torch.empty(R, 2 * nb, dtype=torch.float32, device=dgu.device),
                   torch.empty(2 * I, R, dtype=quantize.E4M3, device=dgu.device),
                   torch.empty(-(-R // FP8_BLOCK), 2 * I, dtype=torch.float32, device=dgu.device))
    q, s, qt, st = outputs
    both = functools.partial(quantize.quantize_rows_and_cols, row_src=row_src, num_tiles=num_tiles, tile_rows=tile_rows)
    if Ip == I:  # every 1x128 tile of the row lies in one half: one launch over both
        both(dgu, out=q, scale_out=s, out_t=qt, scale_out_t=st)
        return (q, s), (qt, st)
    q.view(torch.uint8).view(R, 2, Ip)[:, :, I:].zero_()
    for half in range(2):
        cols = slice(half * I, (half + 1) * I)
        both(dgu[:, cols], out=q[:, half * Ip:half * Ip + I], scale_out=s[:, half * nb:(half + 1) * nb],
             out_t=qt[cols], scale_out_t=st[:, cols])
    return (q, s), (qt, st)


def pull_fp8_rows(ws, plan: Plan, sched, name: str, buffer: str, TK: int, *weights):
    """The schedule's rows of the E4M3 buffer ``{name}q_pub`` and their 1x128 scales ``{name}s_pub``
    (published quantized at their source) pulled from every rank into the call's ``buffer`` and
    ``{buffer}_scale`` (``memory.layer_buffers``: E4M3 [R_max, H], fp32 scales [R_max, ceil(H/128)]);
    padding rows come as zeros, scale 0. ``weights``: (w_ptrs, ws_out), the router weights pulled
    with the values, as ``pull_routed_rows``'s."""
    bufs = layer_buffers(plan)
    device = ws.ptrs[f"{name}q_pub"].device
    q, s = bufs.empty(buffer, device), bufs.empty(buffer + "_scale", device)
    pull_routed_rows(plan, sched, ws.ptrs[f"{name}q_pub"], q.view(torch.uint8), TK, sched.k, *weights)
    pull_routed_rows(plan, sched, ws.ptrs[f"{name}s_pub"], s, TK, sched.k)
    return q, s


def check_fp8(dims, plan: Plan, fp8_backward: bool) -> None:
    """Raise ``MoEInputError`` where the FP8 path cannot run this shape or plan."""
    if dims.H % FP8_ALIGN or dims.I % FP8_ALIGN:
        raise MoEInputError(f"precision='fp8' needs H and I multiples of {FP8_ALIGN}: rows of E4M3 values 16-byte "
                            f"aligned, as the GEMMs' TMA and 16-byte loads need (the last 1x128 / 128x128 "
                            f"tiles may be partial); got H={dims.H}, I={dims.I}")
    if plan.megakernel:
        raise MoEInputError("precision='fp8' runs on the path of separate launches only (megakernel=False)")
    if plan.tile_m % 16:
        raise MoEInputError(f"precision='fp8' needs a routed tile height (Tuning.tile_m) that is a multiple of 16, "
                            f"got {plan.tile_m}")
    if fp8_backward and plan.tile_m % FP8_BLOCK:
        raise MoEInputError(f"precision='fp8' (an FP8 backward) needs Tuning.tile_m a multiple of {FP8_BLOCK}: the "
                            f"weight gradients' 128x1 tiles start at each expert's first row; got {plan.tile_m}")


def moe_forward_fp8(ws, plan: Plan, x, topk_idx, topk_weights, w_gate, w_up, w_down, extra=None,
                    probe: Probe | None = None, keep=True, bf16_rows=False):
    """FP8 forward on one rank (``forward.moe_forward``'s arguments; the weights' E4M3 copies from
    ``fp8_weight``, made once per weight version; ``ws`` an FP8 workspace). Returns (y [T, H],
    ``KeptRows`` for the backward; with ``keep`` False g | u is not stored and the rows are not
    usable by a backward). The kept rows are E4M3 with their scales, or with ``bf16_rows`` (for
    a bf16 backward) bf16 rows, pulled as such and quantized here."""
    T, H = x.shape
    TK = topk_idx.numel()
    (wg_q, wg_s), (wu_q, wu_s), (wd_q, wd_s) = fp8_layer_weights(
        w_gate, w_up, w_down, transposed=keep and not bf16_rows and plan.fp8.dgrad == CACHED_TRANSPOSES)
    sched = publish_and_schedule(ws, plan, x, topk_idx, topk_weights, wg_q.shape[0], x_fp8=not bf16_rows,
                                 probe=probe)
    bufs = layer_buffers(plan)
    dev = x.device
    row_w = bufs.empty("row_w", dev)
    if bf16_rows:
        xs = bufs.empty("xs", dev)
        pull_routed_rows(plan, sched, ws.ptrs["x_pub"], xs, TK, sched.k, ws.ptrs["w_pub"], row_w)
        mark(probe, "fwd:dispatch")
        xq, x_scale = quantize.quantize_rows(xs, num_tiles=sched.num_tiles, tile_rows=plan.tile_m,
                                             out=bufs.empty("xs_fp8", dev), scale_out=bufs.empty("xs_fp8_scale", dev))
        mark(probe, "fwd:quantize")
        kept = KeptRows(sched, xs, None, row_w)
    else:
        xq, x_scale = pull_fp8_rows(ws, plan, sched, "x", "xs_fp8", TK, ws.ptrs["w_pub"], row_w)
        mark(probe, "fwd:dispatch")
        kept = KeptRows(sched, xq, None, row_w, x_scale=x_scale)
    hq, h_scale, gu = gemm_fp8.gate_up_swiglu_fp8(
        xq, x_scale, wg_q, wg_s, wu_q, wu_s, sched.tile_expert, sched.num_tiles, hq=bufs.empty("h_fp8", dev),
        h_scale=bufs.empty("h_fp8_scale", dev), gu=bufs.empty("gu", dev) if keep else None, save_gu=keep,
        kernel=plan.fp8.gate_up, tile_m=plan.tile_m, act=plan.activation)
    mark(probe, "fwd:gate_up")
    gemm_fp8.down_push_fp8(hq, h_scale, wd_q, wd_s, sched.tile_expert, sched.num_tiles, sched.row_src,
                           ws.ptrs["y_in"], TK, kernel=plan.fp8.down, tile_m=plan.tile_m)
    mark(probe, "fwd:down+push")
    kept.gu = gu
    return finish_forward(ws, plan, x, topk_weights, extra, probe=probe), kept


def moe_backward_fp8(ws, plan: Plan, dy, saved: KeptRows, w_gate, w_up, w_down, probe: Probe | None = None,
                     owned: bool = False):
    """``backward.moe_backward`` with its GEMMs in FP8 (``reference_fp8.moe_backward_reference_fp8``
    defines it). Returns (dx, d topk_weights [T, k] fp32, dw_gate, dw_up, dw_down).

    dgrad: dy rows per 1x128 against W_down's 128x128 blocks transposed (with the SwiGLU backward
    and the router-weight gradient in fp32 in the epilogue, as in bf16); dg | du per 1x128 against
    [W_gate^T | W_up^T], one GEMM over K = 2I (each half padded to a multiple of 128:
    ``fp8_gate_up_t``), rows pushed to their origin. wgrad: both operands
    per 128x1 along the rows (each expert's segment starts at a multiple of 128: tile_m is),
    padding rows as zeros; xs's are the tiles of the kept E4M3 rows' values (dequantized in fp32).

    ``owned``: as ``backward.moe_backward``'s: nothing else holds the kept rows, so this pass takes
    them out of ``saved`` and drops each once its last launch is queued; the same launches and bits.
    """
    sched, xq, x_scale, gu, row_w = saved.sched, saved.xs, saved.x_scale, saved.gu, saved.row_w
    if owned:  # the tensors are ours now: the dataclass lets go of them
        saved.xs = saved.x_scale = saved.gu = saved.row_w = None
    del saved
    T, H = dy.shape
    I = w_gate.shape[1]
    k, TK = sched.k, sched.T * sched.k
    BM = plan.tile_m
    mark(probe, "bwd:start")
    # dy quantized per 1x128 at its source, as x in the forward: the rows pulled are E4M3 + scales
    quantize.quantize_rows(dy.contiguous(), out=ws.dyq_pub.view(quantize.E4M3), scale_out=ws.dys_pub)
    signal_and_wait(ws, BWD_READY, BWD, True, sync.ERR_WAIT_PEER_READY, plan)
    mark(probe, "bwd:publish+wait")
    bufs = layer_buffers(plan)
    dev = dy.device
    dys_q, dys_s = pull_fp8_rows(ws, plan, sched, "dy", "dys_fp8", TK)
    mark(probe, "bwd:dispatch_dy")
    # Each buffer is dropped once its last launch is queued: the caching allocator hands it only to
    # later work on this stream, so the next buffers reuse it and the peak stays near one set.
    # the dgrads' B (the plan's ``fp8.dgrad``): the cached transposed copies, or the forward's copies
    # read transposed in the kernel, or transposes made here and dropped after their GEMM
    f = plan.fp8
    fwd_copies = [fp8_weight(w) for w in (w_gate, w_up, w_down)] if f.dgrad == TRANSPOSE_IN_KERNEL else None
    dgrad_outputs = (bufs.empty("dgu", dev), bufs.empty("hw", dev), bufs.empty("dw_part", dev))
    if fwd_copies is not None:
        dgu, hw, dw_part = gemm_fp8.down_dgrad_swiglu_fp8_t(dys_q, dys_s, *fwd_copies[2], gu, row_w,
                                                            sched.tile_expert, sched.num_tiles, kernel=f.down_dgrad,
                                                            tile_m=BM, outputs=dgrad_outputs, act=plan.activation)
    else:
        wd_t = fp8_weight_t(w_down, hold=f.dgrad == CACHED_TRANSPOSES)
        dgu, hw, dw_part = gemm_fp8.down_dgrad_swiglu_fp8(dys_q, dys_s, *wd_t, gu, row_w, sched.tile_expert,
                                                          sched.num_tiles, kernel=f.down_dgrad, tile_m=BM,
                                                          outputs=dgrad_outputs, act=plan.activation)
        del wd_t
    del gu, row_w, dgrad_outputs
    mark(probe, "bwd:down_dgrad+swiglu")
    # dg | du's two FP8 forms from one read: per 1x128 for the gate/up dgrad, per 128x1 (transposed)
    # for the weight gradients
    (dgu_q, dgu_qs), (dgu_t, dgu_s) = quantize_gate_up_grad(
        dgu, I, sched.row_src, sched.num_tiles, BM,
        outputs=tuple(bufs.empty(n, dev) for n in ("dgu_fp8", "dgu_fp8_scale", "dgu_t_fp8", "dgu_t_fp8_scale")))
    del dgu
    mark(probe, "bwd:quantize_dgu")
    if fwd_copies is not None:
        (gq, gs), (uq, us), _ = fwd_copies
        gemm_fp8.gate_up_dgrad_push_fp8_t(dgu_q, dgu_qs, gq, uq, _gate_up_t_scales(gs, us), sched.tile_expert,
                                          sched.num_tiles, sched.row_src, ws.ptrs["dx_in"], TK,
                                          kernel=f.gate_up_dgrad, tile_m=BM)
        del fwd_copies
    else:
        gu_t = fp8_gate_up_t(w_gate, w_up, hold=f.dgrad == CACHED_TRANSPOSES)
        gemm_fp8.rows_gemm_fp8(dgu_q, dgu_qs, *gu_t, sched.tile_expert, sched.num_tiles,
                               row_src=sched.row_src, dst_ptrs=ws.ptrs["dx_in"], TK=TK,
                               kernel=f.gate_up_dgrad, tile_m=BM)
        del gu_t
    del dgu_q, dgu_qs
    mark(probe, "bwd:gate_up_dgrad+push")
    dw_rows = gemm.reduce_dw(dw_part, out=bufs.empty("dw_rows", dev))
    comm.push_scalars_kernel[(64,)](dw_rows, sched.row_src, sched.num_tiles, ws.ptrs["dw_in"], TK,
                                    BR=256, TILE_ROWS=BM)
    mark(probe, "bwd:router_grad")

    def cols(name, t, row_scale=None):
        return quantize.quantize_cols(t, row_src=sched.row_src, num_tiles=sched.num_tiles, tile_rows=BM,
                                      row_scale=row_scale, out=bufs.empty(name, dev),
                                      scale_out=bufs.empty(name + "_scale", dev))

    # transposed E4M3 [C, R] and scales [R/128, C], padding rows zeros (the weight gradients'
    # ``padded``: segments start at multiples of tile_m, a multiple of 128); each operand quantized
    # just before its weight gradient and dropped after it, with its source (dg | du's: above, with
    # its 1x128 form)
    seg = (sched.expert_start, sched.expert_count)
    (dy_t, dy_s), (hw_t, hw_s) = cols("dys_t_fp8", dys_q, dys_s), cols("hw_t_fp8", hw)
    del dys_q, dys_s, hw
    mark(probe, "bwd:quantize_cols_down")
    dw_down = gemm_fp8.expert_wgrad_fp8(dy_t, dy_s, hw_t, hw_s, *seg, out_dtype=w_down.dtype, padded=True,
                                        kernel=f.wgrad)
    del dy_t, dy_s, hw_t, hw_s
    mark(probe, "bwd:wgrad_down")
    xs_t, xs_s = cols("xs_t_fp8", xq, x_scale)
    del xq, x_scale
    mark(probe, "bwd:quantize_cols_gate_up")
    dw_gate = gemm_fp8.expert_wgrad_fp8(dgu_t[:I], dgu_s[:, :I], xs_t, xs_s, *seg, out_dtype=w_gate.dtype,
                                        padded=True, kernel=f.wgrad)
    dw_up = gemm_fp8.expert_wgrad_fp8(dgu_t[I:], dgu_s[:, I:], xs_t, xs_s, *seg, out_dtype=w_up.dtype, padded=True,
                                      kernel=f.wgrad)
    mark(probe, "bwd:wgrad_gate_up")
    dx, dtopk = finish_backward(ws, plan, dy, T, k, probe)
    return dx, dtopk, dw_gate, dw_up, dw_down


def fp8_passes(dims, plan: Plan, precision: str, keep: bool):
    """(forward, backward) of the path of separate launches with ``precision`` "fp8" (FP8 forward
    and backward) or "fp8-forward" (FP8 forward, bf16 backward), for ``moe._TabbyMoE``; ``keep``:
    the forward keeps what a backward needs. Raises ``MoEInputError`` where FP8 cannot run."""
    fp8_backward = precision == "fp8"
    check_fp8(dims, plan, fp8_backward)
    return (functools.partial(moe_forward_fp8, keep=keep, bf16_rows=keep and not fp8_backward),
            moe_backward_fp8 if fp8_backward else moe_backward)
