"""FP8 expert GEMMs warp-specialized (Gluon): one warpgroup's promotion under the other's MMA.

- ``rows_gemm_fp8_ws`` / ``launch``: the rows GEMM with three epilogues (``fits``): the stored and
  pushed rows at 128 x 256 tiles, the down dgrad's SwiGLU backward at 128 x 128;
- ``gate_up_swiglu_fp8_ws``: gate/up with the SwiGLU and h's quantization, 128 x 128 tiles of h
  (``fits_gate_up``);
- ``expert_wgrad_fp8_ws``: the weight gradient over the layer's padded segments (``fits_wgrad``),
  two pipelines of whole tiles;
- ``launch_dgrad``: the down dgrad with the activation's backward on an epilogue partition of its
  own (ws_common.py), 128 x 128 (measured against the consumers' epilogue before the plan runs it);
- ``launch_bt``: the rows GEMM at 128 x 128 with B read from forward weight copies, each block
  transposed in shared memory by a producer warpgroup (the dgrads where no transposed copy is
  held: ``fits_bt``).
gemm_fp8's entry points run them where the plan names them (``Fp8Gemm(core="ws")``:
``functional/heuristics.py`` chooses them for every FP8 GEMM of the layer on sm_90). The
launchers here take their ring depths, lags and grids as arguments and decide none.

Same operands, layout contract and sum as ``gemm_fp8.rows_gemm_fp8`` (its docstring): routed rows
``aq [R, K]`` E4M3 with 1x128 scales, weights ``bq [E, N, K]`` with 128x128 block scales, each
128-row tile one expert's, ``acc += (A_kb @ B_kb^T) * (a_scale[:, kb] * b_scale[kb])`` per K block
of 128 in order, bf16 out. The result is bitwise the Triton kernel's: the same wgmma (m64 n128
k32, four per block) over the same operands, promoted by the same fused multiply-add.

Structure (why it can overlap where ``tl.dot`` cannot): Triton's pipelined loop keeps a CTA's two
warpgroups in lockstep (CTA barriers every K block), so both promote while the tensor cores idle.
Here the CTA is three partitions of one ``gl.warp_specialize``:
- a one-warp TMA producer fills a ring of ``STAGES`` stages (A's two 64-row halves and B's 128 x
  128 block), each stage with a ``ready`` barrier (TMA transaction count) and an ``empty`` barrier
  that counts one arrival per consumer;
- two consumer warpgroups, each owning 64 rows of the tile: wait ``ready``, issue the block's
  wgmma, wait for it (wait 0: ptxas serializes every wgmma of a kernel that reads an accumulator
  while another wgmma is in flight, C7514), release the stage, promote. Nothing ties the two
  consumers together but the ring, so one's promotion runs while the other's MMA does.
Persistent: one program per SM walks the tiles in ``gemm.grouped_tile`` order; every partition
walks the same sequence and the ring's stage and phase follow a running K-block count, so the
producer runs into the next tile while the consumers store the last.

Epilogues (``EPILOGUE``): the stored rows, the rows pushed to their origins (the forward's down,
the gate/up dgrad) and the down dgrad's SwiGLU backward, each gemm.py's over a warpgroup's 64
rows; stores and pushes go through a layout of 16-byte row pieces.

Runs where ``fits``: sm_90, the schedule's tiles a multiple of 128 rows, K a multiple of 16 (TMA's
strides). N is free: a partial last column tile reads the next expert's first weight rows (or
TMA's zeros past the last), finite E4M3 whose columns are not stored.
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
from .. import INTERPRET
from ..quantize import BLOCK, exp2_int, scale_exponent, to_e4m3
from .activation import act_fwd
from .bf16 import _check_schedule, _swiglu_bwd_epilogue, grouped_tile, tma_aligned
from .ws_common import _walk_row_tiles, dgrad_epilogue, handoff_smem, tile_handed_over, wait_tile_free

BM = 128  # two consumer warpgroups of 64 rows
BN = 128
HALF = 64
# (ring depths, lags and grids: the plan's, functional/heuristics.py: e.g. the 128 x 128 ring's 4
# stages of 32 KB, which leave shared memory for the epilogue's layout conversions)


EPI_STORE = gl.constexpr(0)  # bf16 rows into C [R, N] (gemm.rows_gemm's local form)
EPI_PUSH = gl.constexpr(1)  # each row to its origin (gemm._push_rows: dst_ptrs[row_src // TK], row row_src % TK)
EPI_SWIGLU_BWD = gl.constexpr(2)  # the down dgrad's SwiGLU backward (gemm._swiglu_bwd_split_epilogue)
EPI_KINDS = gl.constexpr(4)  # EPILOGUE = EPI_SWIGLU_BWD + EPI_KINDS * ACT: another activation's backward (epi_act_bwd)


def epi_act_bwd(act) -> int:
    """The EPILOGUE of the down dgrad with ``act``'s backward (a ``tabby.Activation``; its limit and
    alpha the epi tuple's last two arguments): EPI_SWIGLU_BWD itself for SwiGLU."""
    return EPI_SWIGLU_BWD.value + EPI_KINDS.value * act.code


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, READERS: gl.constexpr = 2, WRITERS: gl.constexpr = 1):
    """The ring's barriers per stage: ``ready`` (WRITERS arrivals and the producer's TMA transactions
    land: one arrival, the TMA's expect, by default) and ``empty`` (one arrival per consumer
    warpgroup that reads the stage: READERS, both by default)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=WRITERS)
        mbarrier.init(empty.index(i), count=READERS)
    return ready, empty


@gluon.jit
def _ring_rows(a_desc, b_desc, STAGES: gl.constexpr, READERS: gl.constexpr = 2):
    """The rows GEMMs' ring: per stage A's two 64-row halves and B's block (the descriptors' boxes:
    FP8's 128 x 128, bf16's 64 x 128 or 64 x 256), and the barriers (``_ring_barriers``; READERS:
    the consumers that read each stage)."""
    a_lo = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    a_hi = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready, empty = _ring_barriers(STAGES, READERS)
    return a_lo, a_hi, b_bufs, ready, empty


@gluon.jit
def _ring_gate_up(a_desc, w_desc, STAGES: gl.constexpr):
    """Gate/up's ring: per stage A's two 64-row halves and W_gate's and W_up's blocks (``w_desc``'s
    boxes), and the barriers (both consumers read each stage)."""
    a_lo = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    a_hi = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    bg_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bu_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    return a_lo, a_hi, bg_bufs, bu_bufs, ready, empty


@gluon.jit
def _ring_fill(ready, empty, it, nbytes, STAGES: gl.constexpr):
    """Producer, K block number ``it`` (counted over all tiles): wait until its stage is free and
    expect ``nbytes`` on its ready barrier; returns (stage, ready barrier). A fresh mbarrier counts
    as having completed the phase before 0, so the first round's waits (parity 1) pass."""
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    return s, ready.index(s)


@gluon.jit
def _ring_mma(a_bufs, b_bufs, ready, it, part, STAGES: gl.constexpr):
    """Consumer, K block ``it``: wait for its stage and issue A @ B^T into ``part``'s registers
    (not accumulating: the caller promotes); returns the wgmma token."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)


@gluon.jit
def _ring_retire(tok, empty, it, STAGES: gl.constexpr):
    """Consumer: wait for block ``it``'s MMA (wait 0: reading a product while another wgmma is in
    flight serializes every wgmma, C7514) and release its stage; returns the product."""
    part = warpgroup_mma_wait(0, deps=(tok, ))
    mbarrier.arrive(empty.index(it % STAGES), count=1)
    return part


@gluon.jit
def _producer_tile(it, pid_m, pid_n, e, a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, N, NK: gl.constexpr,
                   STAGES: gl.constexpr):
    """``_producer``'s tile: per K block, A's two 64-row halves and B's 128 x 128 block into the
    ring's next stage; returns the K-block count."""
    row0 = pid_m * 128
    # a partial last column tile reads the next expert's first rows (or TMA's zeros past the last):
    # finite E4M3, and their columns are not stored
    brow = e * N + pid_n * 128
    for kb in range(NK):
        s, bar = _ring_fill(ready, empty, it, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes, STAGES)
        tma.async_copy_global_to_shared(a_desc, [row0, kb * 128], bar, a_lo.index(s))
        tma.async_copy_global_to_shared(a_desc, [row0 + 64, kb * 128], bar, a_hi.index(s))
        tma.async_copy_global_to_shared(b_desc, [brow, kb * 128], bar, b_bufs.index(s))
        it += 1
    return it


@gluon.jit
def _producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
              NK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr):
    num_n = gl.cdiv(N, 128)
    it = 0
    _walk_row_tiles(_producer_tile, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, N, NK, STAGES), it,
                    tile_expert_ptr, num_tiles_ptr, num_m, num_n, GROUP_M, SCHED_BM)


@gluon.jit
def _store_tile(ptr, stride, val, rows, col0, ncols, layout: gl.constexpr):
    """val [rows, C] into ptr's rows ``rows`` and columns col0 .. col0 + C - 1 (those below ncols),
    converted to ``layout`` first (16-byte row pieces: the MMA layout holds 2 adjacent columns a
    thread)."""
    val = gl.convert_layout(val, layout)
    r = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, val.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(ptr + r[:, None] * stride + cols[None, :], val, mask=(cols < ncols)[None, :])


@gluon.jit
def _epilogue(acc, rows, pid_n, N, epi, EPILOGUE: gl.constexpr, layout: gl.constexpr):
    """A consumer's 64 rows (``rows``, int64) of column tile pid_n, fp32 ``acc`` in the MMA
    ``layout``, through ``EPILOGUE`` with its arguments ``epi``; columns at or past N untouched."""
    # stores and pushes from a layout of 16-byte row pieces (8 bf16 a thread, a warp two rows of
    # 128): the MMA layout holds 2 adjacent columns a thread
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    if EPILOGUE == EPI_STORE:
        c_ptr, stride_cm = epi
        _store_tile(c_ptr, stride_cm, acc.to(c_ptr.dtype.element_ty), rows, pid_n * 128, N, out_layout)
    elif EPILOGUE == EPI_PUSH:
        row_src_ptr, dst_ptrs_ptr, TK, stride_dm, ref = epi
        val = gl.convert_layout(acc.to(ref.dtype.element_ty), out_layout)
        rows_o = gl.convert_layout(rows, gl.SliceLayout(1, out_layout))
        cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, out_layout))
        rs = gl.load(row_src_ptr + rows_o)
        valid = rs >= 0
        rs = gl.where(valid, rs, 0)
        base = gl.load(dst_ptrs_ptr + rs // TK, mask=valid, other=0)
        # each row addressed as an element offset from ``ref`` (the table's address as a pointer of
        # the destination type), as gemm._push_rows_prep: with 16-byte aligned bases and row strides
        # the rows store in 16-byte vectors
        ESIZE: gl.constexpr = ref.dtype.element_ty.primitive_bitwidth // 8
        ref_addr = dst_ptrs_ptr.to(gl.int64, bitcast=True)
        row_off = gl.multiple_of((base - ref_addr) // ESIZE + (rs % TK).to(gl.int64) * stride_dm, 16 // ESIZE)
        gl.store(ref + row_off[:, None] + cols[None, :], val, mask=valid[:, None] & (cols < N)[None, :])
    else:  # the activation's backward, ACT = EPILOGUE // EPI_KINDS (epi_act_bwd)
        gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm, limit, alpha = epi
        ACT: gl.constexpr = EPILOGUE // EPI_KINDS
        w = gl.load(ws_ptr + rows)
        # the two column halves one after the other, as the Triton kernel (fewer live tiles; the
        # same dw sums)
        acc_lo, acc_hi = gl.split(gl.permute(gl.reshape(acc, (64, 2, 64)), (0, 2, 1)))
        cols_lo = pid_n * 128 + gl.arange(0, 64, layout=gl.SliceLayout(0, acc_lo.type.layout))
        rows_h = gl.convert_layout(rows, gl.SliceLayout(1, acc_lo.type.layout))
        w_h = gl.convert_layout(w, gl.SliceLayout(1, acc_lo.type.layout))
        dw = _swiglu_bwd_epilogue(acc_lo, rows_h, cols_lo, w_h, gu_ptr, stride_gum, dgu_ptr, stride_dgum, hw_ptr,
                                  stride_hwm, N, ACT, limit, alpha)
        dw += _swiglu_bwd_epilogue(acc_hi, rows_h, cols_lo + 64, w_h, gu_ptr, stride_gum, dgu_ptr, stride_dgum, hw_ptr,
                                   stride_hwm, N, ACT, limit, alpha)
        gl.store(dwp_ptr + rows_h * stride_dwpm + pid_n, dw)


@gluon.jit
def _promoted_k_loop(it, part, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse,
                     stride_bsn, HALF_ROW: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr):
    """A consumer's 64 rows of one tile: the K loop, each block's product promoted by its row and
    weight scales; returns (acc, its rows, the K-block count, the product registers)."""
    layout: gl.constexpr = part.type.layout
    rows = pid_m.to(gl.int64) * 128 + HALF_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    as_ptrs = as_ptr + rows * stride_asm
    bs_base = bs_ptr + e.to(gl.int64) * stride_bse + pid_n * stride_bsn
    sa = gl.load(as_ptrs)
    sb = gl.load(bs_base)
    acc = gl.zeros([64, 128], gl.float32, layout)
    for kb in range(NK):
        tok = _ring_mma(a_bufs, b_bufs, ready, it, part, STAGES)
        # the next block's scales load under this block's MMA
        kn = gl.minimum(kb + 1, NK - 1)
        sa_next = gl.load(as_ptrs + kn)
        sb_next = gl.load(bs_base + kn)
        part = _ring_retire(tok, empty, it, STAGES)
        acc += part * (sa * sb)[:, None]
        sa = sa_next
        sb = sb_next
        it += 1
    return acc, rows, it, part


@gluon.jit
def _consumer_tile(state, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse,
                   stride_bsn, epi, N, HALF_ROW: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr,
                   EPILOGUE: gl.constexpr):
    """``_consumer``'s tile: ``_promoted_k_loop``, then the epilogue; returns (the K-block count,
    the product registers)."""
    it, part = state
    acc, rows, it, part = _promoted_k_loop(it, part, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, as_ptr, stride_asm,
                                           bs_ptr, stride_bse, stride_bsn, HALF_ROW, NK, STAGES)
    layout: gl.constexpr = part.type.layout
    _epilogue(acc, rows, pid_n, N, epi, EPILOGUE, layout)
    return it, part


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
              tile_expert_ptr, num_tiles_ptr, num_m, N, HALF_ROW: gl.constexpr, NK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    num_n = gl.cdiv(N, 128)
    it = 0
    part = gl.zeros([64, 128], gl.float32, layout)
    _walk_row_tiles(_consumer_tile, (a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn,
                                     epi, N, HALF_ROW, NK, STAGES, EPILOGUE), (it, part), tile_expert_ptr,
                    num_tiles_ptr, num_m, num_n, GROUP_M, SCHED_BM)


@gluon.jit
def rows_gemm_fp8_ws_kernel(a_desc, as_ptr, stride_asm, b_desc, bs_ptr, stride_bse, stride_bsn, epi,
                            tile_expert_ptr, num_tiles_ptr, num_m, N, NK: gl.constexpr, STAGES: gl.constexpr,
                            GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr):
    a_lo, a_hi, b_bufs, ready, empty = _ring_rows(a_desc, b_desc, STAGES)
    gl.warp_specialize([
        (_consumer, (a_lo, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                     tile_expert_ptr, num_tiles_ptr, num_m, N, 0, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_consumer, (a_hi, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                     tile_expert_ptr, num_tiles_ptr, num_m, N, 64, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
                     NK, STAGES, GROUP_M, SCHED_BM)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------
# the down dgrad with the activation's backward on an epilogue partition of its own
# --------------------------------------------------------------------------------------------
#
# As bf16_ws's 128-wide down dgrad (ws_common.py: the partition and its handoff): the consumers
# run ``_promoted_k_loop`` and hand their fp32 64 x 128 halves over in shared memory (64 KB beside
# 4 stages of 32 KB), then go on to the next tile; the activation's backward, which
# ``EPI_SWIGLU_BWD`` runs on the consumers with the tensor cores idle, runs on a fourth partition.
# The same sums as ``rows_gemm_fp8_ws_kernel``'s (dgu, hw: the same bits; dw summed per 128
# columns in slices).

@gluon.jit
def _dgrad_consumer_tile(state, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse,
                         stride_bsn, acc_smem, acc_full, acc_free, HALF_ROW: gl.constexpr, NK: gl.constexpr,
                         STAGES: gl.constexpr):
    """A consumer's tile: the K loop, then its half of the shared tile once the epilogue has read
    the tile before. State: (K-block count, product registers, tiles run)."""
    it, part, n = state
    acc, rows, it, part = _promoted_k_loop(it, part, pid_m, pid_n, e, a_bufs, b_bufs, ready, empty, as_ptr, stride_asm,
                                           bs_ptr, stride_bse, stride_bsn, HALF_ROW, NK, STAGES)
    wait_tile_free(acc_free, n)
    acc_smem.slice(HALF_ROW, 64, dim=0).store(acc)
    tile_handed_over(acc_full)
    return it, part, n + 1


@gluon.jit
def _dgrad_consumer(a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, acc_smem,
                    acc_full, acc_free, tile_expert_ptr, num_tiles_ptr, num_m, N, HALF_ROW: gl.constexpr,
                    NK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    part = gl.zeros([64, 128], gl.float32, layout)
    _walk_row_tiles(_dgrad_consumer_tile, (a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse,
                                           stride_bsn, acc_smem, acc_full, acc_free, HALF_ROW, NK, STAGES),
                    (gl.to_tensor(0), part, gl.to_tensor(0)), tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(N, 128),
                    GROUP_M, SCHED_BM)


@gluon.jit
def down_dgrad_fp8_ws_kernel(a_desc, as_ptr, stride_asm, b_desc, bs_ptr, stride_bse, stride_bsn, gu_ptr, stride_gum,
                             ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, NK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             SCHED_BM: gl.constexpr, EPI_COLS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             ACT: gl.constexpr = 0, LIMIT: gl.constexpr = 0.0, ALPHA: gl.constexpr = 0.0,
                             PREFETCH: gl.constexpr = False):
    """dh_raw = dys @ Wd[e] in FP8 (B: the transposed copy W_down^T [E, I, H], K-major) with the
    activation's backward on the epilogue partition (``ws_common.dgrad_epilogue``)."""
    a_lo, a_hi, b_bufs, ready, empty = _ring_rows(a_desc, b_desc, STAGES)
    acc_smem, acc_full, acc_free = handoff_smem(128)
    gl.warp_specialize([
        (dgrad_epilogue, (acc_smem, acc_full, acc_free, gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr,
                          stride_hwm, dwp_ptr, stride_dwpm, tile_expert_ptr, num_tiles_ptr, num_m, I, GROUP_M,
                          SCHED_BM, EPI_COLS, ACT, LIMIT, ALPHA, False, 128, PREFETCH)),
        (_dgrad_consumer, (a_lo, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, acc_smem,
                           acc_full, acc_free, tile_expert_ptr, num_tiles_ptr, num_m, I, 0, NK, STAGES, GROUP_M,
                           SCHED_BM)),
        (_dgrad_consumer, (a_hi, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, acc_smem,
                           acc_full, acc_free, tile_expert_ptr, num_tiles_ptr, num_m, I, 64, NK, STAGES, GROUP_M,
                           SCHED_BM)),
        (_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, I, NK,
                     STAGES, GROUP_M, SCHED_BM)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 40])


# --------------------------------------------------------------------------------------------
# the dgrads from the forward's weight copies: B's blocks transposed in the kernel
# --------------------------------------------------------------------------------------------
#
# A dgrad's B is a forward weight copy read the other way round: its 128 x 128 blocks are N-major
# there ([K, N], N contiguous), and FP8 wgmma reads B only K-major. Here the producer is a
# warpgroup. Per K block it loads A's two halves into the ring's stage (as ``_producer``) and B's
# N-major block into a ring of its own (``raw``, LAG + 1 stages), and LAG blocks later turns that
# block into the stage's K-major B through its registers (``_transpose_block``), then arrives on
# the stage's ``ready`` (two arrivals: the TMA's expect and the transposer's). So no transposed
# copy of a weight exists in memory; the consumers and their sums are ``rows_gemm_fp8_ws_kernel``'s,
# and so are the bits.
#
# Why it cannot deadlock: block j's transpose runs at the producer's step j + LAG, which first
# waits for the ring stage of block j + LAG, freed when the consumers finish block
# j + LAG - STAGES < j: they have, since they wait on block j. A raw stage is refilled at step
# j + LAG + 1, after block j's transpose and the partition's barrier that ends it.

# The transpose's register layouts over a 128 x 128 byte block (linear layouts; a base is the
# [row, column] offset one register, lane or warp bit adds). A thread holds 4 x 4 byte tiles:
# 4 bytes along the source's row (one 32-bit piece of an ``ldmatrix``, as Triton lowers the load)
# for 4 rows, which after the transpose are 4 bytes along the destination's row (a 32-bit
# store). With the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)) a load's bank
# is set by the column's bits 2-4 and bits 5-6 xor the row's bits 0-2, a store's alike with rows
# and columns exchanged; a base moves in one dimension, and each tile's row bits 0-1 and column
# bits 0-1 are register bits, so no choice of 5 lane bits serves both. Lanes take columns 4, 8,
# 16 and rows 4, 8: the loads run 2-way and the stores 4-way conflicted.
_T_SRC = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [0, 32], [0, 64], [16, 0]],
                                    lane_bases=[[0, 4], [0, 8], [0, 16], [4, 0], [8, 0]],
                                    warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 128])
_T_DST = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [32, 0], [64, 0], [0, 16]],
                                    lane_bases=[[4, 0], [8, 0], [16, 0], [0, 4], [0, 8]],
                                    warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[128, 128])


@gluon.jit
def _transpose_block(src, dst):
    """dst [N, K] = src [K, N] transposed, 128 x 128 bytes of shared memory (both with the 128-byte
    swizzle) through a warpgroup's registers: ``src.permute`` relabels the loaded registers and
    the conversion only reorders each thread's own (the two layouts differ in register bases
    alone), so the bytes cross between 32-bit words in registers, not in shared memory."""
    x = src.load(_T_SRC)
    dst.store(gl.convert_layout(gl.permute(x, (1, 0)), _T_DST))


@gluon.jit
def _transpose_stage(raw, b_bufs, ready, raw_ready, j, STAGES: gl.constexpr, RAW: gl.constexpr):
    """Block j: wait for its N-major block in ``raw``, write it K-major into its ring stage, make
    the writes visible to the wgmma (async proxy), and once every warp of the partition is done
    arrive on the stage's ``ready``; the barrier also frees the raw stage for its next load."""
    r = j % RAW
    mbarrier.wait(raw_ready.index(r), (j // RAW) & 1)
    _transpose_block(raw.index(r), b_bufs.index(j % STAGES))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready.index(j % STAGES), count=1)


@gluon.jit
def _transposing_producer_tile(it, pid_m, pid_n, e, a_desc, b0_desc, b1_desc, a_lo, a_hi, b_bufs, raw, ready, empty,
                               raw_ready, KR, NK: gl.constexpr, NK0: gl.constexpr, STAGES: gl.constexpr,
                               LAG: gl.constexpr):
    """``_transposing_producer``'s tile: per K block, A's two halves into the ring's next stage and
    B's N-major block into the raw ring, and the block LAG before it transposed into its stage;
    returns the K-block count."""
    RAW: gl.constexpr = LAG + 1
    row0 = pid_m * 128
    brow = e * KR
    for kb in range(NK):
        s, bar = _ring_fill(ready, empty, it, 2 * a_desc.block_type.nbytes, STAGES)
        tma.async_copy_global_to_shared(a_desc, [row0, kb * 128], bar, a_lo.index(s))
        tma.async_copy_global_to_shared(a_desc, [row0 + 64, kb * 128], bar, a_hi.index(s))
        r = it % RAW
        mbarrier.expect(raw_ready.index(r), b0_desc.block_type.nbytes)
        # a block's rows past KR are the next expert's (finite E4M3, or TMA's zeros past the last)
        # against A's zero columns; columns past N are TMA's zeros, not stored
        if kb < NK0:
            tma.async_copy_global_to_shared(b0_desc, [brow + kb * 128, pid_n * 128], raw_ready.index(r),
                                            raw.index(r))
        else:
            tma.async_copy_global_to_shared(b1_desc, [brow + (kb - NK0) * 128, pid_n * 128], raw_ready.index(r),
                                            raw.index(r))
        if it >= LAG:
            _transpose_stage(raw, b_bufs, ready, raw_ready, it - LAG, STAGES, RAW)
        it += 1
    return it


@gluon.jit
def _transposing_producer(a_desc, b0_desc, b1_desc, a_lo, a_hi, b_bufs, raw, ready, empty, raw_ready,
                          tile_expert_ptr, num_tiles_ptr, num_m, N, KR, NK: gl.constexpr, NK0: gl.constexpr,
                          STAGES: gl.constexpr, LAG: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr):
    """The producer of ``rows_gemm_fp8_ws_bt_kernel`` (a warpgroup): K blocks below NK0 come from
    b0's rows e * KR + kb * 128, the others from b1's rows e * KR + (kb - NK0) * 128, columns
    pid_n * 128, each transposed LAG blocks after its load."""
    RAW: gl.constexpr = LAG + 1
    num_n = gl.cdiv(N, 128)
    it = 0
    it = _walk_row_tiles(_transposing_producer_tile, (a_desc, b0_desc, b1_desc, a_lo, a_hi, b_bufs, raw, ready, empty,
                                                      raw_ready, KR, NK, NK0, STAGES, LAG), it, tile_expert_ptr,
                         num_tiles_ptr, num_m, num_n, GROUP_M, SCHED_BM)
    for d in gl.static_range(LAG):  # the last LAG blocks
        if it - LAG + d >= 0:
            _transpose_stage(raw, b_bufs, ready, raw_ready, it - LAG + d, STAGES, RAW)


@gluon.jit
def rows_gemm_fp8_ws_bt_kernel(a_desc, as_ptr, stride_asm, b0_desc, b1_desc, bs_ptr, stride_bse, stride_bsn, epi,
                               tile_expert_ptr, num_tiles_ptr, num_m, N, KR, NK: gl.constexpr, NK0: gl.constexpr,
                               STAGES: gl.constexpr, LAG: gl.constexpr, GROUP_M: gl.constexpr,
                               SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr):
    a_lo = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    a_hi = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    # the K-major blocks the wgmma reads, and the N-major blocks as TMA lands them (same swizzle)
    b_bufs = gl.allocate_shared_memory(b0_desc.dtype, [STAGES] + b0_desc.block_type.shape, b0_desc.layout)
    raw = gl.allocate_shared_memory(b0_desc.dtype, [LAG + 1] + b0_desc.block_type.shape, b0_desc.layout)
    ready, empty = _ring_barriers(STAGES, 2, 2)
    raw_ready = gl.allocate_shared_memory(gl.int64, [LAG + 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(LAG + 1):
        mbarrier.init(raw_ready.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_lo, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                     tile_expert_ptr, num_tiles_ptr, num_m, N, 0, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_consumer, (a_hi, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                     tile_expert_ptr, num_tiles_ptr, num_m, N, 64, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_transposing_producer, (a_desc, b0_desc, b1_desc, a_lo, a_hi, b_bufs, raw, ready, empty, raw_ready,
                                 tile_expert_ptr, num_tiles_ptr, num_m, N, KR, NK, NK0, STAGES, LAG, GROUP_M,
                                 SCHED_BM)),
    ], [4, 4], [232, 48])


# The same GEMM at 128 x 256 tiles, the stored and pushed rows' (``launch``): a stage is A's two
# halves and B's two 128 x 128 blocks, 48 KB for 128 x 256 products (24 KB per 128 x 128 against
# 32). A consumer holds two 64 x 128 accumulators and one product (192 of its partition's 232
# registers) and issues the two column halves' products one after the other, each waited for
# before its promotion; each half goes through ``_epilogue`` as a 128-column tile of its own (so
# the sums are the 128-wide kernel's). With the SwiGLU backward's epilogue (its loads of g | u and
# w beside the other half's accumulator) it spills: that epilogue runs at 128 x 128.


@gluon.jit
def _two_block_producer_tile(it, pid_m, pid_n, e, a_desc, b0_desc, b1_desc, a_lo, a_hi, b0_bufs, b1_bufs, ready,
                             empty, NB, NK: gl.constexpr, STAGES: gl.constexpr, TILE_N: gl.constexpr,
                             B1_ROW: gl.constexpr):
    """``_two_block_producer``'s tile: per K block, A's two halves and the two weight blocks into
    the ring's next stage; returns the K-block count."""
    row0 = pid_m * 128
    brow = e * NB + pid_n * TILE_N
    for kb in range(NK):
        s, bar = _ring_fill(ready, empty, it, 2 * a_desc.block_type.nbytes + 2 * b0_desc.block_type.nbytes, STAGES)
        k0 = kb * 128
        tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_lo.index(s))
        tma.async_copy_global_to_shared(a_desc, [row0 + 64, k0], bar, a_hi.index(s))
        tma.async_copy_global_to_shared(b0_desc, [brow, k0], bar, b0_bufs.index(s))
        tma.async_copy_global_to_shared(b1_desc, [brow + B1_ROW, k0], bar, b1_bufs.index(s))
        it += 1
    return it


@gluon.jit
def _two_block_producer(a_desc, b0_desc, b1_desc, a_lo, a_hi, b0_bufs, b1_bufs, ready, empty, tile_expert_ptr,
                        num_tiles_ptr, num_m, NB, NK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                        SCHED_BM: gl.constexpr, TILE_N: gl.constexpr, B1_ROW: gl.constexpr):
    """Producer of the two-block kernels (128 x 256 rows GEMM, 128-row gate/up): per K block, A's
    two 64-row halves and two 128 x 128 weight blocks, rows e * NB + pid_n * TILE_N of b0 and
    B1_ROW rows further of b1, over column tiles of TILE_N. A block past the weight's rows reads
    the next expert's first rows (or TMA's zeros past the last): finite E4M3, whose columns the
    consumers neither store nor count."""
    num_n = gl.cdiv(NB, TILE_N)
    it = 0
    _walk_row_tiles(_two_block_producer_tile, (a_desc, b0_desc, b1_desc, a_lo, a_hi, b0_bufs, b1_bufs, ready, empty,
                                               NB, NK, STAGES, TILE_N, B1_ROW), it, tile_expert_ptr, num_tiles_ptr,
                    num_m, num_n, GROUP_M, SCHED_BM)


@gluon.jit
def _two_block_mainloop(a_bufs, b0_bufs, b1_bufs, ready, empty, it, part, as_ptrs, s0_ptr, s1_ptr, NK: gl.constexpr,
                        STAGES: gl.constexpr, layout: gl.constexpr):
    """A consumer's K loop over one tile of the two-block kernels: (acc0, acc1, part, it), acc_i the
    sum of A @ B_i^T promoted per block by a_scale[rows] * s_i[kb] (the Triton kernels' promotion).
    The two products are issued one after the other, each waited for before its promotion (both
    at once would need 256 registers); the stage is released after the second."""
    sa = gl.load(as_ptrs)
    s0 = gl.load(s0_ptr)
    s1 = gl.load(s1_ptr)
    acc0 = gl.zeros([64, 128], gl.float32, layout)
    acc1 = gl.zeros([64, 128], gl.float32, layout)
    for kb in range(NK):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        tok = warpgroup_mma(a_bufs.index(s), b0_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
        # the next block's scales load under this block's MMAs
        kn = gl.minimum(kb + 1, NK - 1)
        sa_next = gl.load(as_ptrs + kn)
        s0_next = gl.load(s0_ptr + kn)
        s1_next = gl.load(s1_ptr + kn)
        part = warpgroup_mma_wait(0, deps=(tok, ))
        acc0 += part * (sa * s0)[:, None]
        tok = warpgroup_mma(a_bufs.index(s), b1_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
        part = _ring_retire(tok, empty, it, STAGES)
        acc1 += part * (sa * s1)[:, None]
        sa = sa_next
        s0 = s0_next
        s1 = s1_next
        it += 1
    return acc0, acc1, part, it


@gluon.jit
def _wide_consumer_tile(state, pid_m, pid_n, e, a_bufs, b_lo, b_hi, ready, empty, as_ptr, stride_asm, bs_ptr,
                        stride_bse, stride_bsn, epi, N, last_bn, HALF_ROW: gl.constexpr, NK: gl.constexpr,
                        STAGES: gl.constexpr, EPILOGUE: gl.constexpr):
    """``_wide_consumer``'s tile: its 64 rows' two column halves (``_two_block_mainloop``), each
    through the epilogue as a 128-column tile; returns (the K-block count, the product registers)."""
    it, part = state
    layout: gl.constexpr = part.type.layout
    rows = pid_m.to(gl.int64) * 128 + HALF_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    bs_e = bs_ptr + e.to(gl.int64) * stride_bse
    acc_lo, acc_hi, part, it = _two_block_mainloop(
        a_bufs, b_lo, b_hi, ready, empty, it, part, as_ptr + rows * stride_asm, bs_e + (2 * pid_n) * stride_bsn,
        bs_e + gl.minimum(2 * pid_n + 1, last_bn) * stride_bsn, NK, STAGES, layout)
    _epilogue(acc_lo, rows, 2 * pid_n, N, epi, EPILOGUE, layout)
    if (2 * pid_n + 1) * 128 < N:  # a half wholly past N has nothing to store (nor a dw partial)
        _epilogue(acc_hi, rows, 2 * pid_n + 1, N, epi, EPILOGUE, layout)
    return it, part


@gluon.jit
def _wide_consumer(a_bufs, b_lo, b_hi, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                   tile_expert_ptr, num_tiles_ptr, num_m, N, HALF_ROW: gl.constexpr, NK: gl.constexpr,
                   STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    num_n = gl.cdiv(N, 256)
    last_bn = gl.cdiv(N, 128) - 1  # the weight scales' last block row
    it = 0
    part = gl.zeros([64, 128], gl.float32, layout)
    _walk_row_tiles(_wide_consumer_tile, (a_bufs, b_lo, b_hi, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse,
                                          stride_bsn, epi, N, last_bn, HALF_ROW, NK, STAGES, EPILOGUE), (it, part),
                    tile_expert_ptr, num_tiles_ptr, num_m, num_n, GROUP_M, SCHED_BM)


@gluon.jit
def rows_gemm_fp8_ws_wide_kernel(a_desc, as_ptr, stride_asm, b_desc, bs_ptr, stride_bse, stride_bsn, epi,
                                 tile_expert_ptr, num_tiles_ptr, num_m, N, NK: gl.constexpr, STAGES: gl.constexpr,
                                 GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, EPILOGUE: gl.constexpr):
    a_lo, a_hi, b_lo, ready, empty = _ring_rows(a_desc, b_desc, STAGES)
    b_hi = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    gl.warp_specialize([
        (_wide_consumer, (a_lo, b_lo, b_hi, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                          tile_expert_ptr, num_tiles_ptr, num_m, N, 0, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_wide_consumer, (a_hi, b_lo, b_hi, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, epi,
                          tile_expert_ptr, num_tiles_ptr, num_m, N, 64, NK, STAGES, GROUP_M, SCHED_BM, EPILOGUE)),
        (_two_block_producer, (a_desc, b_desc, b_desc, a_lo, a_hi, b_lo, b_hi, ready, empty, tile_expert_ptr,
                               num_tiles_ptr, num_m, N, NK, STAGES, GROUP_M, SCHED_BM, 256, 128)),
    ], [4, 1], [232, 40])


def _sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and not INTERPRET and torch.cuda.get_device_capability(t.device)[0] == 9


def fits(aq: torch.Tensor, bq: torch.Tensor, sched_bm: int) -> bool:
    """Whether the rows GEMM runs here: a CUDA device of compute capability 9 (wgmma, TMA), the
    schedule's tiles a multiple of 128 rows, contiguous operands with K a multiple of 16 at 16-byte
    aligned addresses (TMA). Elsewhere gemm_fp8's Triton kernels run (the same sums)."""
    return (_sm90(aq) and sched_bm % BM == 0 and aq.is_contiguous() and bq.is_contiguous()
            and tma_aligned(aq) and tma_aligned(bq))


def fits_gate_up(aq: torch.Tensor, wg_q: torch.Tensor, wu_q: torch.Tensor, sched_bm: int) -> bool:
    """Whether gate/up runs here: as ``fits`` (schedule tiles a multiple of 128 rows), W_gate and
    W_up contiguous [E, I, H]."""
    return (_sm90(aq) and sched_bm % BM == 0 and all(t.is_contiguous() and tma_aligned(t) for t in (aq, wg_q, wu_q)))


def fits_wgrad(at: torch.Tensor, bt: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the padded weight gradient runs here: sm_90, R a multiple of 128, rows 16-byte
    aligned with a unit column stride (TMA), a 16-bit result (its TMA stores' buffers fit beside
    the rings) whose rows are 16-byte multiples."""
    return (_sm90(at) and at.shape[1] % BLOCK == 0 and bt.shape[1] == at.shape[1]
            and tma_aligned(at) and tma_aligned(bt) and out_dtype in (torch.bfloat16, torch.float16)
            and bt.shape[0] % 8 == 0)


def _e4m3_desc(t: torch.Tensor, rows: int, block_rows: int) -> TensorDescriptor:
    """A TMA descriptor over ``t`` seen as [rows, t.shape[-1]] E4M3 (row stride t.stride(-2)), in
    blocks of block_rows x 128 with the 128-byte swizzle the wgmma reads."""
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, BLOCK], gl.float8e4nv)
    return TensorDescriptor(t, [rows, t.shape[-1]], [t.stride(-2), 1], [block_rows, BLOCK], layout)


def _grid(device, tiles: int, grid: int | None) -> tuple:
    """Persistent: one program per SM (or ``grid``), no more than the tiles."""
    if grid is None:
        grid = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min(grid, tiles)),)


def launch(aq, a_scale, bq, b_scale, tile_expert, num_tiles, sched_bm: int, epilogue: int, epi: tuple, N: int, *,
           tile_n: int, stages: int, grid: int | None = None, GROUP_M: int = 8):
    """One persistent launch over the routed rows (R = aq.shape[0], kernel tiles of 128 rows) and
    N columns with ``epilogue`` (EPI_*) and its arguments ``epi``; the caller has checked operands.
    ``tile_n`` 256: the 128 x 256 kernel (``rows_gemm_fp8_ws_wide_kernel``; not with the SwiGLU
    backward, whose epilogue spills there), 128: ``rows_gemm_fp8_ws_kernel``; ``stages`` its ring's
    depth; ``grid`` the persistent grid (None: one program per SM)."""
    R, K = aq.shape
    num_m = R // BM
    if tile_n not in (BN, 2 * BN) or (tile_n == 2 * BN and epilogue % EPI_KINDS.value == EPI_SWIGLU_BWD.value):
        raise ValueError(f"launch: tile_n {tile_n} must be {BN} or {2 * BN} (not {2 * BN} with the SwiGLU backward)")
    kernel = rows_gemm_fp8_ws_wide_kernel if tile_n == 2 * BN else rows_gemm_fp8_ws_kernel
    kernel[_grid(aq.device, num_m * triton.cdiv(N, tile_n), grid)](
        _e4m3_desc(aq, R, HALF), a_scale, a_scale.stride(0), _e4m3_desc(bq, bq.shape[0] * bq.shape[1], BN), b_scale,
        b_scale.stride(0), b_scale.stride(1), epi, tile_expert, num_tiles, num_m, N, NK=triton.cdiv(K, BLOCK),
        STAGES=stages, GROUP_M=GROUP_M, SCHED_BM=sched_bm, EPILOGUE=epilogue, num_warps=4)


def launch_dgrad(aq, a_scale, bq, b_scale, tile_expert, num_tiles, sched_bm: int, epi: tuple, I: int, *,
                 stages: int, act: Activation = SWIGLU, epi_cols: int | None = None, consumer_regs: int = 168,
                 prefetch: bool = False, grid: int | None = None, GROUP_M: int = 8):
    """The down dgrad (``launch`` with ``epi_act_bwd(act)`` and its arguments ``epi``, the
    activation's limit and alpha left out of them) on ``down_dgrad_fp8_ws_kernel``: the backward on
    an epilogue partition; the caller has checked operands. ``stages``: the ring's depth (32 KB a
    stage, beside the 64 KB handoff); ``epi_cols``: the partition's slice (None: 16, gpt-oss's 8: the
    widest without spills beside 168-register consumers);
    ``consumer_regs``: the consumers' registers (the partition gets the rest); ``prefetch``: each
    slice's g, u loaded under the slice before."""
    R, K = aq.shape
    num_m = R // BM
    if epi_cols is None:
        epi_cols = 8 if act.kind == "gpt-oss" else 16
    ACT, LIMIT, ALPHA = act.constexprs()
    down_dgrad_fp8_ws_kernel[_grid(aq.device, num_m * triton.cdiv(I, BN), grid)](
        _e4m3_desc(aq, R, HALF), a_scale, a_scale.stride(0), _e4m3_desc(bq, bq.shape[0] * bq.shape[1], BN), b_scale,
        b_scale.stride(0), b_scale.stride(1), *epi[:9], tile_expert, num_tiles, num_m, I, NK=triton.cdiv(K, BLOCK),
        STAGES=stages, GROUP_M=GROUP_M, SCHED_BM=sched_bm, EPI_COLS=epi_cols, CONSUMER_REGS=consumer_regs, ACT=ACT,
        LIMIT=LIMIT, ALPHA=ALPHA, PREFETCH=prefetch, num_warps=4)


def fits_bt(aq: torch.Tensor, parts, sched_bm: int) -> bool:
    """Whether a dgrad reads its weight's forward copies transposed here (``launch_bt``): ``fits``
    with each part as B."""
    return len(parts) > 0 and all(fits(aq, p, sched_bm) for p in parts)


def launch_bt(aq, a_scale, parts, b_scale, tile_expert, num_tiles, sched_bm: int, epilogue: int, epi: tuple, N: int,
              *, stages: int, lag: int, grid: int | None = None, GROUP_M: int = 8):
    """``launch`` at 128 x 128 tiles with B read from forward weight copies, transposed in the
    kernel (``rows_gemm_fp8_ws_bt_kernel``): ``parts``, one or two E4M3 [E, KR, N] copies whose K
    ranges follow one another in A's columns, the second from column ceil(KR/128) * 128 (A's
    columns past each part's KR zeros); ``b_scale`` the dgrad's [E, ceil(N/128), K/128] (unit
    stride along K). The caller has checked operands (``fits_bt``). ``stages``: the ring's depth
    (beside its ``lag`` + 1 raw blocks); ``lag``: producer steps between a raw block's load and its
    transpose."""
    R, K = aq.shape
    E, KR, NB = parts[0].shape
    if NB != N or any(p.shape != parts[0].shape for p in parts) or b_scale.stride(-1) != 1:
        raise ValueError(f"launch_bt: parts {[tuple(p.shape) for p in parts]} must be [E, KR, N={N}] alike, "
                         "b_scale unit-strided along K")
    nk0 = triton.cdiv(KR, BLOCK)
    nk = triton.cdiv(K, BLOCK)
    if nk != nk0 * len(parts):
        raise ValueError(f"launch_bt: A's K {K} must span {len(parts)} part(s) of {nk0} blocks of {BLOCK}")
    if not 0 < lag < stages:
        raise ValueError(f"launch_bt: lag {lag} must lie in [1, stages {stages})")
    descs = [_e4m3_desc(p, E * KR, BN) for p in parts]
    num_m = R // BM
    rows_gemm_fp8_ws_bt_kernel[_grid(aq.device, num_m * triton.cdiv(N, BN), grid)](
        _e4m3_desc(aq, R, HALF), a_scale, a_scale.stride(0), descs[0], descs[-1], b_scale, b_scale.stride(0),
        b_scale.stride(1), epi, tile_expert, num_tiles, num_m, N, KR, NK=nk, NK0=nk0, STAGES=stages, LAG=lag,
        GROUP_M=GROUP_M, SCHED_BM=sched_bm, EPILOGUE=epilogue, num_warps=4)


def rows_gemm_fp8_ws(aq, a_scale, bq, b_scale, tile_expert, num_tiles, *, out=None, sched_bm: int = BM, **kw):
    """``gemm_fp8.rows_gemm_fp8``'s stored form (bf16 ``out [R, N]``), here (``fits``)."""
    R, K = aq.shape
    N = bq.shape[1]
    if not fits(aq, bq, sched_bm) or bq.shape[2] != K:
        raise ValueError(f"rows_gemm_fp8_ws: A {tuple(aq.shape)}, B {tuple(bq.shape)}, schedule tiles of {sched_bm} "
                         "rows do not run on the warp-specialized kernel (see fits)")
    _check_schedule(tile_expert, num_tiles, R, sched_bm)
    if out is None:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=aq.device)
    assert out.shape == (R, N) and out.stride(-1) == 1
    launch(aq, a_scale, bq, b_scale, tile_expert, num_tiles, sched_bm, EPI_STORE, (out, out.stride(0)), N, **kw)
    return out


# --------------------------------------------------------------------------------------------
# gate/up with the SwiGLU and h's 1x128 quantization in the epilogue
# --------------------------------------------------------------------------------------------
#
# gemm_fp8.gate_up_swiglu_fp8's sums at the rows GEMM's tile: two consumers of 64 rows each over a
# 128-row tile and 128 columns of h, both reading one stage of A's two halves and W_gate's and
# W_up's 128 x 128 blocks (48 KB). A consumer holds g's and u's accumulators and one block's
# product, 192 of the 232 registers its partition gets (setmaxnreg: ptxas allocates past the
# kernel's 168 inside it), so g's and u's products are issued one after the other, each waited
# for (wait 0) before its promotion. h's 1x128 tile is a consumer's own. (A 64-row tile with one
# 64 x 128 product a consumer moves twice the bytes per product and exchanges h's amax between
# the consumers: slower, measured.)


@gluon.jit
def _gate_up_consumer_tile(state, pid_m, pid_n, e, a_bufs, bg_bufs, bu_bufs, ready, empty, as_ptr, stride_asm, gs_ptr,
                           us_ptr, stride_wse, stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum,
                           I, HALF_ROW: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr,
                           SAVE_GU: gl.constexpr, ACT: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr):
    """``_gate_up_consumer``'s tile: its 64 rows' g and u (``_two_block_mainloop``), h = act(g, u)
    quantized per 1x128 into hq and h's scales, g and u stored where SAVE_GU; returns (the K-block
    count, the product registers)."""
    it, part = state
    layout: gl.constexpr = part.type.layout
    rows = pid_m.to(gl.int64) * 128 + HALF_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    ws_off = e.to(gl.int64) * stride_wse + pid_n * stride_wsn
    # g's and u's sums, promoted as the Triton kernel's
    g, u, part, it = _two_block_mainloop(a_bufs, bg_bufs, bu_bufs, ready, empty, it, part, as_ptr + rows * stride_asm,
                                         gs_ptr + ws_off, us_ptr + ws_off, NK, STAGES, layout)
    cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    h = act_fwd(g, u, ACT, LIMIT, ALPHA)
    h = gl.where((cols < I)[None, :], h, 0.0)  # columns past I take no part in the tile's scale
    # fp8.quantize_tile_rows: the tile's 128 columns are this consumer's
    j = scale_exponent(gl.max(gl.abs(h), axis=1))
    hq = to_e4m3(h * exp2_int(-j)[:, None], False)
    gl.store(hs_ptr + rows * stride_hsm + pid_n, exp2_int(j))
    # hq, g and u in 16-byte row pieces: 16 E4M3 a thread, 8 threads a row; 8 bf16 a thread, 16 a row
    _store_tile(hq_ptr, stride_hm, hq, rows, pid_n * 128, I, gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
    if SAVE_GU:
        bf16_rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        _store_tile(gu_ptr, stride_gum, g.to(gu_ptr.dtype.element_ty), rows, pid_n * 128, I, bf16_rows)
        _store_tile(gu_ptr + I, stride_gum, u.to(gu_ptr.dtype.element_ty), rows, pid_n * 128, I, bf16_rows)
    return it, part


@gluon.jit
def _gate_up_consumer(a_bufs, bg_bufs, bu_bufs, ready, empty, as_ptr, stride_asm, gs_ptr, us_ptr, stride_wse,
                      stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum, tile_expert_ptr,
                      num_tiles_ptr, num_m, I, HALF_ROW: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr,
                      GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr, SAVE_GU: gl.constexpr, ACT: gl.constexpr,
                      LIMIT: gl.constexpr, ALPHA: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    num_n = gl.cdiv(I, 128)
    it = 0
    part = gl.zeros([64, 128], gl.float32, layout)
    _walk_row_tiles(_gate_up_consumer_tile, (a_bufs, bg_bufs, bu_bufs, ready, empty, as_ptr, stride_asm, gs_ptr,
                                             us_ptr, stride_wse, stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm,
                                             gu_ptr, stride_gum, I, HALF_ROW, NK, STAGES, SAVE_GU, ACT, LIMIT, ALPHA),
                    (it, part),
                    tile_expert_ptr, num_tiles_ptr, num_m, num_n, GROUP_M, SCHED_BM)


@gluon.jit
def gate_up_swiglu_fp8_ws_kernel(a_desc, as_ptr, stride_asm, w_desc_g, w_desc_u, gs_ptr, us_ptr, stride_wse,
                                 stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum,
                                 tile_expert_ptr, num_tiles_ptr, num_m, I, NK: gl.constexpr,
                                 STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr,
                                 SAVE_GU: gl.constexpr, ACT: gl.constexpr = 0, LIMIT: gl.constexpr = 0.0,
                                 ALPHA: gl.constexpr = 0.0):
    a_lo, a_hi, bg_bufs, bu_bufs, ready, empty = _ring_gate_up(a_desc, w_desc_g, STAGES)
    gl.warp_specialize([
        (_gate_up_consumer, (a_lo, bg_bufs, bu_bufs, ready, empty, as_ptr, stride_asm, gs_ptr, us_ptr, stride_wse,
                             stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, 0, NK, STAGES, GROUP_M, SCHED_BM, SAVE_GU, ACT, LIMIT, ALPHA)),
        (_gate_up_consumer, (a_hi, bg_bufs, bu_bufs, ready, empty, as_ptr, stride_asm, gs_ptr, us_ptr, stride_wse,
                             stride_wsn, hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum, tile_expert_ptr,
                             num_tiles_ptr, num_m, I, 64, NK, STAGES, GROUP_M, SCHED_BM, SAVE_GU, ACT, LIMIT, ALPHA)),
        (_two_block_producer, (a_desc, w_desc_g, w_desc_u, a_lo, a_hi, bg_bufs, bu_bufs, ready, empty,
                               tile_expert_ptr, num_tiles_ptr, num_m, I, NK, STAGES, GROUP_M, SCHED_BM, 128, 0)),
    ], [4, 1], [232, 40])


def gate_up_swiglu_fp8_ws(aq, a_scale, wg_q, wg_scale, wu_q, wu_scale, tile_expert, num_tiles, *, hq=None,
                          h_scale=None, gu=None, sched_bm: int = BM, save_gu: bool = True, stages: int,
                          grid: int | None = None, GROUP_M: int = 8, act: Activation = SWIGLU):
    """``gemm_fp8.gate_up_swiglu_fp8`` warp-specialized (h = act(g, u)): (hq [R, I] E4M3, h_scale [R, ceil(I/128)],
    gu [R, 2I] bf16 or None), the same values, into the given outputs or new ones. Runs where
    ``fits_gate_up`` holds. ``stages``: the ring's depth (48 KB a stage)."""
    R, H = aq.shape
    E, I, H2 = wg_q.shape
    if H2 != H or wu_q.shape != wg_q.shape or wu_scale.stride() != wg_scale.stride() or not fits_gate_up(
            aq, wg_q, wu_q, sched_bm):
        raise ValueError(f"gate_up_swiglu_fp8_ws: A {tuple(aq.shape)}, W {tuple(wg_q.shape)}, schedule tiles of "
                         f"{sched_bm} rows do not run on the warp-specialized kernel (see fits_gate_up)")
    _check_schedule(tile_expert, num_tiles, R, sched_bm)
    if hq is None:
        hq = torch.empty(R, I, dtype=torch.float8_e4m3fn, device=aq.device)
    if h_scale is None:
        h_scale = torch.empty(R, triton.cdiv(I, BLOCK), dtype=torch.float32, device=aq.device)
    save_gu = save_gu or gu is not None
    if save_gu and gu is None:
        gu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=aq.device)
    assert hq.stride(-1) == 1 and h_scale.stride(-1) == 1 and (gu is None or gu.stride(-1) == 1)
    gu_arg = gu if save_gu else h_scale
    num_m = R // BM
    ACT, LIMIT, ALPHA = act.constexprs()
    gate_up_swiglu_fp8_ws_kernel[_grid(aq.device, num_m * triton.cdiv(I, BLOCK), grid)](
        _e4m3_desc(aq, R, HALF), a_scale, a_scale.stride(0), _e4m3_desc(wg_q, E * I, BN),
        _e4m3_desc(wu_q, E * I, BN), wg_scale, wu_scale, wg_scale.stride(0),
        wg_scale.stride(1), hq, hq.stride(0), h_scale, h_scale.stride(0), gu_arg, gu_arg.stride(0), tile_expert,
        num_tiles, num_m, I, NK=triton.cdiv(H, BLOCK), STAGES=stages, GROUP_M=GROUP_M,
        SCHED_BM=sched_bm, SAVE_GU=save_gu, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, num_warps=4)
    return hq, h_scale, (gu if save_gu else None)


# --------------------------------------------------------------------------------------------
# per-expert weight gradients over the layer's padded segments
# --------------------------------------------------------------------------------------------
#
# gemm_fp8.expert_wgrad_fp8(padded=True)'s sums, warp-specialized: C[e] = A_seg^T @ B_seg from the
# transposed operands (At [M, R], Bt [N, R], K-major), each 128-row block's product promoted by
# the outer product of its 128x1 scales, blocks in order; its structure is described above
# ``_wgrad_promote``.


@gluon.jit
def _wgrad_tile(t, num_m, num_n, expert_start_ptr, expert_count_ptr, GROUP_M: gl.constexpr):
    """Tile t -> (e, pid_m, pid_n, first block, end block) of the padded segment of expert e."""
    per_e = num_m * num_n
    e = t // per_e
    pid_m, pid_n = grouped_tile(t % per_e, num_m, num_n, GROUP_M)
    start = gl.load(expert_start_ptr + e)
    end = start + gl.load(expert_count_ptr + e)
    return e, pid_m, pid_n, start // 128, (end + 127) // 128


@gluon.jit
def _wgrad_store(acc, c_desc, c_bufs, e, row0, col0):
    """64 rows (row0..) x 128 columns (col0..) of expert e's weight gradient from a 64 x 128 fp32
    accumulator: its two 64-column halves into ``c_bufs`` [2, 64, 64] and out by TMA (``c_desc``
    over C [E, M, N] in [1, 64, 64] boxes: rows past M and columns past N are not written, and no
    row spills into the next expert's). The consumer goes on while the stores run; the buffers'
    previous stores are waited for (their reads of shared memory) before they are overwritten."""
    lo, hi = gl.split(gl.permute(gl.reshape(acc, (64, 2, 64)), (0, 2, 1)))
    tma.store_wait(0)
    c_bufs.index(0).store(lo.to(c_desc.dtype))
    c_bufs.index(1).store(hi.to(c_desc.dtype))
    fence_async_shared()
    box: gl.constexpr = c_desc.block_type.shape
    tma.async_copy_shared_to_global(c_desc, [e, row0, col0], c_bufs.index(0).reshape(box))
    tma.async_copy_shared_to_global(c_desc, [e, row0, col0 + 64], c_bufs.index(1).reshape(box))


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, expert_start_ptr, expert_count_ptr, E, M, N,
                    WHICH: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Pipeline WHICH's producer: its consumer's tiles (every other tile of the program's walk)."""
    num_m = gl.cdiv(M, 128)
    num_n = gl.cdiv(N, 128)
    it = 0
    for t in range(gl.program_id(0) + WHICH * gl.num_programs(0), E * num_m * num_n, 2 * gl.num_programs(0)):
        e, pid_m, pid_n, kf0, kf1 = _wgrad_tile(t, num_m, num_n, expert_start_ptr, expert_count_ptr, GROUP_M)
        for kb in range(kf0, kf1):
            s, bar = _ring_fill(ready, empty, it, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes, STAGES)
            tma.async_copy_global_to_shared(a_desc, [pid_m * 128, kb * 128], bar, a_lo.index(s))
            tma.async_copy_global_to_shared(a_desc, [pid_m * 128 + 64, kb * 128], bar, a_hi.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * 128, kb * 128], bar, b_bufs.index(s))
            it += 1


# The weight gradient as two pipelines. Each consumer warpgroup has its own producer warp and ring
# and takes alternate tiles of the program's walk (pipeline WHICH: tiles WHICH, WHICH + 2, ...),
# each the tile's 128 rows (A's two halves against B: two accumulators and one product, each
# half's MMA waited for before its promotion, as the two-block kernels). The pipelines share nothing but the
# SM, so one's promotions and epilogue run under the other's MMAs whatever the tiles' lengths: K is
# an expert's rows, often a few blocks (kimi-k2: 3), and two consumers on halves of one tile
# reach its end together and both store while the tensor cores idle. A consumer's tile leaves by
# TMA (``_wgrad_store``): it writes shared memory and returns to its MMAs while the copy runs.
#
# The scales load at their use, after the MMA's wait: the two accumulators and the product fill a
# consumer's registers, and any scale loaded earlier (even both halves' row scales, 2 registers
# more across an MMA) spills at sm_90a. Their latency is then the consumer's own, for the other
# pipeline's MMAs to cover (prefetched into L1 a block ahead, they ran no faster). The column
# scales' global load and their spread through shared memory also order ptxas's schedule: read
# from a TMA-filled stage instead, or constant, the consumer spills (docs/fp8-measurements.md).
# (each pipeline's ring depth: the plan's; 3 stages of 32 KB: 192 KB for both, + 32 KB of store buffers)


@gluon.jit
def _wgrad_promote(acc, part, sa_ptr, rows, M, sb_ptr, n_left, layout: gl.constexpr):
    """acc + part promoted by the outer product of this half's row scales and the tile's 128
    column scales (``sb_ptr``: the tile's first column; ``n_left`` columns remain before N). The
    column scales are loaded one a thread and spread to the accumulator's layout through shared
    memory: loaded in that layout, each thread would hold 32 addresses."""
    sa = gl.load(sa_ptr + rows, mask=rows < M, other=0.0)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    cols = gl.arange(0, 128, layout=one)
    sb = gl.convert_layout(gl.load(sb_ptr + cols, mask=cols < n_left, other=0.0), gl.SliceLayout(0, layout))
    return acc + part * (sa[:, None] * sb[None, :])


@gluon.jit
def _wgrad_consumer(a_lo, a_hi, b_bufs, ready, empty, as_ptr, stride_asr, bs_ptr, stride_bsr, c_desc, c_bufs,
                    expert_start_ptr, expert_count_ptr, E, M, N, WHICH: gl.constexpr, STAGES: gl.constexpr,
                    GROUP_M: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    num_m = gl.cdiv(M, 128)
    num_n = gl.cdiv(N, 128)
    it = 0
    part = gl.zeros([64, 128], gl.float32, layout)
    for t in range(gl.program_id(0) + WHICH * gl.num_programs(0), E * num_m * num_n, 2 * gl.num_programs(0)):
        e, pid_m, pid_n, kf0, kf1 = _wgrad_tile(t, num_m, num_n, expert_start_ptr, expert_count_ptr, GROUP_M)
        rows = pid_m * 128 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        sb_ptr = bs_ptr + pid_n * 128
        n_left = N - pid_n * 128
        acc_lo = gl.zeros([64, 128], gl.float32, layout)
        acc_hi = gl.zeros([64, 128], gl.float32, layout)
        for kb in range(kf0, kf1):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            tok = warpgroup_mma(a_lo.index(s), b_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
            # (rows past M, columns past N: TMA's zeros in the product, scale 0, not stored)
            part = warpgroup_mma_wait(0, deps=(tok, ))
            acc_lo = _wgrad_promote(acc_lo, part, as_ptr + kb * stride_asr, rows, M, sb_ptr + kb * stride_bsr,
                                    n_left, layout)
            tok = warpgroup_mma(a_hi.index(s), b_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
            part = _ring_retire(tok, empty, it, STAGES)
            acc_hi = _wgrad_promote(acc_hi, part, as_ptr + kb * stride_asr, rows + 64, M, sb_ptr + kb * stride_bsr,
                                    n_left, layout)
            it += 1
        _wgrad_store(acc_lo, c_desc, c_bufs, e, pid_m * 128, pid_n * 128)
        _wgrad_store(acc_hi, c_desc, c_bufs, e, pid_m * 128 + 64, pid_n * 128)
    tma.store_wait(0)


@gluon.jit
def expert_wgrad_fp8_ws_kernel(a_desc, as_ptr, stride_asr, b_desc, bs_ptr, stride_bsr, c_desc, expert_start_ptr,
                               expert_count_ptr, E, M, N, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    a_lo0, a_hi0, b_bufs0, ready0, empty0 = _ring_rows(a_desc, b_desc, STAGES, 1)
    a_lo1, a_hi1, b_bufs1, ready1, empty1 = _ring_rows(a_desc, b_desc, STAGES, 1)
    # each consumer's epilogue buffers: two 64 x 64 halves of its 64 rows (16 KB; 192 + 32 KB in all)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], c_desc.dtype)
    c_bufs0 = gl.allocate_shared_memory(c_desc.dtype, [2, 64, 64], c_layout)
    c_bufs1 = gl.allocate_shared_memory(c_desc.dtype, [2, 64, 64], c_layout)
    gl.warp_specialize([
        (_wgrad_consumer, (a_lo0, a_hi0, b_bufs0, ready0, empty0, as_ptr, stride_asr, bs_ptr, stride_bsr, c_desc,
                           c_bufs0, expert_start_ptr, expert_count_ptr, E, M, N, 0, STAGES, GROUP_M)),
        (_wgrad_consumer, (a_lo1, a_hi1, b_bufs1, ready1, empty1, as_ptr, stride_asr, bs_ptr, stride_bsr, c_desc,
                           c_bufs1, expert_start_ptr, expert_count_ptr, E, M, N, 1, STAGES, GROUP_M)),
        (_wgrad_producer, (a_desc, b_desc, a_lo0, a_hi0, b_bufs0, ready0, empty0, expert_start_ptr, expert_count_ptr,
                           E, M, N, 0, STAGES, GROUP_M)),
        (_wgrad_producer, (a_desc, b_desc, a_lo1, a_hi1, b_bufs1, ready1, empty1, expert_start_ptr, expert_count_ptr,
                           E, M, N, 1, STAGES, GROUP_M)),
    ], [4, 1, 1], [232, 40, 40])


def _out_desc(out: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over the weight gradient C [E, M, N] (bf16 or fp16) in [1, 64, 64] boxes."""
    dt = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, 64, 64], dt)
    return TensorDescriptor.from_tensor(out, [1, 64, 64], layout)


def expert_wgrad_fp8_ws(at, a_scale, bt, b_scale, expert_start, expert_count, *, out_dtype=torch.bfloat16,
                        stages: int, grid: int | None = None, GROUP_M: int = 8):
    """``gemm_fp8.expert_wgrad_fp8(..., padded=True)`` warp-specialized: C [E, M, N] from at [M, R],
    bt [N, R] E4M3 (128x1 scales [R/128, M], [R/128, N]), the layer's padded segments (each starts
    at a multiple of 128, zeros from its end to the next). Needs sm_90, R a multiple of 128,
    16-byte aligned rows (TMA) and a bf16 or fp16 result (``fits_wgrad``). ``stages``: each
    pipeline's ring depth."""
    M, R = at.shape
    N = bt.shape[0]
    E = expert_count.numel()
    if not fits_wgrad(at, bt, out_dtype):
        raise ValueError(f"expert_wgrad_fp8_ws: at {tuple(at.shape)}, bt {tuple(bt.shape)} do not run on the "
                         "warp-specialized kernel (see fits_wgrad)")
    out = torch.empty(E, M, N, dtype=out_dtype, device=at.device)
    expert_wgrad_fp8_ws_kernel[_grid(at.device, E * triton.cdiv(M, BM) * triton.cdiv(N, BN), grid)](
        _e4m3_desc(at, M, HALF), a_scale, a_scale.stride(0), _e4m3_desc(bt, N, BN), b_scale, b_scale.stride(0),
        _out_desc(out), expert_start, expert_count, E, M, N, STAGES=stages, GROUP_M=GROUP_M, num_warps=4)
    return out
