"""The FP8 recipe in plain PyTorch: the definition of what Tabby's FP8 kernels compute.

The recipe is DeepSeek-V3's (arXiv 2412.19437, section 3.3), with power-of-two scales:

- values are E4M3 (``torch.float8_e4m3fn``: largest finite 448, smallest subnormal 2^-9);
- activations are scaled per 1x128 tile (one token, 128 consecutive channels): scales
  ``[T, ceil(K/128)]``; weights ``[..., N, K]`` per 128x128 block: scales
  ``[..., ceil(N/128), ceil(K/128)]``;
- partial tiles: where a dimension is not a multiple of 128, the tensor is quantized as if it
  were zero-padded to a multiple of 128, and the padding is cropped. The last tile along that
  dimension is then shorter (e.g. 64 of 128) with its own scale: zeros do not change an amax, so
  that scale is the one of the elements that exist, and the padding's zeros quantize to zeros,
  which add nothing to a GEMM's block sum. "Partial tile" and "zero-padded tile" define the same
  scales and values;
- a scale is an fp32 power of two: ``s = 2^j`` with ``j`` the smallest integer such that
  ``amax <= 448 * 2^j`` (``amax`` the tile's largest magnitude), and ``j >= -126`` (the floor: a
  tile of zeros, or of magnitudes below ``448 * 2^-126``, gets ``s = 2^-126``, never a division
  by zero);
- ``q = e4m3(x * 2^-j)``: the product is exact in fp32 (a power of two; the results of interest
  are far above fp32's subnormals), so the only rounding is the one to E4M3, round to nearest
  even. ``|x * 2^-j| <= 448`` by the choice of ``j``: nothing saturates;
- ``dequantize(q, s) = q * s``, exact in fp32;
- GEMM outputs are bf16 (or fp32 where a later step needs them).

Why powers of two, not ``amax / 448`` itself: every scale operation is then exact. Quantizing
is one rounding (to E4M3) instead of two (the division, then E4M3), so the kernels agree with
this definition bit for bit without IEEE division on the GPU; dequantizing, re-quantizing to
another block shape, transposing a weight and combining ``a_scale * b_scale`` in the GEMM lose
nothing; and MXFP8 checkpoints (E8M0 scales, powers of two) convert without rounding (below).
The cost: a tile's largest magnitude is scaled into (224, 448] instead of onto 448, at most one binade of
E4M3's range left unused, which shifts at most the tile's smallest values into E4M3's subnormals
(their relative precision is what E4M3's 3 mantissa bits give everywhere else). DeepSeek's later
releases use power-of-two (UE8M0) scales for the same reasons.

The GEMM with fp32 promotion (:func:`fp8_gemm_ref`): A quantized per 1x128, B per 128x128, the
product accumulated per K block of 128 in fp32, each block's partial product scaled by
``a_scale[row] * b_scale[col block]`` and added to an fp32 accumulator, K blocks in order. A
partial last K block is the zero-padded block: the same sum, its own scales.

MXFP8 import (:func:`mxfp8_to_blocks_ref`): E4M3 values with one E8M0 scale (``2^(e - 127)``,
``e`` a uint8, 255 = NaN) per 1x32 group along K. Each 128x128 block takes the largest group
scale, ``S = 2^(e_max - 127)``, and each group's values are re-expressed relative to it:
``v' = v * 2^-(e_max - e)``. That is exact if and only if every ``v'`` is an E4M3 value: a
value that stays at or above 2^-6 (E4M3's smallest normal) only changes exponent; one that falls
below it must be a multiple of 2^-9 (the subnormal spacing), i.e. ``v`` a multiple of
``2^(d - 9)``, ``d = e_max - e``. Zeros are always exact. When some group would lose bits the
conversion raises (a 128x128 block has one scale in Tabby's GEMM: there is no finer scale to
keep); requantizing the dequantized weights (:func:`quantize_blocks_ref`) is the lossy
alternative, to be chosen explicitly.

:func:`moe_reference_fp8` is the layer with these quantizations (the FP8 counterpart of
``tabby.moe_reference``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .activation import SWIGLU, Activation
from .activation import apply as apply_activation
from .activation import grads as activation_grads
from .validate import check_inputs

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # channels per activation tile; rows and columns per weight block
MX_GROUP = 32  # MXFP8: values per E8M0 scale, along K
MIN_SCALE_EXP = -126  # the floor of j: s >= 2^-126, fp32's smallest normal


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``j``, the smallest integer with ``amax <= 448 * 2^j``, at least -126 (amax >= 0, fp32).

    Exact, from the bits: ``amax = 1.m * 2^ea`` and ``448 = 1.75 * 2^8``, so ``j = ea - 8``,
    plus one when ``1.m > 1.75`` (mantissa bits above 0x600000).
    """
    bits = amax.float().contiguous().view(torch.int32)
    ea = ((bits >> 23) & 0xFF) - 127
    j = ea - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return j.clamp(min=MIN_SCALE_EXP)


def exp2_int(j: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^j`` for int32 ``j`` in [-126, 127], built from the bits (exact)."""
    return ((j.to(torch.int32) + 127) << 23).view(torch.float32)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3, round to nearest even (|v| <= 448 here: nothing saturates)."""
    return v.to(E4M3)


def _expand(s: torch.Tensor, rows: int, cols: int, N: int, K: int) -> torch.Tensor:
    """Per-tile values [..., nb, kb] repeated to every element [..., N, K]."""
    return s.repeat_interleave(rows, dim=-2)[..., :N, :].repeat_interleave(cols, dim=-1)[..., :K]


def _quantize_tiles(x: torch.Tensor, rows: int, cols: int):
    """x [..., N, K] per tile of ``rows x cols``: x zero-padded to whole tiles, each tile scaled by
    its amax and rounded, the padding cropped (the module docstring: partial tiles)."""
    *lead, N, K = x.shape
    nb, kb = math.ceil(N / rows), math.ceil(K / cols)
    tiles = F.pad(x.float(), (0, kb * cols - K, 0, nb * rows - N)).reshape(*lead, nb, rows, kb, cols)
    j = scale_exponent(tiles.abs().amax(dim=(-3, -1)))
    q = _to_e4m3(tiles * exp2_int(-j)[..., :, None, :, None])
    return q.reshape(*lead, nb * rows, kb * cols)[..., :N, :K].contiguous(), exp2_int(j)


def quantize_rows_ref(x: torch.Tensor):
    """Activations x [T, K] -> (q [T, K] E4M3, scales [T, ceil(K/128)] fp32), per 1x128 tile."""
    assert x.dim() == 2
    return _quantize_tiles(x, 1, BLOCK)


def quantize_cols_ref(x: torch.Tensor):
    """x [T, K] per 128x1 tile (128 consecutive tokens of one channel): (q [T, K] E4M3,
    scales [ceil(T/128), K] fp32). The recipe's quantization of an activation that a weight
    gradient contracts over tokens."""
    assert x.dim() == 2
    return _quantize_tiles(x, BLOCK, 1)


def quantize_blocks_ref(w: torch.Tensor):
    """Weights w [..., N, K] -> (q [..., N, K] E4M3, scales [..., ceil(N/128), ceil(K/128)] fp32)."""
    assert w.dim() >= 2
    return _quantize_tiles(w, BLOCK, BLOCK)


def dequantize_rows_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [T, K] = q * s, s per 1x128 tile."""
    return q.float() * _expand(s, 1, BLOCK, *q.shape[-2:])


def dequantize_cols_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [T, K] = q * s, s per 128x1 tile."""
    return q.float() * _expand(s, BLOCK, 1, *q.shape[-2:])


def dequantize_blocks_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] = q * s, s per 128x128 block."""
    return q.float() * _expand(s, BLOCK, BLOCK, *q.shape[-2:])


def mxfp8_to_blocks_ref(q: torch.Tensor, e8m0: torch.Tensor):
    """MXFP8 weights (q [..., N, K] E4M3, e8m0 [..., N, K/32] uint8) -> Tabby's layout (q' [..., N, K]
    E4M3, scales [..., ceil(N/128), ceil(K/128)] fp32), exactly: ``q' * s == q * 2^(e8m0 - 127)``
    elementwise. Raises ``ValueError`` when that is impossible (see the module docstring): a NaN
    scale (255), a NaN value, or a group whose values would lose bits."""
    *lead, N, K = q.shape
    assert K % MX_GROUP == 0 and tuple(e8m0.shape) == (*lead, N, K // MX_GROUP) and e8m0.dtype == torch.uint8
    e = e8m0.to(torch.int32)
    if (e == 255).any():
        raise ValueError("MXFP8 import: an E8M0 scale is 255 (NaN)")
    # e_max per 128x128 block: pad with 0 (2^-127, the smallest scale) so that padding never wins
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    gpb = BLOCK // MX_GROUP
    ep = F.pad(e, (0, kb * gpb - K // MX_GROUP, 0, nb * BLOCK - N))
    e_max = ep.reshape(*lead, nb, BLOCK, kb, gpb).amax(dim=(-3, -1))
    d = _expand(e_max, BLOCK, gpb, N, K // MX_GROUP) - e  # [..., N, K/32], >= 0
    d = d.clamp(max=30).repeat_interleave(MX_GROUP, dim=-1)  # d >= 18 leaves no nonzero value exact
    v = q.float() * ((127 - d) << 23).view(torch.float32)  # exact in fp32 (|v| <= 448, 2^-d >= 2^-30)
    out = _to_e4m3(v)
    bad = ~(out.float() == v)  # NaN values are never equal
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"MXFP8 import: {int(bad.sum())} values cannot be re-expressed exactly against their "
                         f"128x128 block's largest scale (first at index {where}); requantize the dequantized "
                         f"weights instead if the rounding is acceptable")
    scale = torch.where(e_max > 0, (e_max << 23), torch.full_like(e_max, 0x400000)).view(torch.float32)
    return out, scale


def mxfp8_dequantize_ref(q: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * 2^(e8m0 - 127)``, one scale per 1x32 group along K (exact: 2^-127 is an fp32 subnormal)."""
    e = e8m0.to(torch.float64).repeat_interleave(MX_GROUP, dim=-1)
    return q.float() * torch.exp2(e - 127).float()


def fp8_gemm_ref(aq, a_scale, bq, b_scale) -> torch.Tensor:
    """fp32 [M, N] = A @ B^T with fp32 promotion per K block of 128: aq [M, K] E4M3 with a_scale
    [M, ceil(K/128)] (1x128), bq [N, K] E4M3 with b_scale [ceil(N/128), ceil(K/128)] (128x128).
    Each K block's product of the raw E4M3 values is summed in fp32, then scaled by
    ``a_scale[:, kb, None] * b_scale[col block, kb]`` and added, K blocks in order. A partial last
    K block (or column block) is the zero-padded one: its products are those of the elements that
    exist, scaled by the partial block's own scales."""
    M, K = aq.shape
    N = bq.shape[0]
    acc = torch.zeros(M, N, dtype=torch.float32, device=aq.device)
    for kb in range(math.ceil(K / BLOCK)):
        sl = slice(kb * BLOCK, (kb + 1) * BLOCK)
        blk = aq[:, sl].float() @ bq[:, sl].float().t()
        bs = b_scale[:, kb].repeat_interleave(BLOCK)[:N]
        acc = acc + blk * (a_scale[:, kb, None] * bs[None, :])
    return acc


def fp8_wgrad_ref(aq, a_scale, bq, b_scale, start: int, count: int) -> torch.Tensor:
    """fp32 [M, N] = A[start:start+count]^T @ B[start:start+count] from operands quantized per 128x1
    (aq [R, M] with a_scale [ceil(R/128), M]; bq [R, N] likewise): the 128-row blocks of the buffer
    that overlap the rows in order, each block's product (its rows outside the range left out)
    scaled by ``a_scale[blk][:, None] * b_scale[blk][None, :]`` and added in fp32."""
    M, N = aq.shape[1], bq.shape[1]
    acc = torch.zeros(M, N, dtype=torch.float32, device=aq.device)
    end = start + count
    for blk in range(start // BLOCK, -(-end // BLOCK)):
        lo, hi = max(start, blk * BLOCK), min(end, (blk + 1) * BLOCK)
        part = aq[lo:hi].float().t() @ bq[lo:hi].float()
        acc = acc + part * (a_scale[blk][:, None] * b_scale[blk][None, :])
    return acc


def to_bf16(t: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """fp32 -> bf16 as a kernel stores it: "nearest" (to nearest even: compiled kernels) or
    "truncate" (toward zero: Triton 3.6's interpreter casts so)."""
    if rounding not in ("nearest", "truncate"):
        raise ValueError(f"rounding must be 'nearest' or 'truncate', got {rounding!r}")
    out = t.to(torch.bfloat16)
    if rounding == "truncate":  # the truncated value, with the cast's gradient
        cut = (t.detach().float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        out = out + (cut - out).detach()
    return out


def _straight_through(value: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
    """``value``'s numbers with ``graph``'s gradient (the FP8 forward, the high-precision backward)."""
    return graph + (value - graph).detach()


def moe_reference_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, bf16_rounding="nearest",
                      activation: Activation | None = None):
    """Tabby's FP8 layer (``MoEConfig(precision="fp8")``) in plain PyTorch, one process.

    Forward, per routed row (token t, expert e): ``xq = quantize_rows(x[t])``; ``g, u =
    fp8_gemm(xq, quantize_blocks(W_gate[e] / W_up[e]))`` (fp32), rounded to bf16 where the layer
    keeps them; ``h = silu(g) * u`` from the fp32 g, u, quantized per 1x128; ``y_e =
    fp8_gemm(hq, quantize_blocks(W_down[e]))`` rounded to bf16; ``y[t] = sum_k w[t, k] * y_e`` in
    fp32 in k order, plus the shared expert in plain bf16 PyTorch; y in x.dtype.

    Gradients: those of the fp32 layer with g and u set to the FP8 forward's values (bf16, as kept),
    which is what Tabby's FP8 forward with its bf16 backward computes: the routed output carries
    the FP8 values forward and the fp32 graph's gradient backward (so the router-weight gradient
    is ``<dy, down(silu(g) * u)>`` in high precision, not ``<dy, y_e>`` of the FP8 down GEMM).
    With expert parallelism Tabby's result on a rank equals this on that rank's tokens with every
    rank's experts (quantization is per token and per weight block, independent of the rank).
    ``bf16_rounding``: how the values the layer stores as bf16 are rounded (:func:`to_bf16`).
    ``activation``: the routed experts' (``tabby.Activation``; None: SwiGLU), in place of silu(g) * u.
    """
    act = SWIGLU if activation is None else activation
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared)
    T, H, k, E = dims.T, dims.H, dims.k, dims.E_local
    flat_e = topk_idx.reshape(-1).long()
    xf = x.float()
    xq, xs = quantize_rows_ref(x.detach())
    rows_all = torch.arange(T * k, device=x.device)
    idx, vals, graphs = [], [], []
    for e in range(E):
        rows = rows_all[flat_e == e]
        if rows.numel() == 0:
            continue
        tok = rows // k
        (gq, gs), (uq, us), (dq, ds) = (quantize_blocks_ref(w[e].detach()) for w in (w_gate, w_up, w_down))
        g8 = fp8_gemm_ref(xq[tok], xs[tok], gq, gs)
        u8 = fp8_gemm_ref(xq[tok], xs[tok], uq, us)
        hq, hs = quantize_rows_ref(apply_activation(g8, u8, act))
        idx.append(rows)
        vals.append(to_bf16(fp8_gemm_ref(hq, hs, dq, ds), bf16_rounding).float())
        # the backward's graph: g, u as the layer keeps them (bf16), its own h and y_e
        g = _straight_through(to_bf16(g8, bf16_rounding).float(), xf[tok] @ w_gate[e].float().t())
        u = _straight_through(to_bf16(u8, bf16_rounding).float(), xf[tok] @ w_up[e].float().t())
        graphs.append(apply_activation(g, u, act) @ w_down[e].float().t())

    def combine(parts):
        rows = x.new_zeros((T * k, H), dtype=torch.float32)
        if parts:
            rows = rows.index_put((torch.cat(idx),), torch.cat(parts))
        rows = rows.view(T, k, H)
        w = topk_weights.float()
        acc = w[:, 0, None] * rows[:, 0]
        for j in range(1, k):
            acc = acc + w[:, j, None] * rows[:, j]
        return acc

    y = _straight_through(combine(vals), combine(graphs))
    if shared is not None:
        sg, su, sd = shared
        y = y + ((F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()).float()
    return to_bf16(y, bf16_rounding) if x.dtype == torch.bfloat16 else y.to(x.dtype)



def pad_k(q: torch.Tensor, K: int) -> torch.Tensor:
    """E4M3 ``q [..., n, k]`` with zero columns appended up to ``K`` (E4M3's zero is the byte 0)."""
    return F.pad(q.view(torch.uint8), (0, K - q.shape[-1])).view(E4M3)


def gate_up_grad_operands_ref(g, u):
    """The gate/up dgrad's K = 2I operand from its halves ``g = (q [.., n, I], s [.., n or nb, ceil(I/128)])``
    and ``u`` likewise, each quantized on its own (per 1x128 for dg | du, per 128x128 for
    W_gate^T | W_up^T): ``q`` is [g's q | zeros | u's q | zeros], each half zero-padded to a
    multiple of 128 columns, and the scales [g's | u's], so that every K block of 128 lies in one
    half and carries that half's scale."""
    Ip = math.ceil(g[0].shape[-1] / BLOCK) * BLOCK
    return torch.cat([pad_k(g[0], Ip), pad_k(u[0], Ip)], -1), torch.cat([g[1], u[1]], -1)


def moe_backward_reference_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, dy, bf16_rounding="nearest",
                               activation: Activation | None = None):
    """The gradients of Tabby's FP8 backward (``precision="fp8"``), one process, no shared expert,
    bf16 inputs: (dx [T, H] bf16, d topk_weights [T, k] fp32, dW_gate, dW_up, dW_down bf16).

    Per expert e, its rows in (token, k) order (g, u from the FP8 forward, kept bf16; dys the
    rows' dy, bf16):

    - down dgrad: ``dh_raw = fp8_gemm(dys per 1x128, W_down[e]^T per 128x128)`` (fp32);
    - SwiGLU backward in fp32 from bf16 g, u and the row's router weight w: ``dw = sum(dh_raw *
      h)``, ``dh = w * dh_raw``, ``dg = dh * u * s * (1 + g (1 - s))``, ``du = dh * silu(g)``
      stored bf16 as ``dgu``; ``hw = w * h`` bf16;
    - gate/up dgrad: ``dxs = fp8_gemm(dgu per 1x128, [W_gate[e]^T | W_up[e]^T] per 128x128)``,
      bf16; dx summed over k in k order in fp32. The K of this GEMM is two contractions, over dg's
      I and du's I: dg and du are quantized each on its own per 1x128 (as W_gate^T and W_up^T are
      per 128x128), so where 128 does not divide I each half ends in its own partial tile; the GEMM
      runs over g's K blocks then u's, i.e. over [dg | du] and [W_gate^T | W_up^T] with each half
      zero-padded to a multiple of 128 along K (:func:`gate_up_grad_operands_ref`);
    - weight gradients from operands quantized per 128x1 along the rows (128-row tiles from the
      expert's first row): ``dW_down = wgrad(dys, hw)``, ``dW_gate = wgrad(dg, xs)``,
      ``dW_up = wgrad(du, xs)``, dys and xs as the passes quantized them (per 1x128,
      dequantized: the forward's E4M3 rows are what the layer keeps, as in DeepSeek-V3's FP8
      activation cache; with power-of-two scales requantizing them per 128x1 rounds only where a
      value falls into E4M3's subnormals); fp32 promotion per 128 rows.

    The recipe's granularity (DeepSeek-V3, section 3.3): dgrad with the output gradient per
    1x128 and the weights' 128x128 blocks transposed (the same blocks); wgrad with both operands
    per 128x1, along the dimension the GEMM contracts. ``bf16_rounding``: as in
    :func:`moe_reference_fp8`. ``activation``: as there (its backward by ``tabby.activation.grads``,
    the kernels' formulas, in place of SwiGLU's above).
    """
    act = SWIGLU if activation is None else activation
    bf16 = lambda t: to_bf16(t, bf16_rounding)  # noqa: E731
    T, H = x.shape
    k = topk_idx.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    flat_e = topk_idx.reshape(-1).long()
    xq, xsc = quantize_rows_ref(x)
    xd = dequantize_rows_ref(xq, xsc)
    rows_all = torch.arange(T * k, device=x.device)
    dx_rows = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    dtopk = torch.zeros(T * k, dtype=torch.float32, device=x.device)
    grads = [torch.zeros(w.shape, dtype=torch.float32, device=x.device) for w in (w_gate, w_up, w_down)]
    wflat = topk_weights.reshape(-1).float()
    for e in range(E):
        rows = rows_all[flat_e == e]
        if rows.numel() == 0:
            continue
        tok = rows // k
        n = rows.numel()
        (gq, gs), (uq, us), (dq, ds) = (quantize_blocks_ref(w[e]) for w in (w_gate, w_up, w_down))
        g = bf16(fp8_gemm_ref(xq[tok], xsc[tok], gq, gs)).float()
        u = bf16(fp8_gemm_ref(xq[tok], xsc[tok], uq, us)).float()
        w = wflat[rows]
        dys = dy[tok]
        dyq, dys_s = quantize_rows_ref(dys)
        dtq, dts = quantize_blocks_ref(w_down[e].t().contiguous())
        dh_raw = fp8_gemm_ref(dyq, dys_s, dtq, dts)
        if act == SWIGLU:
            sg = torch.sigmoid(g)
            h = g * sg * u
            dtopk[rows] = (dh_raw * h).sum(1)
            dh = dh_raw * w[:, None]
            dgu = bf16(torch.cat([dh * u * sg * (1 + g * (1 - sg)), dh * g * sg], dim=1))
        else:
            h = apply_activation(g, u, act)
            dtopk[rows] = (dh_raw * h).sum(1)
            dh = dh_raw * w[:, None]
            dgu = bf16(torch.cat(activation_grads(g, u, dh, act), dim=1))
        hw = bf16(h * w[:, None])
        gq_t, gs_t = gate_up_grad_operands_ref(*(quantize_blocks_ref(wt[e].t().contiguous())
                                                 for wt in (w_gate, w_up)))
        dgq, dgs = gate_up_grad_operands_ref(quantize_rows_ref(dgu[:, :I]), quantize_rows_ref(dgu[:, I:]))
        dx_rows[rows] = bf16(fp8_gemm_ref(dgq, dgs, gq_t, gs_t)).float()
        (dyc, dycs), (hwc, hwcs) = quantize_cols_ref(dequantize_rows_ref(dyq, dys_s)), quantize_cols_ref(hw)
        (dgc, dgcs), (xc, xcs) = quantize_cols_ref(dgu), quantize_cols_ref(xd[tok])
        grads[2][e] = fp8_wgrad_ref(dyc, dycs, hwc, hwcs, 0, n)
        grads[0][e] = fp8_wgrad_ref(dgc[:, :I], dgcs[:, :I], xc, xcs, 0, n)
        grads[1][e] = fp8_wgrad_ref(dgc[:, I:], dgcs[:, I:], xc, xcs, 0, n)
    dxr = dx_rows.view(T, k, H)
    dx = dxr[:, 0]
    for j in range(1, k):
        dx = dx + dxr[:, j]
    return (bf16(dx), dtopk.view(T, k), *(bf16(gr) for gr in grads))
