"""The FP8 rows GEMM warp-specialized (Gluon): promotion of one warpgroup under the other's MMA.

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
Persistent: ``grid`` programs walk the tiles in ``grouped_tile`` order; every partition walks the
same sequence and the ring's stage and phase follow a running K-block count, so the producer
runs into the next tile while the consumers store the last.

Requirements (checked by the wrapper): K a multiple of 16 (TMA strides), N a multiple of 128 (a
tile never reads another expert's weight rows), the schedule's tile height 128.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp8 import BLOCK
from .gemm import _check_schedule

BM = 128  # two consumer warpgroups of 64 rows
BN = 128
HALF = 64


@gluon.jit
def _tile_of(t, num_m, num_n, GROUP_M: gl.constexpr):
    """``gemm.grouped_tile``: GROUP_M row tiles per column sweep."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size_m, (t % per_group) // size_m


@gluon.jit
def _producer(a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
              NK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    num_n = N // 128
    nt = gl.load(num_tiles_ptr)
    it = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        e = gl.load(tile_expert_ptr + pid_m)
        if (pid_m < nt) & (e >= 0):
            row0 = pid_m * 128
            brow = e * N + pid_n * 128
            for kb in range(NK):
                s = it % STAGES
                # a fresh mbarrier counts as having completed the phase before 0: the first
                # round's waits (parity 1) pass
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, kb * 128], ready.index(s), a_lo.index(s))
                tma.async_copy_global_to_shared(a_desc, [row0 + 64, kb * 128], ready.index(s), a_hi.index(s))
                tma.async_copy_global_to_shared(b_desc, [brow, kb * 128], ready.index(s), b_bufs.index(s))
                it += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, c_ptr, stride_cm,
              tile_expert_ptr, num_tiles_ptr, num_m, N, HALF_ROW: gl.constexpr, NK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    num_n = N // 128
    nt = gl.load(num_tiles_ptr)
    it = 0
    part = gl.zeros([64, 128], gl.float32, layout)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        e = gl.load(tile_expert_ptr + pid_m)
        if (pid_m < nt) & (e >= 0):
            rows = pid_m * 128 + HALF_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
            as_ptrs = as_ptr + rows.to(gl.int64) * stride_asm
            bs_base = bs_ptr + e.to(gl.int64) * stride_bse + pid_n * stride_bsn
            sa = gl.load(as_ptrs)
            sb = gl.load(bs_base)
            acc = gl.zeros([64, 128], gl.float32, layout)
            for kb in range(NK):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a = a_bufs.index(s)
                b = b_bufs.index(s)
                tok = warpgroup_mma(a, b.permute((1, 0)), part, use_acc=False, is_async=True)
                # the next block's scales load under this block's MMA
                kn = gl.minimum(kb + 1, NK - 1)
                sa_next = gl.load(as_ptrs + kn)
                sb_next = gl.load(bs_base + kn)
                part = warpgroup_mma_wait(0, deps=(tok, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc += part * (sa * sb)[:, None]
                sa = sa_next
                sb = sb_next
                it += 1
            ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty))


@gluon.jit
def rows_gemm_fp8_ws_kernel(a_desc, as_ptr, stride_asm, b_desc, bs_ptr, stride_bse, stride_bsn, c_ptr, stride_cm,
                            tile_expert_ptr, num_tiles_ptr, num_m, N, NK: gl.constexpr, STAGES: gl.constexpr,
                            GROUP_M: gl.constexpr):
    a_lo = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    a_hi = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_consumer, (a_lo, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, c_ptr,
                     stride_cm, tile_expert_ptr, num_tiles_ptr, num_m, N, 0, NK, STAGES, GROUP_M)),
        (_consumer, (a_hi, b_bufs, ready, empty, as_ptr, stride_asm, bs_ptr, stride_bse, stride_bsn, c_ptr,
                     stride_cm, tile_expert_ptr, num_tiles_ptr, num_m, N, 64, NK, STAGES, GROUP_M)),
        (_producer, (a_desc, b_desc, a_lo, a_hi, b_bufs, ready, empty, tile_expert_ptr, num_tiles_ptr, num_m, N,
                     NK, STAGES, GROUP_M)),
    ], [4, 1], [232, 40])


def _descriptors(aq, bq):
    a_layout = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BLOCK], gl.float8e4nv)
    E, N, K = bq.shape
    a_desc = TensorDescriptor.from_tensor(aq, [HALF, BLOCK], a_layout)
    b_desc = TensorDescriptor(bq, [E * N, K], [K, 1], [BN, BLOCK], b_layout)
    return a_desc, b_desc


def rows_gemm_fp8_ws(aq, a_scale, bq, b_scale, tile_expert, num_tiles, *, out=None, stages: int = 4,
                     grid: int | None = None, GROUP_M: int = 8):
    """``gemm_fp8.rows_gemm_fp8``'s stored form (bf16 ``out [R, N]``), warp-specialized."""
    R, K = aq.shape
    E, N, Kb = bq.shape
    if Kb != K or K % 16 or N % BN:
        raise ValueError(f"rows_gemm_fp8_ws needs K (A {K}, B {Kb}) equal and a multiple of 16, N ({N}) of {BN}")
    if not (aq.is_contiguous() and bq.is_contiguous()):
        raise ValueError("rows_gemm_fp8_ws needs contiguous aq and bq")
    _check_schedule(tile_expert, num_tiles, R, BM)
    if out is None:
        out = torch.empty(R, N, dtype=torch.bfloat16, device=aq.device)
    assert out.shape == (R, N) and out.stride(-1) == 1
    num_m = R // BM
    tiles = num_m * (N // BN)
    if grid is None:
        grid = min(tiles, torch.cuda.get_device_properties(aq.device).multi_processor_count)
    a_desc, b_desc = _descriptors(aq, bq)
    rows_gemm_fp8_ws_kernel[(max(1, grid),)](
        a_desc, a_scale, a_scale.stride(0), b_desc, b_scale, b_scale.stride(0), b_scale.stride(1), out,
        out.stride(0), tile_expert, num_tiles, num_m, N, NK=triton.cdiv(K, BLOCK), STAGES=stages, GROUP_M=GROUP_M,
        num_warps=4)
    return out
