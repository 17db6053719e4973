"""bf16 expert GEMMs warp-specialized and persistent (Gluon, sm_90): the forward's routed GEMMs and
the weight gradients.

- ``rows_launch``: the rows GEMM ``A @ B[e]^T`` over the routed-row buffer (B [E, N, K], K-major:
  ``nn.Linear``'s; or B [E, K, N] read N-major: a transposed down_proj as it lies), + a bias, the
  down projection, with fp8_ws's stored-rows or pushed-rows epilogue. Tiles of 128 x ``tile_n``
  (256 or 128).
- ``gate_up_swiglu_ws``: gate/up with the activation (g and u saved where asked), 128 x 128 tiles
  of h, the weights in any of ``validate.LAYOUTS`` (gpt-oss's interleaved g, u in one 128 x 256
  product), with biases (the products start from them), gated or not.
- ``down_dgrad_ws``: the down dgrad with the activation's backward on an epilogue partition of its
  own (128 x 128 or 128 x 256 tiles).
- ``expert_wgrad_ws``: the per-expert weight gradients.

Same operands, layout contract and results as bf16.py's kernels (its docstring): each 128-row tile
one expert's, fp32 sums over K in order, bf16 out (gate/up with biases within rounding: there the
Triton kernel adds them after the sums; the down dgrad at 128 x 256 within a rounding: dh_raw
handed over in bf16). The gate/up dgrad stays on bf16.py's kernel (no faster here:
docs/performance.md, "Warp-specialized bf16 GEMMs").

Structure: a CTA is three partitions of one ``gl.warp_specialize``: a one-warp TMA producer fills
a ring of ``stages`` stages (A's two 64-row halves and B's block of 64 K), each stage with a
``ready`` barrier (TMA transaction bytes) and an ``empty`` barrier counting one arrival per
consumer; two consumer warpgroups, each owning 64 rows of the tile, issue each block's wgmma into
their accumulator and keep one block in flight (wait 1), releasing the stage before it. Persistent:
one program per SM walks the tiles in ``grouped_tile`` order (fp8_ws's ``_walk_row_tiles``); every
partition walks the same sequence and the ring's stage and phase follow a running K-block count,
so the producer loads the next tile while the consumers run the last one's epilogue.

Why it cannot deadlock: the producer waits only for stages the consumers release after reading
them, and the consumers only for stages the producer has filled; both walk the same blocks in the
same order, inside one CTA (no wait on another program: any number of resident programs finishes).

Runs where ``fits``: sm_90, schedule tiles a multiple of 128 rows, TMA-addressable operands (16-byte
aligned bases and row strides, K and N multiples of 8; a weight's experts each starting on a row of
its descriptor, ``_pitch``: halves of a fused gate_up_proj included). A block past K reads TMA's
zeros in A (and in B where K runs along its columns); a partial last column tile reads the next
rows of B (another expert's, or TMA's zeros past the last), whose columns are not stored. Where K
runs along B's rows (the transposed layouts) K must be a multiple of 64, so that no block reads
another expert's rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...activation import SWIGLU, Activation
from ...validate import LAYOUT_KN, LAYOUT_KN_PAIRED, LAYOUT_NK
from .activation import act_fwd
from .bf16 import W_KN, W_KN_PAIRED, W_LAYOUT_CODES, W_NK, grouped_tile, paired_gate_up, tma_aligned
from .fp8_ws import EPI_PUSH, EPI_STORE, _epilogue, _grid, _ring_fill, _ring_gate_up, _ring_rows, _sm90, _store_tile
from .ws_common import (_walk_row_tiles, dgrad_epilogue, handoff_barriers, handoff_smem, tile_handed_over, tile_read,
                        wait_tile_free, wait_tile_full)

BM = gl.constexpr(128)  # two consumer warpgroups of 64 rows
HALF = gl.constexpr(64)
BK = gl.constexpr(64)  # 128 bytes of bf16: one swizzle span, TMA's widest swizzled box row

__all__ = ["EPI_PUSH", "EPI_STORE", "fits", "rows_launch", "gate_up_swiglu_ws", "down_dgrad_ws", "expert_wgrad_ws"]


# --------------------------------------------------------------------------------------------
# the rows GEMM
# --------------------------------------------------------------------------------------------

@gluon.jit
def _load_a_halves(a_desc, row0, k0, bar, a_lo, a_hi, s):
    """A's two 64-row halves of the tile at row0, K block k0, into stage s (one per consumer)."""
    tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_lo.index(s))
    tma.async_copy_global_to_shared(a_desc, [row0 + HALF, k0], bar, a_hi.index(s))


@gluon.jit
def _rows_producer_tile(it, pid_m, pid_n, e, a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, b_pitch, NK,
                        TILE_N: gl.constexpr, STAGES: gl.constexpr, B_KN: gl.constexpr):
    """A tile's NK K blocks: A's two halves at columns kb * BK and B's block: expert e's rows
    e * b_pitch + pid_n * TILE_N, columns kb * BK; B_KN (B [E, K, N]): rows e * b_pitch + kb * BK,
    columns pid_n * TILE_N (b_pitch: B's rows from one expert to the next in b_desc)."""
    row0 = pid_m * BM
    brow = e * b_pitch + pid_n * TILE_N
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for kb in range(NK):
        s, bar = _ring_fill(ready, empty, it, nbytes, STAGES)
        k0 = kb * BK
        _load_a_halves(a_desc, row0, k0, bar, a_lo, a_hi, s)
        if B_KN:
            tma.async_copy_global_to_shared(b_desc, [e * b_pitch + k0, pid_n * TILE_N], bar, b_bufs.index(s))
        else:
            tma.async_copy_global_to_shared(b_desc, [brow, k0], bar, b_bufs.index(s))
        it += 1
    return it


@gluon.jit
def _rows_producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
                   b_pitch, NK, TILE_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   SCHED_BM: gl.constexpr, B_KN: gl.constexpr):
    it = 0
    _walk_row_tiles(_rows_producer_tile, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, b_pitch, NK, TILE_N, STAGES,
                                          B_KN), it, tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(N, TILE_N),
                    GROUP_M, SCHED_BM)


@gluon.jit
def _b_operand(buf, B_KN: gl.constexpr):
    """A stage's B block as the wgmma's [K, N] operand: a K-major block [N, K] read transposed, or
    (B_KN) an N-major block [K, N] as it lies (wgmma reads either from shared memory)."""
    if B_KN:
        return buf
    else:
        return buf.permute((1, 0))


@gluon.jit
def _mainloop(acc, a_bufs, b_bufs, ready, empty, it, NK, STAGES: gl.constexpr, B_KN: gl.constexpr = False):
    """A consumer's K loop: acc += A_half @ B over NK blocks (``_b_operand``), one wgmma in flight;
    each stage is released once the wgmma after it is issued and it has completed (wait 1), the
    last at the end. Returns (acc, the K-block count)."""
    for kb in range(NK):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        tok = warpgroup_mma(a_bufs.index(s), _b_operand(b_bufs.index(s), B_KN), acc, is_async=True)
        acc = _retire_previous(tok, kb, it, empty, STAGES)
        it += 1
    return _drain(acc, it, NK, empty, STAGES), it


@gluon.jit
def _retire_previous(tok, kb, it, empty, STAGES: gl.constexpr):
    """Consumer, after issuing K block ``it``'s wgmma (token ``tok``): wait for the one before it (one
    group stays in flight) and release that block's stage; returns the accumulator."""
    acc = warpgroup_mma_wait(1, deps=(tok, ))
    if kb > 0:
        mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _drain(acc, it, nk, empty, STAGES: gl.constexpr):
    """Consumer, after a tile's last K block: wait for its wgmma and release its stage (none where
    the tile had no K blocks); returns the accumulator."""
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if nk > 0:
        mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _rows_consumer_tile(it, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, epi, N, NK, HALF_ROW: gl.constexpr,
                        TILE_N: gl.constexpr, STAGES: gl.constexpr, EPILOGUE: gl.constexpr, B_KN: gl.constexpr,
                        HAS_BIAS: gl.constexpr, bias_ptr, stride_bias_e):
    """A consumer's 64 rows of one tile: the K loop, + bias[e] (HAS_BIAS: [E, N], unit column
    stride), then the epilogue per 128 columns (fp8_ws's, so a 256-wide tile's halves are
    128-column tiles of their own)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, TILE_N, 16])
    acc = gl.zeros([HALF, TILE_N], gl.float32, layout)
    acc, it = _mainloop(acc, a_bufs, b_bufs, ready, empty, it, NK, STAGES, B_KN)
    if HAS_BIAS:
        cols = pid_n * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + e.to(gl.int64) * stride_bias_e + cols, mask=cols < N, other=0.0)
        acc += bias.to(gl.float32)[None, :]
    rows = pid_m.to(gl.int64) * BM + HALF_ROW + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    if TILE_N == 256:
        lo, hi = gl.split(gl.permute(gl.reshape(acc, (HALF, 2, 128)), (0, 2, 1)))
        _epilogue(lo, rows, 2 * pid_n, N, epi, EPILOGUE, layout)
        if (2 * pid_n + 1) * 128 < N:  # a half wholly past N has nothing to store
            _epilogue(hi, rows, 2 * pid_n + 1, N, epi, EPILOGUE, layout)
    else:
        _epilogue(acc, rows, pid_n, N, epi, EPILOGUE, layout)
    return it


@gluon.jit
def _rows_consumer(a_bufs, b_bufs, ready, empty, epi, tile_expert_ptr, num_tiles_ptr, num_m, N, NK,
                   HALF_ROW: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr, B_KN: gl.constexpr, HAS_BIAS: gl.constexpr,
                   bias_ptr, stride_bias_e):
    it = 0
    _walk_row_tiles(_rows_consumer_tile, (a_bufs, b_bufs, ready, empty, epi, N, NK, HALF_ROW, TILE_N, STAGES,
                                          EPILOGUE, B_KN, HAS_BIAS, bias_ptr, stride_bias_e), it, tile_expert_ptr,
                    num_tiles_ptr, num_m, gl.cdiv(N, TILE_N), GROUP_M, SCHED_BM)


@gluon.jit
def rows_gemm_ws_kernel(a_desc, b_desc, epi, tile_expert_ptr, num_tiles_ptr, num_m, N, b_pitch, NK,
                        TILE_N: gl.constexpr,
                        STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr,
                        EPILOGUE: gl.constexpr, B_KN: gl.constexpr = False, HAS_BIAS: gl.constexpr = False,
                        bias_ptr=None, stride_bias_e=None):
    """A @ B[e]^T (B [E, N, K]), or A @ B[e] with B_KN (B [E, K, N]: a transposed down_proj read as
    it lies), + bias[e] with HAS_BIAS, through EPILOGUE; expert e's B from row e * b_pitch of
    b_desc."""
    a_lo, a_hi, b_bufs, ready, empty = _ring_rows(a_desc, b_desc, STAGES)
    gl.warp_specialize([
        (_rows_consumer, (a_lo, b_bufs, ready, empty, epi, tile_expert_ptr, num_tiles_ptr, num_m, N, NK, 0, TILE_N,
                          STAGES, GROUP_M, SCHED_BM, EPILOGUE, B_KN, HAS_BIAS, bias_ptr, stride_bias_e)),
        (_rows_consumer, (a_hi, b_bufs, ready, empty, epi, tile_expert_ptr, num_tiles_ptr, num_m, N, NK, HALF, TILE_N,
                          STAGES, GROUP_M, SCHED_BM, EPILOGUE, B_KN, HAS_BIAS, bias_ptr, stride_bias_e)),
        (_rows_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
                          b_pitch, NK, TILE_N, STAGES, GROUP_M, SCHED_BM, B_KN)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------
# gate/up with the SwiGLU
# --------------------------------------------------------------------------------------------
#
# A stage is A's two halves and W_gate's and W_up's 128 x 64 blocks (48 KB); each consumer holds g's
# and u's 64 x 128 accumulators (128 registers) and issues both blocks' wgmmas before waiting for
# the previous stage's pair (wait 2). The weights as they lie (W_LAYOUT, bf16.py's W_NK / W_KN /
# W_KN_PAIRED): transposed ones (K = NK * BK rows an expert) in 64 x 128 blocks read N-major;
# gpt-oss's interleaved g, u in one 64 x 256 block (the same 48 KB a stage) into one [64, 256]
# product split into g and u after the K loop (wait 1). Without GATED (an ungated activation)
# only W_up's blocks are loaded and multiplied.

@gluon.jit
def _gate_up_producer_tile(it, pid_m, pid_n, e, a_desc, wg_desc, wu_desc, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty,
                           w_pitch, NK, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr, GATED: gl.constexpr):
    """A tile's NK K blocks; expert e's weights from row e * w_pitch of their descriptors."""
    row0 = pid_m * BM
    brow = e * w_pitch + pid_n * 128
    TWO_BLOCKS: gl.constexpr = GATED and W_LAYOUT != W_KN_PAIRED
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + (2 if TWO_BLOCKS else 1) * wu_desc.block_type.nbytes
    for kb in range(NK):
        s, bar = _ring_fill(ready, empty, it, nbytes, STAGES)
        k0 = kb * BK
        _load_a_halves(a_desc, row0, k0, bar, a_lo, a_hi, s)
        if W_LAYOUT == W_NK:
            if GATED:
                tma.async_copy_global_to_shared(wg_desc, [brow, k0], bar, bg_bufs.index(s))
            tma.async_copy_global_to_shared(wu_desc, [brow, k0], bar, bu_bufs.index(s))
        elif W_LAYOUT == W_KN:
            if GATED:
                tma.async_copy_global_to_shared(wg_desc, [e * w_pitch + k0, pid_n * 128], bar, bg_bufs.index(s))
            tma.async_copy_global_to_shared(wu_desc, [e * w_pitch + k0, pid_n * 128], bar, bu_bufs.index(s))
        else:  # g and u interleaved: columns 2 * pid_n * 128 .. + 255 hold both halves' 128
            tma.async_copy_global_to_shared(wu_desc, [e * w_pitch + k0, pid_n * 256], bar, bu_bufs.index(s))
        it += 1
    return it


@gluon.jit
def _gate_up_producer(a_desc, wg_desc, wu_desc, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty, tile_expert_ptr,
                      num_tiles_ptr, num_m, I, w_pitch, NK, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                      SCHED_BM: gl.constexpr, W_LAYOUT: gl.constexpr, GATED: gl.constexpr):
    it = 0
    _walk_row_tiles(_gate_up_producer_tile, (a_desc, wg_desc, wu_desc, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty,
                                             w_pitch, NK, STAGES, W_LAYOUT, GATED), it, tile_expert_ptr, num_tiles_ptr,
                    num_m,
                    gl.cdiv(I, 128), GROUP_M, SCHED_BM)


@gluon.jit
def _bias_row(bg_ptr, bu_ptr, stride_bias_e, e, col0, I, N: gl.constexpr, PAIRED: gl.constexpr,
              BIAS_STRIDE_N: gl.constexpr, layout: gl.constexpr):
    """A tile's bias row [N] fp32 for the product in ``layout``: bg[e] (or bu[e]: pass it as bg_ptr) at
    columns col0 .. col0 + N - 1; PAIRED: g's and u's interleaved (column 2j: bg[e][col0 + j],
    2j + 1: bu[e][col0 + j]); zeros at or past I."""
    j = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    if PAIRED:
        cols = col0 + j // 2
        off = e.to(gl.int64) * stride_bias_e + cols * BIAS_STRIDE_N
        ptrs = gl.where(j % 2 == 0, bg_ptr + off, bu_ptr + off)
    else:
        cols = col0 + j
        ptrs = bg_ptr + e.to(gl.int64) * stride_bias_e + cols * BIAS_STRIDE_N
    return gl.load(ptrs, mask=cols < I, other=0.0).to(gl.float32)


@gluon.jit
def _gate_up_products(it, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, I, NK, STAGES: gl.constexpr,
                      W_LAYOUT: gl.constexpr, GATED: gl.constexpr, HAS_BIAS: gl.constexpr, bg_ptr, bu_ptr,
                      stride_bias_e, BIAS_STRIDE_N: gl.constexpr):
    """A consumer's (g, u) [64, 128] fp32 of one tile and the K-block count (not GATED: u twice).
    HAS_BIAS: the products start from the biases (accumulators set to bg[e], bu[e] before the first
    wgmma: no bias registers live through the epilogue)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    B_KN: gl.constexpr = W_LAYOUT != W_NK
    if W_LAYOUT == W_KN_PAIRED:
        wide: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
        gu = gl.zeros([HALF, 256], gl.float32, wide)
        if HAS_BIAS:
            gu += _bias_row(bg_ptr, bu_ptr, stride_bias_e, e, pid_n * 128, I, 256, True, BIAS_STRIDE_N, wide)[None, :]
        gu, it = _mainloop(gu, a_bufs, bu_bufs, ready, empty, it, NK, STAGES, True)
        g, u = gl.split(gl.reshape(gu, (HALF, 128, 2)))  # column 2i: g's i, 2i + 1: u's i
    elif GATED:
        g = gl.zeros([HALF, 128], gl.float32, layout)
        u = gl.zeros([HALF, 128], gl.float32, layout)
        if HAS_BIAS:
            g += _bias_row(bg_ptr, bg_ptr, stride_bias_e, e, pid_n * 128, I, 128, False, BIAS_STRIDE_N, layout)[None, :]
            u += _bias_row(bu_ptr, bu_ptr, stride_bias_e, e, pid_n * 128, I, 128, False, BIAS_STRIDE_N, layout)[None, :]
        g, u, it = _pair_mainloop(g, u, a_bufs, bg_bufs, bu_bufs, ready, empty, it, NK, STAGES, B_KN)
    else:
        u = gl.zeros([HALF, 128], gl.float32, layout)
        if HAS_BIAS:
            u += _bias_row(bu_ptr, bu_ptr, stride_bias_e, e, pid_n * 128, I, 128, False, BIAS_STRIDE_N, layout)[None, :]
        u, it = _mainloop(u, a_bufs, bu_bufs, ready, empty, it, NK, STAGES, B_KN)
        g = u
    return g, u, it


@gluon.jit
def _pair_mainloop(p0, p1, a_bufs, b0_bufs, b1_bufs, ready, empty, it, NK, STAGES: gl.constexpr, B_KN: gl.constexpr,
                   HALVES: gl.constexpr = False):
    """A consumer's K loop of two products a block (p0 += A @ B0, p1 += A @ B1; ``_b_operand``), both
    issued before the previous block's pair is waited for (wait 2); HALVES: B0 and B1 the two
    128-column halves of one [64, 256] block (b0_bufs'). Returns (p0, p1, K-block count)."""
    for kb in range(NK):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if HALVES:  # (a K-major block [256, 64]: its row halves, read transposed)
            b0 = _b_operand(b0_bufs.index(s).slice(0, 128, dim=1 if B_KN else 0), B_KN)
            b1 = _b_operand(b0_bufs.index(s).slice(128, 128, dim=1 if B_KN else 0), B_KN)
        else:
            b0 = _b_operand(b0_bufs.index(s), B_KN)
            b1 = _b_operand(b1_bufs.index(s), B_KN)
        t0 = warpgroup_mma(a_bufs.index(s), b0, p0, is_async=True)
        t1 = warpgroup_mma(a_bufs.index(s), b1, p1, is_async=True)
        p0, p1 = warpgroup_mma_wait(2, deps=(t0, t1))
        if kb > 0:
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        it += 1
    p0, p1 = warpgroup_mma_wait(0, deps=(p0, p1))
    if NK > 0:
        mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
    return p0, p1, it


@gluon.jit
def _gate_up_consumer_tile(it, pid_m, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, h_ptr, stride_hm, gu_ptr,
                           stride_gum, I, NK, HALF_ROW: gl.constexpr, STAGES: gl.constexpr, SAVE_GU: gl.constexpr,
                           ACT: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr, W_LAYOUT: gl.constexpr,
                           GATED: gl.constexpr, HAS_BIAS: gl.constexpr, bg_ptr, bu_ptr, stride_bias_e,
                           BIAS_STRIDE_N: gl.constexpr):
    g, u, it = _gate_up_products(it, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, I, NK, STAGES, W_LAYOUT, GATED,
                                 HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N)
    layout: gl.constexpr = u.type.layout
    rows = pid_m.to(gl.int64) * BM + HALF_ROW + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    h = act_fwd(g, u, ACT, LIMIT, ALPHA)  # bf16.py's gate/up epilogue, the same bits
    # 16-byte row pieces: 8 bf16 a thread, 16 a row
    bf16_rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    _store_tile(h_ptr, stride_hm, h.to(h_ptr.dtype.element_ty), rows, pid_n * 128, I, bf16_rows)
    if SAVE_GU:
        if GATED:  # (ungated: g's columns left unwritten, never read)
            _store_tile(gu_ptr, stride_gum, g.to(gu_ptr.dtype.element_ty), rows, pid_n * 128, I, bf16_rows)
        _store_tile(gu_ptr + I, stride_gum, u.to(gu_ptr.dtype.element_ty), rows, pid_n * 128, I, bf16_rows)
    return it


@gluon.jit
def _gate_up_consumer(a_bufs, bg_bufs, bu_bufs, ready, empty, h_ptr, stride_hm, gu_ptr, stride_gum, tile_expert_ptr,
                      num_tiles_ptr, num_m, I, NK, HALF_ROW: gl.constexpr, STAGES: gl.constexpr,
                      GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, SAVE_GU: gl.constexpr, ACT: gl.constexpr,
                      LIMIT: gl.constexpr, ALPHA: gl.constexpr, W_LAYOUT: gl.constexpr, GATED: gl.constexpr,
                      HAS_BIAS: gl.constexpr, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N: gl.constexpr):
    it = 0
    _walk_row_tiles(_gate_up_consumer_tile, (a_bufs, bg_bufs, bu_bufs, ready, empty, h_ptr, stride_hm, gu_ptr,
                                             stride_gum, I, NK, HALF_ROW, STAGES, SAVE_GU, ACT, LIMIT, ALPHA, W_LAYOUT,
                                             GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N), it,
                    tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(I, 128), GROUP_M, SCHED_BM)


@gluon.jit
def _gate_up_ring(a_desc, wg_desc, wu_desc, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr, GATED: gl.constexpr):
    """Gate/up's ring: A's two halves and the weights' blocks a stage, one block (wu_desc's) where
    g and u are interleaved in it or there is no gate, two otherwise; and the barriers."""
    if W_LAYOUT == W_KN_PAIRED or not GATED:
        a_lo, a_hi, bu_bufs, ready, empty = _ring_rows(a_desc, wu_desc, STAGES)
        bg_bufs = bu_bufs
    else:
        a_lo, a_hi, bg_bufs, bu_bufs, ready, empty = _ring_gate_up(a_desc, wg_desc, STAGES)
    return a_lo, a_hi, bg_bufs, bu_bufs, ready, empty


@gluon.jit
def gate_up_swiglu_ws_kernel(a_desc, wg_desc, wu_desc, h_ptr, stride_hm, gu_ptr, stride_gum, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, w_pitch, NK, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             SCHED_BM: gl.constexpr, SAVE_GU: gl.constexpr, ACT: gl.constexpr = 0,
                             LIMIT: gl.constexpr = 0.0, ALPHA: gl.constexpr = 0.0, W_LAYOUT: gl.constexpr = 0,
                             GATED: gl.constexpr = True, HAS_BIAS: gl.constexpr = False, bg_ptr=None, bu_ptr=None,
                             stride_bias_e=None, BIAS_STRIDE_N: gl.constexpr = 1):
    a_lo, a_hi, bg_bufs, bu_bufs, ready, empty = _gate_up_ring(a_desc, wg_desc, wu_desc, STAGES, W_LAYOUT, GATED)
    gl.warp_specialize([
        (_gate_up_consumer, (a_lo, bg_bufs, bu_bufs, ready, empty, h_ptr, stride_hm, gu_ptr, stride_gum,
                             tile_expert_ptr, num_tiles_ptr, num_m, I, NK, 0, STAGES, GROUP_M, SCHED_BM, SAVE_GU,
                             ACT, LIMIT, ALPHA, W_LAYOUT, GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e,
                             BIAS_STRIDE_N)),
        (_gate_up_consumer, (a_hi, bg_bufs, bu_bufs, ready, empty, h_ptr, stride_hm, gu_ptr, stride_gum,
                             tile_expert_ptr, num_tiles_ptr, num_m, I, NK, HALF, STAGES, GROUP_M, SCHED_BM, SAVE_GU,
                             ACT, LIMIT, ALPHA, W_LAYOUT, GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e,
                             BIAS_STRIDE_N)),
        (_gate_up_producer, (a_desc, wg_desc, wu_desc, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, w_pitch, NK, STAGES, GROUP_M, SCHED_BM, W_LAYOUT, GATED)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------
# gate/up with the activation on an epilogue partition of its own
# --------------------------------------------------------------------------------------------
#
# As the down dgrad's (ws_common.py's handoff: ``hand_full`` count 2, ``hand_free`` 1): the
# consumers hand g and u over in shared memory (bf16, the values saved for the backward: 64 KB
# beside 3 stages of 48 KB) and run the next tile's K loop while a fourth partition writes g, u and
# h = act(g, u) from there, EPI_COLS columns at a time. h is the activation of the rounded g, u
# (those the backward reads), within a rounding of the kernel above's. With SwiGLU it measured no
# faster than the kernel above at 4 stages (H100, 2bc51ad: 0.91-1.01x); kept to measure where the
# activation's epilogue is heavier (clamps, gpt-oss's: their cost runs on the consumers above with
# the tensor cores idle, 5.0-6.6% of the layer's forward at gpt-oss-120b@ep8 on an H200).

@gluon.jit
def _gate_up_handoff_tile(state, pid_m, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, g_smem, u_smem, hand_full,
                          hand_free, I, NK, HALF_ROW: gl.constexpr, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr,
                          GATED: gl.constexpr, HAS_BIAS: gl.constexpr, bg_ptr, bu_ptr, stride_bias_e,
                          BIAS_STRIDE_N: gl.constexpr):
    it, n = state
    if W_LAYOUT == W_KN_PAIRED:
        # the interleaved block's two 128-column halves into two [64, 128] products (g's and u's
        # columns 0-63 and 64-127 of the tile, interleaved): one [64, 256] wgmma's 128 accumulator
        # registers do not fit beside four partitions
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
        pa = gl.zeros([HALF, 128], gl.float32, layout)
        pb = gl.zeros([HALF, 128], gl.float32, layout)
        if HAS_BIAS:
            pa += _bias_row(bg_ptr, bu_ptr, stride_bias_e, e, pid_n * 128, I, 128, True, BIAS_STRIDE_N, layout)[None, :]
            pb += _bias_row(bg_ptr, bu_ptr, stride_bias_e, e, pid_n * 128 + 64, I, 128, True, BIAS_STRIDE_N,
                            layout)[None, :]
        pa, pb, it = _pair_mainloop(pa, pb, a_bufs, bu_bufs, bu_bufs, ready, empty, it, NK, STAGES, True, True)
        ga, ua = gl.split(gl.reshape(pa, (HALF, 64, 2)))
        gb, ub = gl.split(gl.reshape(pb, (HALF, 64, 2)))
        wait_tile_free(hand_free, n)
        g_rows = g_smem.slice(HALF_ROW, HALF, dim=0)
        u_rows = u_smem.slice(HALF_ROW, HALF, dim=0)
        g_rows.slice(0, 64, dim=1).store(ga.to(gl.bfloat16))
        g_rows.slice(64, 64, dim=1).store(gb.to(gl.bfloat16))
        u_rows.slice(0, 64, dim=1).store(ua.to(gl.bfloat16))
        u_rows.slice(64, 64, dim=1).store(ub.to(gl.bfloat16))
    else:
        g, u, it = _gate_up_products(it, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, I, NK, STAGES, W_LAYOUT,
                                     GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N)
        wait_tile_free(hand_free, n)
        if GATED:
            g_smem.slice(HALF_ROW, HALF, dim=0).store(g.to(gl.bfloat16))
        u_smem.slice(HALF_ROW, HALF, dim=0).store(u.to(gl.bfloat16))
    tile_handed_over(hand_full)
    return it, n + 1


@gluon.jit
def _gate_up_handoff_consumer(a_bufs, bg_bufs, bu_bufs, ready, empty, g_smem, u_smem, hand_full, hand_free,
                              tile_expert_ptr, num_tiles_ptr, num_m, I, NK, HALF_ROW: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr,
                              W_LAYOUT: gl.constexpr, GATED: gl.constexpr, HAS_BIAS: gl.constexpr, bg_ptr, bu_ptr,
                              stride_bias_e, BIAS_STRIDE_N: gl.constexpr):
    _walk_row_tiles(_gate_up_handoff_tile, (a_bufs, bg_bufs, bu_bufs, ready, empty, g_smem, u_smem, hand_full,
                                            hand_free, I, NK, HALF_ROW, STAGES, W_LAYOUT, GATED, HAS_BIAS, bg_ptr,
                                            bu_ptr, stride_bias_e, BIAS_STRIDE_N),
                    (gl.to_tensor(0), gl.to_tensor(0)), tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(I, 128),
                    GROUP_M, SCHED_BM)


@gluon.jit
def _gate_up_epilogue_tile(n, pid_m, pid_n, e, g_smem, u_smem, hand_full, hand_free, h_ptr, stride_hm, gu_ptr,
                           stride_gum, I, SAVE_GU: gl.constexpr, ACT: gl.constexpr, LIMIT: gl.constexpr,
                           ALPHA: gl.constexpr, GATED: gl.constexpr, EPI_COLS: gl.constexpr):
    """The epilogue partition's tile (its n-th): g, u (SAVE_GU) and h, EPI_COLS columns at a time,
    the shared tile released once its last slice is read."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (EPI_COLS // 8), EPI_COLS // 8], [4, 1], [1, 0])
    rows = pid_m.to(gl.int64) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    wait_tile_full(hand_full, n)
    for c in gl.static_range(0, 128, EPI_COLS):
        u = u_smem.slice(c, EPI_COLS, dim=1).load(layout)
        if GATED:
            g = g_smem.slice(c, EPI_COLS, dim=1).load(layout)
        else:
            g = u
        if c + EPI_COLS == 128:  # the whole tile read
            tile_read(hand_free)
        cols = pid_n * 128 + c + gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
        mask = (cols < I)[None, :]
        h = act_fwd(g.to(gl.float32), u.to(gl.float32), ACT, LIMIT, ALPHA)
        gl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if SAVE_GU:
            gptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
            if GATED:  # (ungated: g's columns left unwritten, never read)
                gl.store(gptrs, g, mask=mask)
            gl.store(gptrs + I, u, mask=mask)
    return n + 1


@gluon.jit
def _gate_up_epilogue(g_smem, u_smem, hand_full, hand_free, h_ptr, stride_hm, gu_ptr, stride_gum, tile_expert_ptr,
                      num_tiles_ptr, num_m, I, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, SAVE_GU: gl.constexpr,
                      ACT: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr, GATED: gl.constexpr,
                      EPI_COLS: gl.constexpr):
    _walk_row_tiles(_gate_up_epilogue_tile, (g_smem, u_smem, hand_full, hand_free, h_ptr, stride_hm, gu_ptr,
                                             stride_gum, I, SAVE_GU, ACT, LIMIT, ALPHA, GATED, EPI_COLS),
                    gl.to_tensor(0), tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(I, 128), GROUP_M, SCHED_BM)


@gluon.jit
def gate_up_handoff_ws_kernel(a_desc, wg_desc, wu_desc, h_ptr, stride_hm, gu_ptr, stride_gum, tile_expert_ptr,
                              num_tiles_ptr, num_m, I, w_pitch, NK, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                              SCHED_BM: gl.constexpr, SAVE_GU: gl.constexpr, EPI_COLS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, ACT: gl.constexpr = 0, LIMIT: gl.constexpr = 0.0,
                              ALPHA: gl.constexpr = 0.0, W_LAYOUT: gl.constexpr = 0, GATED: gl.constexpr = True,
                              HAS_BIAS: gl.constexpr = False, bg_ptr=None, bu_ptr=None, stride_bias_e=None,
                              BIAS_STRIDE_N: gl.constexpr = 1):
    a_lo, a_hi, bg_bufs, bu_bufs, ready, empty = _gate_up_ring(a_desc, wg_desc, wu_desc, STAGES, W_LAYOUT, GATED)
    hand: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 8, order=[1, 0])
    u_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, 128], hand)
    if GATED:
        g_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, 128], hand)
    else:
        g_smem = u_smem
    hand_full, hand_free = handoff_barriers()
    gl.warp_specialize([
        (_gate_up_epilogue, (g_smem, u_smem, hand_full, hand_free, h_ptr, stride_hm, gu_ptr, stride_gum,
                             tile_expert_ptr, num_tiles_ptr, num_m, I, GROUP_M, SCHED_BM, SAVE_GU, ACT, LIMIT, ALPHA,
                             GATED, EPI_COLS)),
        (_gate_up_handoff_consumer, (a_lo, bg_bufs, bu_bufs, ready, empty, g_smem, u_smem, hand_full, hand_free,
                                     tile_expert_ptr, num_tiles_ptr, num_m, I, NK, 0, STAGES, GROUP_M, SCHED_BM,
                                     W_LAYOUT, GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N)),
        (_gate_up_handoff_consumer, (a_hi, bg_bufs, bu_bufs, ready, empty, g_smem, u_smem, hand_full, hand_free,
                                     tile_expert_ptr, num_tiles_ptr, num_m, I, NK, HALF, STAGES, GROUP_M, SCHED_BM,
                                     W_LAYOUT, GATED, HAS_BIAS, bg_ptr, bu_ptr, stride_bias_e, BIAS_STRIDE_N)),
        (_gate_up_producer, (a_desc, wg_desc, wu_desc, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, w_pitch, NK, STAGES, GROUP_M, SCHED_BM, W_LAYOUT, GATED)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 40])


# --------------------------------------------------------------------------------------------
# the down dgrad with the activation's backward, on an epilogue partition of its own
# --------------------------------------------------------------------------------------------
#
# dh_raw = dys @ Wd[e] (K = H), the rows GEMM's producer and consumers (B read N-major: Wd [E, H, I]
# as it lies; a transposed down_proj [E, I, H] K-major). The epilogue (the activation's backward:
# g, u read, dg, du and ws * h written, the router weight's partial sums) moves about 5 bytes a
# product element against the K loop's 2H FLOPs; run by the consumers it leaves the tensor cores
# idle for its whole length, the Triton kernel's largest loss (the down dgrad at 0.64-0.75x its
# floor). Here the consumers store their halves of the tile into shared memory and go on to the
# next tile's K loop while a fourth partition (4 warps) runs the epilogue from there in slices of
# EPI_COLS columns (ws_common.py: the partition and the handoff's protocol). Two tile widths:
# - TILE_N 128: the 64 x 128 fp32 accumulators handed over as they are (a 64 KB tile beside 4
#   stages of 32 KB); the same bits as bf16.py's kernel.
# - TILE_N 256: two 64 x 128 products a consumer (one [64, 256] wgmma's accumulator does not fit
#   beside four partitions), handed over rounded to bf16 (64 KB beside 3 stages of 48 KB): dh_raw
#   as a separate GEMM's bf16 output would be (the reference's), within a rounding of the 128-wide
#   tile's; half the shared-memory operand traffic a product of the 128-wide tile (the rows GEMM:
#   ws-256 against ws-128, 1.2-1.3x).

@gluon.jit
def _dgrad_consumer_tile(state, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_free, NK,
                         HALF_ROW: gl.constexpr, STAGES: gl.constexpr, B_KN: gl.constexpr, TILE_N: gl.constexpr):
    """A consumer's 64 rows of one tile: the K loop, then its half of the shared tile once the
    epilogue has read the tile before. State: (K-block count, tiles run)."""
    it, n = state
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    mine = acc_smem.slice(HALF_ROW, HALF, dim=0)
    if TILE_N == 256:
        p0 = gl.zeros([HALF, 128], gl.float32, layout)
        p1 = gl.zeros([HALF, 128], gl.float32, layout)
        p0, p1, it = _pair_mainloop(p0, p1, a_bufs, b_bufs, b_bufs, ready, empty, it, NK, STAGES, B_KN, True)
        wait_tile_free(acc_free, n)
        mine.slice(0, 128, dim=1).store(p0.to(gl.bfloat16))
        mine.slice(128, 128, dim=1).store(p1.to(gl.bfloat16))
    else:
        acc = gl.zeros([HALF, 128], gl.float32, layout)
        acc, it = _mainloop(acc, a_bufs, b_bufs, ready, empty, it, NK, STAGES, B_KN)
        wait_tile_free(acc_free, n)
        mine.store(acc)
    tile_handed_over(acc_full)
    return it, n + 1


@gluon.jit
def _dgrad_consumer(a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_free, tile_expert_ptr, num_tiles_ptr, num_m,
                    I, NK, HALF_ROW: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                    SCHED_BM: gl.constexpr, B_KN: gl.constexpr, TILE_N: gl.constexpr):
    _walk_row_tiles(_dgrad_consumer_tile, (a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_free, NK, HALF_ROW,
                                           STAGES, B_KN, TILE_N), (gl.to_tensor(0), gl.to_tensor(0)), tile_expert_ptr,
                    num_tiles_ptr, num_m, gl.cdiv(I, TILE_N), GROUP_M, SCHED_BM)


@gluon.jit
def down_dgrad_ws_kernel(a_desc, b_desc, gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm, dwp_ptr,
                         stride_dwpm, tile_expert_ptr, num_tiles_ptr, num_m, I, b_pitch, NK, STAGES: gl.constexpr,
                         GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, B_KN: gl.constexpr, EPI_COLS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, TILE_N: gl.constexpr, ACT: gl.constexpr = 0,
                         LIMIT: gl.constexpr = 0.0, ALPHA: gl.constexpr = 0.0, DGU_PAIRED: gl.constexpr = False,
                         PREFETCH: gl.constexpr = False):
    """dh_raw = dys @ Wd[e] (B_KN: Wd [E, H, I] as it lies; else a transposed down_proj [E, I, H])
    with the activation's backward (bf16.py's ``down_dgrad_swiglu_tile``: the same outputs)."""
    a_lo, a_hi, b_bufs, ready, empty = _ring_rows(a_desc, b_desc, STAGES)
    acc_smem, acc_full, acc_free = handoff_smem(TILE_N)
    gl.warp_specialize([
        (dgrad_epilogue, (acc_smem, acc_full, acc_free, gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr,
                           stride_hwm, dwp_ptr, stride_dwpm, tile_expert_ptr, num_tiles_ptr, num_m, I, GROUP_M,
                           SCHED_BM, EPI_COLS, ACT, LIMIT, ALPHA, DGU_PAIRED, TILE_N, PREFETCH)),
        (_dgrad_consumer, (a_lo, b_bufs, ready, empty, acc_smem, acc_full, acc_free, tile_expert_ptr, num_tiles_ptr,
                           num_m, I, NK, 0, STAGES, GROUP_M, SCHED_BM, B_KN, TILE_N)),
        (_dgrad_consumer, (a_hi, b_bufs, ready, empty, acc_smem, acc_full, acc_free, tile_expert_ptr, num_tiles_ptr,
                           num_m, I, NK, HALF, STAGES, GROUP_M, SCHED_BM, B_KN, TILE_N)),
        (_rows_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, I,
                          b_pitch, NK, TILE_N, STAGES, GROUP_M, SCHED_BM, B_KN)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 40])


# --------------------------------------------------------------------------------------------
# per-expert weight gradients
# --------------------------------------------------------------------------------------------
#
# C[e] [M, N] = A_seg^T @ B_seg over expert e's rows (A [R, M], B [R, N]; K = the expert's rows,
# from expert_start[e], count expert_count[e], segments starting at multiples of 128). Output
# tiles 128 x 256, numbered expert-major (then pair: dW_gate, dW_up; then grouped (m, n)); a
# program walks tiles pid, pid + P, ... A stage holds the block's 64 rows of A's two 64-column
# halves ([64 K, 64 M] each: a consumer's, read M-major) and of B ([64 K, 256 N], N-major).
#
# An expert's last block may run past its rows into its segment's padding, which nothing
# guarantees to be zero or even finite (the megakernel's fills skip it). So where a block is
# partial, each consumer zeroes those rows of its A half and of its 128 columns of B in shared
# memory, and the two meet on the ``fixed`` barrier before either issues the block's wgmma (both
# then read zeros in both operands: the rows add exactly nothing). Blocks past the segment's
# padding are never loaded (a block starts inside the rows, and segments are 128-row aligned).
#
# Deterministic for any grid: a tile is one program's, its K blocks in order into one accumulator.


@gluon.jit
def _wgrad_tile(t, num_m, num_n, NUM_PAIRS: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile t -> (expert, pair, pid_m, pid_n)."""
    per_pair = num_m * num_n
    e = t // (per_pair * NUM_PAIRS)
    rem = t % (per_pair * NUM_PAIRS)
    pid_m, pid_n = grouped_tile(rem % per_pair, num_m, num_n, GROUP_M)
    return e, rem // per_pair, pid_m, pid_n


@gluon.jit
def _wgrad_producer(a0_desc, a1_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, expert_start_ptr, expert_count_ptr,
                    E, M, N, NUM_PAIRS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, 256)
    nbytes: gl.constexpr = 2 * a0_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), E * NUM_PAIRS * num_m * num_n, gl.num_programs(0)):
        e, pair, pid_m, pid_n = _wgrad_tile(t, num_m, num_n, NUM_PAIRS, GROUP_M)
        start = gl.load(expert_start_ptr + e)
        nk = gl.cdiv(gl.load(expert_count_ptr + e), BK)
        for kb in range(nk):
            s, bar = _ring_fill(ready, empty, it, nbytes, STAGES)
            r0 = start + kb * BK
            if pair == 0:
                tma.async_copy_global_to_shared(a0_desc, [r0, pid_m * BM], bar, a_lo.index(s))
                tma.async_copy_global_to_shared(a0_desc, [r0, pid_m * BM + HALF], bar, a_hi.index(s))
            else:
                tma.async_copy_global_to_shared(a1_desc, [r0, pid_m * BM], bar, a_lo.index(s))
                tma.async_copy_global_to_shared(a1_desc, [r0, pid_m * BM + HALF], bar, a_hi.index(s))
            tma.async_copy_global_to_shared(b_desc, [r0, pid_n * 256], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _zero_rows_from(buf, r0, layout: gl.constexpr):
    """Rows r0.. of a [64, 64] shared buffer set to zero (a round trip through registers)."""
    v = buf.load(layout)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    buf.store(gl.where((rows >= r0)[:, None], gl.zeros_like(v), v))


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, ready, empty, fixed, c0_ptr, c1_ptr, stride_ce, stride_cm, expert_start_ptr,
                    expert_count_ptr, E, M, N, WHICH: gl.constexpr, NUM_PAIRS: gl.constexpr, STAGES: gl.constexpr,
                    GROUP_M: gl.constexpr):
    """Consumer WHICH: rows WHICH * 64 .. + 63 of each tile (A's half WHICH), zeroing B's columns
    WHICH * 128 .. + 127 of a partial block."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    pad_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, 256)
    it = 0
    partial = 0
    for t in range(gl.program_id(0), E * NUM_PAIRS * num_m * num_n, gl.num_programs(0)):
        e, pair, pid_m, pid_n = _wgrad_tile(t, num_m, num_n, NUM_PAIRS, GROUP_M)
        cnt = gl.load(expert_count_ptr + e)
        nk = gl.cdiv(cnt, BK)
        acc = gl.zeros([HALF, 256], gl.float32, layout)
        for kb in range(nk):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            left = cnt - kb * BK
            if left < BK:  # the expert's last block runs into its padding: zero those rows in both operands
                _zero_rows_from(a_bufs.index(s), left, pad_layout)
                _zero_rows_from(b_bufs.index(s).slice(WHICH * 128, 64, 1), left, pad_layout)
                _zero_rows_from(b_bufs.index(s).slice(WHICH * 128 + 64, 64, 1), left, pad_layout)
                fence_async_shared()
                mbarrier.arrive(fixed, count=1)
                mbarrier.wait(fixed, partial & 1)
                partial += 1
            tok = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
            acc = _retire_previous(tok, kb, it, empty, STAGES)
            it += 1
        acc = _drain(acc, it, nk, empty, STAGES)
        c_ptr = c0_ptr
        if pair == 1:
            c_ptr = c1_ptr
        rows = pid_m * BM + WHICH * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_layout))
        cols = pid_n * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, out_layout))
        val = gl.convert_layout(acc.to(c0_ptr.dtype.element_ty), out_layout)
        ptrs = c_ptr + e.to(gl.int64) * stride_ce + rows[:, None].to(gl.int64) * stride_cm + cols[None, :]
        gl.store(ptrs, val, mask=(rows < M)[:, None] & (cols < N)[None, :])


@gluon.jit
def expert_wgrad_ws_kernel(a0_desc, a1_desc, b_desc, c0_ptr, c1_ptr, stride_ce, stride_cm, expert_start_ptr,
                           expert_count_ptr, E, M, N, NUM_PAIRS: gl.constexpr, STAGES: gl.constexpr,
                           GROUP_M: gl.constexpr):
    a_lo, a_hi, b_bufs, ready, empty = _ring_rows(a0_desc, b_desc, STAGES)
    fixed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed, count=2)
    gl.warp_specialize([
        (_wgrad_consumer, (a_lo, b_bufs, ready, empty, fixed, c0_ptr, c1_ptr, stride_ce, stride_cm, expert_start_ptr,
                           expert_count_ptr, E, M, N, 0, NUM_PAIRS, STAGES, GROUP_M)),
        (_wgrad_consumer, (a_hi, b_bufs, ready, empty, fixed, c0_ptr, c1_ptr, stride_ce, stride_cm, expert_start_ptr,
                           expert_count_ptr, E, M, N, 1, NUM_PAIRS, STAGES, GROUP_M)),
        (_wgrad_producer, (a0_desc, a1_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, expert_start_ptr,
                           expert_count_ptr, E, M, N, NUM_PAIRS, STAGES, GROUP_M)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------
# host
# --------------------------------------------------------------------------------------------

def _desc(t: torch.Tensor, rows: int, block: list) -> TensorDescriptor:
    """A TMA descriptor over ``t`` seen as [rows, t.shape[-1]] bf16 (row stride t.stride(-2)), in
    ``block`` boxes with the widest swizzle the wgmma reads."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, [rows, t.shape[-1]], [t.stride(-2), 1], block, layout)


def _check_stages(name: str, stages: int):
    """A consumer releases a stage one block late (after the next block's wgmma is issued): a ring
    of one stage would wait for itself (tests/test_ws_ring_model.py)."""
    if stages < 2:
        raise ValueError(f"{name}: stages {stages} must be at least 2")


def _pitch(t: torch.Tensor) -> int | None:
    """A 3-D operand [E, A, B] as the descriptors see it, rows of B elements (unit column stride, row
    stride t.stride(1)): the rows from one expert's first to the next's (A where its experts lie one
    after the other; 2I for a gate or up half of a fused gate_up_proj [E, 2I, H]); None where the
    experts do not start on a row of that view."""
    if t.stride(-1) != 1 or t.stride(0) % t.stride(1) or t.stride(0) // t.stride(1) < t.shape[1]:
        return None
    return t.stride(0) // t.stride(1)


def _expert_desc(w: torch.Tensor, block: list) -> tuple[TensorDescriptor, int]:
    """(descriptor, pitch): a 3-D operand's rows (``_pitch``) from its first expert's first to its
    last expert's last, in ``block`` boxes."""
    pitch = _pitch(w)
    return _desc(w, (w.shape[0] - 1) * pitch + w.shape[1], block), pitch


def fits(*ts: torch.Tensor, sched_bm: int) -> bool:
    """Whether the warp-specialized kernels run on these operands: a CUDA device of compute
    capability 9 (wgmma, TMA), bf16, TMA-addressable (16-byte aligned bases and strides, unit
    column strides; a 3-D operand's experts each starting on a row: ``_pitch``), the schedule's
    tiles a multiple of 128 rows."""
    return (sched_bm % BM.value == 0 and all(
        _sm90(t) and t.dtype == torch.bfloat16 and tma_aligned(t) and t.stride(-1) == 1
        and (t.dim() == 2 or _pitch(t) is not None) for t in ts))


def rows_launch(a, b, tile_expert, num_tiles, sched_bm: int, epilogue: int, epi: tuple, *, tile_n: int,
                stages: int, grid: int | None = None, GROUP_M: int = 8, b_kn: bool = False, bias=None):
    """One persistent launch of the rows GEMM ``a [R, K] @ b[e]^T`` (b [E, N, K]; ``b_kn``: ``a @ b[e]``,
    b [E, K, N] with K a multiple of 64, e.g. a transposed down_proj read in place) + ``bias[e]``
    (None or [E, N], unit column stride) with ``epilogue`` (EPI_STORE or EPI_PUSH) and its arguments
    ``epi``; raises where ``fits`` does not hold. ``tile_n``: 256 or 128 columns a tile; ``stages``:
    the ring's depth; ``grid``: the persistent grid (None: one program per SM)."""
    if tile_n not in (128, 256):
        raise ValueError(f"rows_launch: tile_n {tile_n} must be 128 or 256")
    if epilogue not in (EPI_STORE, EPI_PUSH):
        raise ValueError(f"rows_launch: epilogue {epilogue} must be EPI_STORE or EPI_PUSH")
    _check_stages("rows_launch", stages)
    R, K = a.shape
    if b_kn:
        E, Kb, N = b.shape
    else:
        E, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"rows_launch: A {tuple(a.shape)} and B {tuple(b.shape)} must be [R, K] and "
                         f"{'[E, K, N]' if b_kn else '[E, N, K]'}")
    if b_kn and K % BK.value:
        raise ValueError(f"rows_launch: B [E, K, N] needs K a multiple of {BK.value} (K={K}): a block must not run "
                         "into the next expert's rows")
    if not fits(a, b, sched_bm=sched_bm):
        raise ValueError(f"rows_launch: A {tuple(a.shape)}, B {tuple(b.shape)}, schedule tiles of {sched_bm} rows "
                         "do not run on the warp-specialized kernel (see fits)")
    kw = {}
    if b_kn:
        kw["B_KN"] = True
    if bias is not None:
        if tuple(bias.shape) != (E, N) or bias.stride(-1) != 1:
            raise ValueError(f"rows_launch: bias {tuple(bias.shape)} must be [{E}, {N}] with a unit column stride")
        kw.update(HAS_BIAS=True, bias_ptr=bias, stride_bias_e=bias.stride(0))
    num_m = R // BM.value
    b_desc, b_pitch = _expert_desc(b, [BK.value, tile_n] if b_kn else [tile_n, BK.value])
    rows_gemm_ws_kernel[_grid(a.device, num_m * triton.cdiv(N, tile_n), grid)](
        _desc(a, R, [HALF.value, BK.value]), b_desc, epi, tile_expert, num_tiles,
        num_m, N, b_pitch, triton.cdiv(K, BK.value), TILE_N=tile_n, STAGES=stages, GROUP_M=GROUP_M, SCHED_BM=sched_bm,
        EPILOGUE=epilogue, num_warps=4, **kw)


def gate_up_swiglu_ws(xs, w_gate, w_up, tile_expert, num_tiles, h, gu, *, sched_bm: int, stages: int,
                      grid: int | None = None, GROUP_M: int = 8, act: Activation = SWIGLU, layout: str = LAYOUT_NK,
                      biases=None, handoff: bool = False, epi_cols: int = 16, consumer_regs: int = 168):
    """h [R, I] = act(xs @ Wg[e]^T + bg[e], xs @ Wu[e]^T + bu[e]) per row tile, g | u into gu [R, 2I]
    unless gu is None; xs [R, H], W [E, I, H] in ``layout`` (validate.LAYOUTS; the transposed ones
    need H a multiple of 64), ``biases`` None or (bg, bu) [E, I] (equal strides, column stride 1 or
    2); an ungated ``act``: Wu alone (w_gate unread). Raises where ``fits`` does not hold.
    ``stages``: the ring's depth (48 KB a stage); ``handoff``: the activation on an epilogue
    partition (``gate_up_handoff_ws_kernel``: 64 KB beside the stages; ``epi_cols`` its slice,
    ``consumer_regs`` the consumers' registers); not in the plan until measured faster."""
    R, H = xs.shape
    E, I, _ = w_gate.shape
    _check_stages("gate_up_swiglu_ws", stages)
    if layout == LAYOUT_NK:
        ops = (w_gate, w_up)
    elif layout == LAYOUT_KN:
        ops = (w_gate.transpose(1, 2), w_up.transpose(1, 2))  # [E, H, I], as they lie
    elif layout == LAYOUT_KN_PAIRED:  # [E, H, 2I]: g's column i at 2i, u's at 2i + 1
        ops = (paired_gate_up(w_gate),)
    else:
        raise ValueError(f"gate_up_swiglu_ws: layout {layout!r} is none of {tuple(W_LAYOUT_CODES)}")
    if layout != LAYOUT_NK and H % BK.value:
        raise ValueError(f"gate_up_swiglu_ws: weights in layout {layout!r} need H a multiple of {BK.value} (H={H}): "
                         "a block must not run into the next expert's rows")
    if not fits(xs, *ops, sched_bm=sched_bm):
        raise ValueError(f"gate_up_swiglu_ws: xs {tuple(xs.shape)}, W {tuple(w_gate.shape)} (layout {layout!r}), "
                         f"schedule tiles of {sched_bm} rows do not run on the warp-specialized kernel (see fits)")
    save_gu = gu is not None
    gu_arg = gu if save_gu else h
    num_m = R // BM.value
    ACT, LIMIT, ALPHA = act.constexprs()
    block = {LAYOUT_NK: [128, BK.value], LAYOUT_KN: [BK.value, 128], LAYOUT_KN_PAIRED: [BK.value, 256]}[layout]
    (wg_desc, w_pitch), (wu_desc, _) = _expert_desc(ops[0], block), _expert_desc(ops[-1], block)
    kw = {}  # (left out at their defaults for the plain kernel, whose code stays what it was)
    if layout != LAYOUT_NK:
        kw["W_LAYOUT"] = W_LAYOUT_CODES[layout]
    if not act.gated:
        kw["GATED"] = False
    if biases is not None:
        bg, bu = biases
        if not (tuple(bg.shape) == tuple(bu.shape) == (E, I) and bg.stride() == bu.stride()
                and bg.stride(-1) in (1, 2)):
            raise ValueError(f"gate_up_swiglu_ws: biases {tuple(bg.shape)}, {tuple(bu.shape)} must be [{E}, {I}] "
                             "with equal strides, column stride 1 or 2")
        kw.update(HAS_BIAS=True, bg_ptr=bg, bu_ptr=bu, stride_bias_e=bg.stride(0), BIAS_STRIDE_N=bg.stride(-1))
    kernel = gate_up_swiglu_ws_kernel
    if handoff:
        kernel = gate_up_handoff_ws_kernel
        kw.update(EPI_COLS=epi_cols, CONSUMER_REGS=consumer_regs)
    kernel[_grid(xs.device, num_m * triton.cdiv(I, 128), grid)](
        _desc(xs, R, [HALF.value, BK.value]), wg_desc, wu_desc, h, h.stride(0),
        gu_arg, gu_arg.stride(0), tile_expert, num_tiles, num_m, I, w_pitch, triton.cdiv(H, BK.value), STAGES=stages,
        GROUP_M=GROUP_M, SCHED_BM=sched_bm, SAVE_GU=save_gu, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, num_warps=4, **kw)


def down_dgrad_ws(dys, w_down, gu, ws, tile_expert, num_tiles, dgu, hw, dw_part, *, sched_bm: int, stages: int,
                  tile_n: int = 128, epi_cols: int | None = None, consumer_regs: int | None = None,
                  grid: int | None = None, GROUP_M: int = 8, act: Activation = SWIGLU, dgu_paired: bool = False,
                  prefetch: bool = False):
    """bf16.py's ``down_dgrad_swiglu_bwd`` (its operands and outputs; dw_part [R, cdiv(I, tile_n)]) on
    the warp-specialized kernel with its epilogue partition; raises where ``fits`` does not hold or
    H is not a multiple of 64 (B's K blocks are rows of Wd [E, H, I]: none may run into the next
    expert's). ``tile_n``: 128 (fp32 handoff) or 256 (bf16 handoff); ``stages``: the ring's depth
    (32 or 48 KB a stage); ``epi_cols``: the epilogue's slice (None: 32 at 128 columns, 16 at 256,
    gpt-oss's 8; gpt-oss's spills at 256);
    ``consumer_regs``: the consumers' registers (None: 120 at 128 columns, 168 at 256; the
    epilogue partition gets the rest)."""
    from .bf16 import _down_operand

    R, H = dys.shape
    E, _, I = w_down.shape
    _check_stages("down_dgrad_ws", stages)
    b, b_layout = _down_operand(w_down)  # "nk": Wd [E, H, I] is B [E, K, N]; "kn": a down_proj [E, I, H] is B [E, N, K]
    b_kn = b_layout == "nk"
    if b_kn and H % BK.value:
        raise ValueError(f"down_dgrad_ws: H {H} must be a multiple of {BK.value}")
    if tile_n not in (128, 256):
        raise ValueError(f"down_dgrad_ws: tile_n {tile_n} must be 128 or 256")
    if epi_cols is None:  # (the widest without spills: gpt-oss's backward keeps more temporaries live)
        epi_cols = 8 if act.kind == "gpt-oss" else 32 if tile_n == 128 else 16
    if consumer_regs is None:
        consumer_regs = 120 if tile_n == 128 else 168
    if epi_cols not in (8, 16, 32, 64):
        raise ValueError(f"down_dgrad_ws: epi_cols {epi_cols} must be 8, 16, 32 or 64")
    if not fits(dys, b, gu, sched_bm=sched_bm):
        raise ValueError(f"down_dgrad_ws: dys {tuple(dys.shape)}, Wd {tuple(w_down.shape)}, schedule tiles of "
                         f"{sched_bm} rows do not run on the warp-specialized kernel (see fits)")
    if tuple(dw_part.shape) != (R, triton.cdiv(I, tile_n)) or dw_part.dtype != torch.float32:
        raise ValueError(f"down_dgrad_ws: dw_part {tuple(dw_part.shape)} must be [{R}, {triton.cdiv(I, tile_n)}] fp32")
    if dgu_paired and (not act.gated or dgu.data_ptr() == gu.data_ptr()):
        raise ValueError("down_dgrad_ws: dgu_paired needs a gated activation and dgu apart from gu")
    num_m = R // BM.value
    b_desc, b_pitch = _expert_desc(b, [BK.value, tile_n] if b_kn else [tile_n, BK.value])
    ACT, LIMIT, ALPHA = act.constexprs()
    down_dgrad_ws_kernel[_grid(dys.device, num_m * triton.cdiv(I, tile_n), grid)](
        _desc(dys, R, [HALF.value, BK.value]), b_desc, gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0),
        dw_part, dw_part.stride(0), tile_expert, num_tiles, num_m, I, b_pitch, triton.cdiv(H, BK.value),
        STAGES=stages, GROUP_M=GROUP_M, SCHED_BM=sched_bm, B_KN=b_kn, EPI_COLS=epi_cols, CONSUMER_REGS=consumer_regs,
        TILE_N=tile_n, PREFETCH=prefetch, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, DGU_PAIRED=dgu_paired, num_warps=4)
    return dgu, hw, dw_part


def expert_wgrad_ws(a_parts, b, expert_start, expert_count, outs, *, stages: int, grid: int | None = None,
                    GROUP_M: int = 8):
    """C_p[e] = A_p[s:s+c]^T @ B[s:s+c] for each part p (one: dW_down = dys^T hw; two: dW_gate and
    dW_up from dg and du against xs) into ``outs`` [E, M, N] (bf16, unit column stride), s =
    expert_start[e] (a multiple of 128), c = expert_count[e]; experts without rows get zeros.
    bf16.py's ``expert_wgrad`` sums, warp-specialized (raises where ``fits`` does not hold)."""
    if len(a_parts) not in (1, 2) or len(outs) != len(a_parts):
        raise ValueError(f"expert_wgrad_ws: {len(a_parts)} A parts and {len(outs)} outputs (one or two pairs)")
    _check_stages("expert_wgrad_ws", stages)
    R, M = a_parts[0].shape
    N = b.shape[1]
    E = expert_count.numel()
    for a, c in zip(a_parts, outs):
        if (tuple(a.shape) != (R, M) or tuple(c.shape) != (E, M, N) or c.stride() != outs[0].stride()
                or c.stride(-1) != 1):
            raise ValueError(f"expert_wgrad_ws: A {tuple(a.shape)} must be [{R}, {M}] and C {tuple(c.shape)} "
                             f"[{E}, {M}, {N}]")
    if b.shape[0] != R or not fits(*a_parts, b, sched_bm=128):
        raise ValueError(f"expert_wgrad_ws: A {tuple(a_parts[0].shape)}, B {tuple(b.shape)} do not run on the "
                         "warp-specialized kernel (see fits)")
    a_descs = [_desc(a, R, [BK.value, HALF.value]) for a in a_parts]
    tiles = E * len(a_parts) * triton.cdiv(M, BM.value) * triton.cdiv(N, 256)
    expert_wgrad_ws_kernel[_grid(b.device, tiles, grid)](
        a_descs[0], a_descs[-1], _desc(b, R, [BK.value, 256]), outs[0], outs[-1], outs[0].stride(0),
        outs[0].stride(1), expert_start, expert_count, E, M, N, NUM_PAIRS=len(a_parts), STAGES=stages,
        GROUP_M=GROUP_M, num_warps=4)
    return outs
