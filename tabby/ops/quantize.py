"""FP8 quantization kernels: the recipe of ``tabby/reference_fp8.py`` (the definition; these agree
with it bit for bit, values and scales).

- ``quantize_rows``: activations [M, K] -> E4M3 [M, K] + fp32 scales [M, ceil(K/128)], per 1x128.
- ``quantize_cols``: [R, C] -> E4M3 transposed [C, R] + fp32 scales [ceil(R/128), C], per 128x1
  (the operands of a weight gradient, which contracts over tokens), padding rows of a routed-row
  buffer as zeros.
- ``quantize_rows_and_cols``: both of the above from one read (routed rows that feed a dgrad and
  a weight gradient).
- ``quantize_blocks``: weights [E, N, K] -> E4M3 [E, N, K] + fp32 scales
  [E, ceil(N/128), ceil(K/128)], per 128x128 block.
- ``mxfp8_to_blocks``: MXFP8 weights (E4M3 + one E8M0 scale per 1x32 along K) -> the 128x128
  layout, exactly, or ``ValueError`` (when exact: ``reference_fp8``'s docstring).

Scales are fp32 powers of two ``2^j``, ``j`` the smallest integer with ``amax <= 448 * 2^j``,
``j >= -126``; the tile's values are ``e4m3(x * 2^-j)``, exact scaling then one rounding to
nearest even, no saturation needed. The jit helpers (``scale_exponent``, ``exp2_int``,
``to_e4m3``, ``quantize_tile_rows``) are what GEMM epilogues call to quantize their outputs.

Under the interpreter, Triton 3.6's fp32 -> fp8 conversion does not round to nearest even (it
rounds half away from zero within a binade and truncates below E4M3's normals) but converts a
value already on the E4M3 grid exactly: ``to_e4m3`` rounds in fp32 arithmetic there first.
Compiled for sm_90 the hardware conversion (round to nearest even) is used. The MXFP8 import
works on the E4M3 bits with integer arithmetic only (no fp8 conversion at all).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET

BLOCK = 128  # channels per activation tile; rows and columns per weight block
MX_GROUP = 32
E4M3 = torch.float8_e4m3fn


@triton.jit
def scale_exponent(amax):
    """int32 j: the smallest integer with amax <= 448 * 2^j, at least -126 (amax >= 0 fp32).
    From the bits: amax = 1.m * 2^ea, 448 = 1.75 * 2^8, so j = ea - 8 (+1 when 1.m > 1.75)."""
    bits = amax.to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    j = ea - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(j, -126)


@triton.jit
def exp2_int(j):
    """fp32 2^j for int32 j in [-126, 127] (exact, from the bits)."""
    return ((j + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(v, INTERPRET: tl.constexpr):
    """fp32 v (|v| <= 448) -> E4M3, round to nearest even."""
    if INTERPRET:
        # onto the E4M3 grid in fp32: quantum 2^(e-3) for a value in binade e, 2^-9 below 2^-6;
        # v / q is exact and below 16 in magnitude, and adding then subtracting 1.5 * 2^23
        # rounds it to an integer, to nearest even
        # (on the magnitude; the sign bit is put back from the bits: -0.0 stays -0.0)
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
        q = ((e - 3) << 23).to(tl.float32, bitcast=True)
        r = tl.abs(v) / q
        r = ((r + 12582912.0) - 12582912.0) * q
        v = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_tile_rows(x, INTERPRET: tl.constexpr):
    """fp32 x [BM, 128] (one 1x128 tile per row) -> (E4M3 [BM, 128], fp32 scales [BM])."""
    j = scale_exponent(tl.max(tl.abs(x), axis=1))
    return to_e4m3(x * exp2_int(-j)[:, None], INTERPRET), exp2_int(j)


@triton.jit
def quantize_rows_kernel(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, M, num_tiles_ptr,
                         K: tl.constexpr, BR: tl.constexpr, TILE_ROWS: tl.constexpr, GATED: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """Rows pid(0)*BR.. of x, K tile pid(1). GATED: rows in row tiles (of TILE_ROWS) past
    num_tiles are skipped (the routed-row buffers, whose used length is a device scalar)."""
    pid = tl.program_id(0)
    kb = tl.program_id(1)
    row0 = pid * BR
    if GATED:
        if row0 // TILE_ROWS >= tl.load(num_tiles_ptr):
            return
    rows = row0 + tl.arange(0, BR)
    cols = kb * 128 + tl.arange(0, 128)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q, s = quantize_tile_rows(x, INTERPRET)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=m)
    tl.store(s_ptr + rows64 * stride_sm + kb, s, mask=rows < M)


def quantize_rows(x: torch.Tensor, *, num_tiles: torch.Tensor | None = None, tile_rows: int = 128,
                  out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None):
    """x [M, K] (bf16/fp16/fp32, unit column stride) -> (q [M, K] E4M3, scales [M, ceil(K/128)] fp32),
    per 1x128 tile. ``num_tiles`` (int32 [1] on the device): only rows of the first
    ``num_tiles * tile_rows`` are quantized (the rest of ``out`` is left as it was)."""
    M, K = x.shape
    assert x.stride(-1) == 1
    nk = triton.cdiv(K, BLOCK)
    if out is None:
        out = torch.empty(M, K, dtype=E4M3, device=x.device)
    if scale_out is None:
        scale_out = torch.empty(M, nk, dtype=torch.float32, device=x.device)
    assert out.shape == (M, K) and out.stride(-1) == 1 and scale_out.shape == (M, nk)
    if M == 0 or K == 0:
        return out, scale_out
    BR = 32 if tile_rows % 32 == 0 else 16  # a block of rows lies in one row tile
    assert tile_rows % BR == 0, f"tile_rows={tile_rows} must be a multiple of 16"
    gated = num_tiles is not None
    quantize_rows_kernel[(triton.cdiv(M, BR), nk)](
        x, x.stride(0), out, out.stride(0), scale_out, scale_out.stride(0), M,
        num_tiles if gated else scale_out, K=K, BR=BR, TILE_ROWS=tile_rows, GATED=gated, INTERPRET=INTERPRET,
        num_warps=4)
    return out, scale_out


@triton.jit
def _weight_block(N, K):
    """This program's 128x128 weight block (a grid of (experts, row blocks, column blocks)): its
    expert, block indices, rows, columns and in-bounds mask."""
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    rows = nb * 128 + tl.arange(0, 128)
    cols = kb * 128 + tl.arange(0, 128)
    return e, nb, kb, rows, cols, (rows < N)[:, None] & (cols < K)[None, :]


@triton.jit
def quantize_blocks_kernel(w_ptr, stride_we, stride_wn, q_ptr, stride_qe, stride_qn, s_ptr, stride_se,
                           stride_sn, t_ptr, stride_te, stride_tk, N, K, TRANSPOSED: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """One 128x128 block (expert pid(0), row block pid(1), column block pid(2)); with TRANSPOSED
    also its values transposed, t[e, k, n] = q[e, n, k] (t as bytes; the same bits: one block, one
    scale serves both orientations)."""
    e, nb, kb, rows, cols, m = _weight_block(N, K)
    w = tl.load(w_ptr + e * stride_we + rows[:, None] * stride_wn + cols[None, :], mask=m, other=0.0)
    w = w.to(tl.float32)
    j = scale_exponent(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    q = to_e4m3(w * exp2_int(-j), INTERPRET)
    tl.store(q_ptr + e * stride_qe + rows[:, None] * stride_qn + cols[None, :], q, mask=m)
    if TRANSPOSED:
        tl.store(t_ptr + e * stride_te + cols.to(tl.int64)[:, None] * stride_tk + rows[None, :],
                 tl.trans(q.to(tl.uint8, bitcast=True)), mask=tl.trans(m))
    tl.store(s_ptr + e * stride_se + nb * stride_sn + kb, exp2_int(j))


def quantize_blocks(w: torch.Tensor, *, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                    out_t: torch.Tensor | None = None):
    """Weights w [E, N, K] (or [N, K]) -> (q E4M3 of w's shape, scales [E, ceil(N/128), ceil(K/128)] fp32).
    ``out_t``: an E4M3 [E, K, N] (or [K, N]) view with a unit last stride that also receives the
    values transposed (the backward's orientation; its scales are the scales transposed), from
    the same read of w."""
    squeeze = w.dim() == 2
    w3 = w[None] if squeeze else w
    E, N, K = w3.shape
    assert w3.stride(-1) == 1
    nb, kb = triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)
    if out is None:
        out = torch.empty(E, N, K, dtype=E4M3, device=w.device)
    if scale_out is None:
        scale_out = torch.empty(E, nb, kb, dtype=torch.float32, device=w.device)
    out3 = out[None] if out.dim() == 2 else out
    s3 = scale_out[None] if scale_out.dim() == 2 else scale_out
    assert out3.shape == (E, N, K) and out3.stride(-1) == 1 and s3.shape == (E, nb, kb) and s3.stride(-1) == 1
    t3 = out3 if out_t is None else (out_t[None] if out_t.dim() == 2 else out_t)
    if out_t is not None and (t3.shape != (E, K, N) or t3.stride(-1) != 1 or t3.dtype != E4M3):
        raise ValueError(f"quantize_blocks: out_t must be E4M3 [E, K, N] = {(E, K, N)} with a unit last stride")
    if E and nb and kb:
        quantize_blocks_kernel[(E, nb, kb)](w3, w3.stride(0), w3.stride(1), out3, out3.stride(0), out3.stride(1),
                                            s3, s3.stride(0), s3.stride(1), t3.view(torch.uint8), t3.stride(0),
                                            t3.stride(1), N, K, TRANSPOSED=out_t is not None, INTERPRET=INTERPRET,
                                            num_warps=8)
    if squeeze:
        return out3[0], s3[0]
    return out3, s3


@triton.jit
def mxfp8_to_blocks_kernel(q_ptr, stride_qe, stride_qn, e8_ptr, stride_e8e, stride_e8n,
                           o_ptr, stride_oe, stride_on, s_ptr, stride_se, stride_sn, bad_ptr, N, K):
    """One 128x128 block: S = the largest of its E8M0 group scales; each group's values times
    2^-(e_max - e), checked to be exact (bad[e, nb, kb] = the count of values that are not, NaN
    values and NaN scales included). Integer arithmetic on the E4M3 bits (q and o as uint8): a
    magnitude is an integer n in units of 2^-9 (subnormal: the mantissa; normal: (8 + mantissa)
    << (exponent - 1)); dividing by 2^d is exact iff n's low d bits are zero, and the quotient
    (at most 4 significant bits) is re-encoded."""
    e, nb, kb, rows, cols, m = _weight_block(N, K)
    # each element's group scale (a gather of the block's 128 x 4 scales)
    ge = tl.load(e8_ptr + e * stride_e8e + rows[:, None] * stride_e8n + (cols // 32)[None, :], mask=m,
                 other=0).to(tl.int32)
    e_max = tl.max(tl.max(ge, axis=1), axis=0)
    nan_scales = tl.sum(tl.sum((ge == 255).to(tl.int32), axis=1), axis=0)
    d = tl.minimum(e_max - ge, 30)  # n < 2^18: d >= 18 leaves only zero exact
    b = tl.load(q_ptr + e * stride_qe + rows[:, None] * stride_qn + cols[None, :], mask=m, other=0).to(tl.int32)
    sign = b & 0x80
    ex = (b >> 3) & 0xF
    mant = b & 7
    nan_vals = (b & 0x7F) == 0x7F
    n = tl.where(ex == 0, mant, (8 + mant) << tl.maximum(ex - 1, 0))
    lost = (n & ((1 << d) - 1)) != 0
    n2 = n >> d
    # floor(log2(n2)) from the exponent bits of n2 as fp32 (exact: n2 < 2^24)
    lead = ((n2.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ex2 = tl.where(n2 >= 8, lead - 2, 0)
    m2 = tl.where(n2 >= 8, (n2 >> tl.maximum(ex2 - 1, 0)) - 8, n2)
    o = sign | (ex2 << 3) | m2
    inexact = (lost | nan_vals) & m
    nbad = tl.sum(tl.sum(inexact.to(tl.int32), axis=1), axis=0) + nan_scales
    tl.store(o_ptr + e * stride_oe + rows[:, None] * stride_on + cols[None, :], o.to(tl.uint8), mask=m)
    # 2^(e_max - 127); e_max = 0 is 2^-127, an fp32 subnormal (bits 0x400000)
    s = tl.where(e_max > 0, e_max << 23, 0x400000).to(tl.float32, bitcast=True)
    tl.store(s_ptr + e * stride_se + nb * stride_sn + kb, s)
    tl.store(bad_ptr + (e * tl.num_programs(1) + nb) * tl.num_programs(2) + kb, nbad)


def mxfp8_to_blocks(q: torch.Tensor, e8m0: torch.Tensor):
    """MXFP8 weights (q [E, N, K] or [N, K] E4M3, e8m0 [..., N, K/32] uint8, ``2^(e - 127)`` per 1x32
    group along K) -> (q' E4M3 of q's shape, scales [..., ceil(N/128), ceil(K/128)] fp32) with
    ``q' * s == q * 2^(e8m0 - 127)`` exactly, elementwise.

    Each 128x128 block's scale is its largest group scale; a group ``d`` binades below it is
    re-expressed as ``v * 2^-d``, exact iff that is an E4M3 value (it stays >= 2^-6, or it is a
    multiple of 2^-9; zeros always). Raises ``ValueError`` naming the count and the first block
    when any value of any block is not exact, a value is NaN or a scale is 255 (NaN): one scale
    per 128x128 block leaves no finer scale to keep. Reads the verdict back to the host (a one-time
    conversion, not part of a training step).
    """
    squeeze = q.dim() == 2
    q3, e3 = (q[None], e8m0[None]) if squeeze else (q, e8m0)
    E, N, K = q3.shape
    if K % MX_GROUP:
        raise ValueError(f"MXFP8 import: K={K} is not a multiple of {MX_GROUP}")
    if tuple(e3.shape) != (E, N, K // MX_GROUP) or e3.dtype != torch.uint8 or q3.dtype != E4M3:
        raise ValueError(f"MXFP8 import: expected q [E, N, K] float8_e4m3fn and e8m0 [E, N, K/32] uint8, got "
                         f"{tuple(q3.shape)} {q3.dtype} and {tuple(e3.shape)} {e3.dtype}")
    assert q3.stride(-1) == 1 and e3.stride(-1) == 1
    nb, kb = triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)
    out = torch.empty(E, N, K, dtype=E4M3, device=q.device)
    scale = torch.empty(E, nb, kb, dtype=torch.float32, device=q.device)
    bad = torch.zeros(E, nb, kb, dtype=torch.int32, device=q.device)
    if E and nb and kb:
        qb, ob = q3.view(torch.uint8), out.view(torch.uint8)
        mxfp8_to_blocks_kernel[(E, nb, kb)](qb, qb.stride(0), qb.stride(1), e3, e3.stride(0), e3.stride(1),
                                            ob, ob.stride(0), ob.stride(1), scale, scale.stride(0),
                                            scale.stride(1), bad, N, K, num_warps=8)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(f"MXFP8 import: {int(bad.sum())} values cannot be expressed exactly against their "
                         f"128x128 block's largest scale (or are NaN; first block [e, n/128, k/128] = {first}); "
                         f"requantize the dequantized weights (quantize_blocks) if the rounding is acceptable")
    if squeeze:
        return out[0], scale[0]
    return out, scale


# The 128x1 kernels hold a program's 128 rows as four interleaved groups of 32 (group g: rows 4i + g),
# each loaded, scaled and quantized in the same register layout. The transposed result then leaves
# as 32-bit words, each the bytes of 4 consecutive rows of one column (``pack_rows4``): the
# transpose through shared memory moves words, not bytes, and the column amax takes the
# elementwise maximum of the four groups before reducing over 32 rows.


@triton.jit
def pack_rows4(q0, q1, q2, q3):
    """Four E4M3 tiles [G, BC], rows 4i + 0..3 of the same columns -> uint32 [G, BC], each word the
    four rows' bytes in memory order (little-endian: row 4i in the low byte)."""
    w = q0.to(tl.uint8, bitcast=True).to(tl.uint32)
    w |= q1.to(tl.uint8, bitcast=True).to(tl.uint32) << 8
    w |= q2.to(tl.uint8, bitcast=True).to(tl.uint32) << 16
    return w | (q3.to(tl.uint8, bitcast=True).to(tl.uint32) << 24)


@triton.jit
def _routed_rows_valid(rows, R, row_src_ptr, used_rows, MASKED: tl.constexpr):
    """Which ``rows`` hold values: below R and, where MASKED (a routed-row buffer), below
    ``used_rows`` (the used row tiles' rows) with a source (row_src >= 0; padding rows count as
    zeros)."""
    valid = rows < R
    if MASKED:
        valid = valid & (rows < used_rows)
        valid = valid & (tl.load(row_src_ptr + rows, mask=valid, other=-1) >= 0)
    return valid


@triton.jit
def _load_group(x_ptr, stride_xm, rows, valid, cols, C, xs_ptr, stride_xsm, scale_col, ROW_SCALED: tl.constexpr):
    """fp32 values of ``rows`` x ``cols`` (zeros where a row is not valid or a column is past C);
    ROW_SCALED: x is E4M3 and each row's value is x times its 1x128 scale (column ``scale_col``)."""
    rows64 = rows.to(tl.int64)
    m = valid[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if ROW_SCALED:
        x = x * tl.load(xs_ptr + rows64 * stride_xsm + scale_col, mask=valid, other=0.0)[:, None]
    return x


@triton.jit
def _store_cols_transposed(qt_ptr, stride_qt, q0, q1, q2, q3, row0, R, cols, C, PACKED: tl.constexpr):
    """The four groups' E4M3 values [32, BC] (rows row0 + 4i + g) into qt [C, R] transposed: as
    words (``pack_rows4``; qt's rows and stride multiples of 4 bytes, R a multiple of 4) or, not
    PACKED, byte by byte."""
    cm = (cols < C)[None, :]
    i = tl.arange(0, 32)
    if PACKED:
        words = row0 // 4 + i
        ptrs = qt_ptr.to(tl.pointer_type(tl.uint32)) + cols.to(tl.int64)[None, :] * (stride_qt // 4) + words[:, None]
        tl.store(ptrs, pack_rows4(q0, q1, q2, q3), mask=(words * 4 < R)[:, None] & cm)
    else:
        base = qt_ptr + cols.to(tl.int64)[None, :] * stride_qt
        r = row0 + 4 * i
        tl.store(base + r[:, None], q0, mask=(r < R)[:, None] & cm)
        tl.store(base + (r + 1)[:, None], q1, mask=(r + 1 < R)[:, None] & cm)
        tl.store(base + (r + 2)[:, None], q2, mask=(r + 2 < R)[:, None] & cm)
        tl.store(base + (r + 3)[:, None], q3, mask=(r + 3 < R)[:, None] & cm)


@triton.jit
def _row_col_block(nr, nc):
    """(row block, column block) of this program on a 1-D grid of nr x nc blocks, a row block's
    column blocks consecutive, so that the programs running together read whole rows (a program
    reads 64-256 bytes of each of its rows; the other order, a column block's row blocks
    consecutive, measured 12-15% slower)."""
    pid = tl.program_id(0)
    return pid // nc, pid % nc


@triton.jit
def _quantize_cols4(x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """fp32 [32, BC] x4, the 128 rows of one 128x1 tile per column held as four groups -> (their
    E4M3 values, the columns' scales [BC]): ``quantize_tile_rows`` along the other axis."""
    amax = tl.max(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))), axis=0)
    j = scale_exponent(amax)
    mult = exp2_int(-j)[None, :]
    return (to_e4m3(x0 * mult, INTERPRET), to_e4m3(x1 * mult, INTERPRET), to_e4m3(x2 * mult, INTERPRET),
            to_e4m3(x3 * mult, INTERPRET), exp2_int(j))


@triton.jit
def quantize_cols_kernel(x_ptr, stride_xm, qt_ptr, stride_qt, s_ptr, stride_sm, R, C, row_src_ptr, num_tiles_ptr,
                         xs_ptr, stride_xsm, TILE_ROWS: tl.constexpr, MASKED: tl.constexpr, BC: tl.constexpr,
                         ROW_SCALED: tl.constexpr, PACKED: tl.constexpr, INTERPRET: tl.constexpr):
    """A row block of 128 (one 128x1 tile per column) and BC columns (``_row_col_block``), stored transposed
    (qt [C, R]: a weight gradient reads the rows as its contiguous K). MASKED: rows whose
    row_src is negative (padding) or that lie past the used row tiles count as zeros, and are
    stored as zeros. ROW_SCALED: x is E4M3 with 1x128 scales xs [R, ceil(C/128)]; its values are
    x * xs in fp32 (exact: a power of two times an E4M3 value). BC divides 128, so a program's
    columns share one scale per row. The rows as four groups (above ``pack_rows4``)."""
    rb, cb = _row_col_block(tl.cdiv(R, 128), tl.cdiv(C, BC))
    row0 = rb * 128
    cols = cb * BC + tl.arange(0, BC)
    scale_col = (cb * BC) // 128
    r = row0 + 4 * tl.arange(0, 32)
    used_rows = R
    if MASKED:
        used_rows = tl.load(num_tiles_ptr) * TILE_ROWS
    v0 = _routed_rows_valid(r, R, row_src_ptr, used_rows, MASKED)
    v1 = _routed_rows_valid(r + 1, R, row_src_ptr, used_rows, MASKED)
    v2 = _routed_rows_valid(r + 2, R, row_src_ptr, used_rows, MASKED)
    v3 = _routed_rows_valid(r + 3, R, row_src_ptr, used_rows, MASKED)
    q0, q1, q2, q3, s = _quantize_cols4(
        _load_group(x_ptr, stride_xm, r, v0, cols, C, xs_ptr, stride_xsm, scale_col, ROW_SCALED),
        _load_group(x_ptr, stride_xm, r + 1, v1, cols, C, xs_ptr, stride_xsm, scale_col, ROW_SCALED),
        _load_group(x_ptr, stride_xm, r + 2, v2, cols, C, xs_ptr, stride_xsm, scale_col, ROW_SCALED),
        _load_group(x_ptr, stride_xm, r + 3, v3, cols, C, xs_ptr, stride_xsm, scale_col, ROW_SCALED),
        INTERPRET)
    _store_cols_transposed(qt_ptr, stride_qt, q0, q1, q2, q3, row0, R, cols, C, PACKED)
    tl.store(s_ptr + rb * stride_sm + cols, s, mask=cols < C)


def _packs(qt: torch.Tensor) -> bool:
    """Whether qt [C, R] takes the 128x1 kernels' stores as 32-bit words: R, its row stride and its
    address multiples of 4 bytes."""
    return qt.shape[1] % 4 == 0 and qt.stride(0) % 4 == 0 and qt.data_ptr() % 4 == 0


def quantize_cols(x: torch.Tensor, *, row_src: torch.Tensor | None = None, num_tiles: torch.Tensor | None = None,
                  tile_rows: int = 128, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None):
    """x [R, C] -> (qt [C, R] E4M3: the quantized x transposed, scales [ceil(R/128), C] fp32), per
    128x1 tile (128 consecutive rows of one column: the recipe's quantization of an operand that a
    weight gradient contracts over tokens; transposed so that the GEMM reads its K contiguous).
    With ``row_src`` and ``num_tiles`` (a routed-row buffer), padding rows and rows past the used
    tiles count as zeros and are stored as zeros. ``row_scale``: x is E4M3 quantized per 1x128
    with these fp32 scales [R, ceil(C/128)]; the tiles are those of its dequantized values. ``out``,
    ``scale_out``: qt and the scales, given (contiguous), else made here."""
    R, C = x.shape
    assert x.stride(-1) == 1
    scaled = row_scale is not None
    if scaled:
        assert x.dtype == E4M3 and row_scale.dtype == torch.float32 and row_scale.shape == (R, triton.cdiv(C, BLOCK))
    nr = triton.cdiv(R, BLOCK)
    qt = torch.empty(C, R, dtype=E4M3, device=x.device) if out is None else out
    s = torch.empty(nr, C, dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    assert qt.shape == (C, R) and qt.dtype == E4M3 and s.shape == (nr, C) and s.dtype == torch.float32
    if R == 0 or C == 0:
        return qt, s
    masked = row_src is not None
    assert masked == (num_tiles is not None)
    # E4M3 rows: 128 columns a program (its rows' 128 bytes, one scale each: 15% faster than 64);
    # bf16: 64 (128 bytes a row; 128 columns measured 2-8% slower)
    BC = 128 if scaled else 64
    quantize_cols_kernel[(nr * triton.cdiv(C, BC),)](
        x, x.stride(0), qt, qt.stride(0), s, s.stride(0), R, C, row_src if masked else s, num_tiles if masked else s,
        row_scale if scaled else s, row_scale.stride(0) if scaled else 0, TILE_ROWS=tile_rows, MASKED=masked, BC=BC,
        ROW_SCALED=scaled, PACKED=_packs(qt), INTERPRET=INTERPRET, num_warps=4)
    return qt, s


@triton.jit
def _rows_group(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, rows, cols, cmask, kb, R, row_src_ptr, nt,
                TILE_ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """One group of ``quantize_rows_cols_kernel``: its rows' 1x128 tiles quantized and stored (rows
    in the used tiles); returns the rows' fp32 values for the columns' tiles, zeros where a row
    does not count (padding, unused)."""
    used = (rows < R) & (rows < nt * TILE_ROWS)
    m = used[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q, s = quantize_tile_rows(x, INTERPRET)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=m)
    tl.store(s_ptr + rows64 * stride_sm + kb, s, mask=used)
    valid = used & (tl.load(row_src_ptr + rows, mask=used, other=-1) >= 0)
    return tl.where(valid[:, None], x, 0.0)


@triton.jit
def quantize_rows_cols_kernel(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, qt_ptr, stride_qt, st_ptr,
                              stride_stm, R, C, row_src_ptr, num_tiles_ptr, TILE_ROWS: tl.constexpr,
                              PACKED: tl.constexpr, INTERPRET: tl.constexpr):
    """A row block and a column block of 128 (``_row_col_block``): each row's 1x128 tile (``quantize_rows_kernel``
    gated by num_tiles) and each column's 128x1 tile (``quantize_cols_kernel`` MASKED), from one
    read, the rows as four groups (above ``pack_rows4``). A program's rows lie in one row tile
    (TILE_ROWS a multiple of 128)."""
    rb, kb = _row_col_block(tl.cdiv(R, 128), tl.cdiv(C, 128))
    row0 = rb * 128
    cols = kb * 128 + tl.arange(0, 128)
    cmask = cols < C
    nt = tl.load(num_tiles_ptr)
    r = row0 + 4 * tl.arange(0, 32)
    q0, q1, q2, q3, sc = _quantize_cols4(
        _rows_group(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, r, cols, cmask, kb, R, row_src_ptr, nt,
                    TILE_ROWS, INTERPRET),
        _rows_group(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, r + 1, cols, cmask, kb, R, row_src_ptr, nt,
                    TILE_ROWS, INTERPRET),
        _rows_group(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, r + 2, cols, cmask, kb, R, row_src_ptr, nt,
                    TILE_ROWS, INTERPRET),
        _rows_group(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, stride_sm, r + 3, cols, cmask, kb, R, row_src_ptr, nt,
                    TILE_ROWS, INTERPRET),
        INTERPRET)
    _store_cols_transposed(qt_ptr, stride_qt, q0, q1, q2, q3, row0, R, cols, C, PACKED)
    tl.store(st_ptr + rb * stride_stm + cols, sc, mask=cmask)


def quantize_rows_and_cols(x: torch.Tensor, *, row_src: torch.Tensor, num_tiles: torch.Tensor, tile_rows: int = 128,
                           out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                           out_t: torch.Tensor | None = None, scale_out_t: torch.Tensor | None = None):
    """``quantize_rows(x, num_tiles=, tile_rows=, out=, scale_out=)`` and ``quantize_cols(x,
    row_src=, num_tiles=, tile_rows=)`` from one read of x (a routed-row buffer [R, C] whose rows
    feed both a dgrad and a weight gradient), bit for bit those two: ((q [R, C], scales [R,
    ceil(C/128)]), (qt [C, R], scales [ceil(R/128), C])). ``out_t`` / ``scale_out_t``: where the
    transposed result goes (views of a larger buffer allowed, unit last stride). ``tile_rows``: a
    multiple of 128."""
    R, C = x.shape
    assert x.stride(-1) == 1 and tile_rows % BLOCK == 0, (x.stride(), tile_rows)
    nk, nr = triton.cdiv(C, BLOCK), triton.cdiv(R, BLOCK)
    out = torch.empty(R, C, dtype=E4M3, device=x.device) if out is None else out
    scale_out = torch.empty(R, nk, dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    out_t = torch.empty(C, R, dtype=E4M3, device=x.device) if out_t is None else out_t
    scale_out_t = torch.empty(nr, C, dtype=torch.float32, device=x.device) if scale_out_t is None else scale_out_t
    assert out.shape == (R, C) and scale_out.shape == (R, nk) and out_t.shape == (C, R) and scale_out_t.shape == (nr, C)
    assert all(t.stride(-1) == 1 for t in (out, scale_out, out_t, scale_out_t))
    if R and C:
        quantize_rows_cols_kernel[(nr * nk,)](
            x, x.stride(0), out, out.stride(0), scale_out, scale_out.stride(0), out_t, out_t.stride(0), scale_out_t,
            scale_out_t.stride(0), R, C, row_src, num_tiles, TILE_ROWS=tile_rows, PACKED=_packs(out_t),
            INTERPRET=INTERPRET, num_warps=4)
    return (out, scale_out), (out_t, scale_out_t)
