"""What the warp-specialized kernels (fp8_ws.py, bf16_ws.py) share: the persistent walk over the
routed rows' tiles, and the down dgrad's epilogue partition.

The walk: every partition of a kernel visits the same tiles in the same order (``_walk_row_tiles``),
which is what lets their rings and handoffs count phases without talking to each other.

The epilogue partition: a kernel's consumers hand each finished tile of dh_raw = dys @ Wd[e] over
in shared memory (``acc_smem``: 128 rows, fp32, or bf16 at 256 columns) and go on to the next
tile's K loop, while this partition (4 warps) runs the activation's backward from there, EPI_COLS
columns at a time: g, u read, dg, du and ws * h written, the router weight's partial sums.
The handoff: ``acc_full`` (count 2: each consumer arrives once its 64 rows are stored) and
``acc_free`` (count 1: the partition arrives once it has read the whole tile); the n-th tile a
program runs is phase n of both. A consumer waits on ``acc_free`` of the tile before (parity
(n & 1) ^ 1: a fresh barrier passes the first, ``wait_tile_free``), the partition on ``acc_full``
of its tile: each waits only for work another partition of the same CTA has already been given,
so no wait depends on another program (tests/test_ws_ring_model.py models it).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .activation import ACT_RELU2, act_fwd, act_grads
from .bf16 import _swiglu_bwd_math, grouped_tile

BM = gl.constexpr(128)  # a kernel tile's rows: two consumer warpgroups of 64


# --------------------------------------------------------------------------------------------
# the persistent walk
# --------------------------------------------------------------------------------------------

@gluon.jit
def _row_tile(t, num_m, num_n, tile_expert_ptr, nt, GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr):
    """Tile t of a persistent walk over 128-row kernel tiles, in ``gemm.grouped_tile`` order:
    (pid_m, pid_n, its expert), the expert -1 where its schedule tile (SCHED_BM rows) is unused (at
    or past ``nt``, the used tiles: gemm._row_tile_expert with the count loaded once per program).
    Every partition of a kernel walks the same tiles."""
    pid_m, pid_n = grouped_tile(t, num_m, num_n, GROUP_M)
    st = pid_m * 128 // SCHED_BM
    e = gl.load(tile_expert_ptr + st)
    return pid_m, pid_n, gl.where(st < nt, e, -1)


@gluon.jit
def _walk_row_tiles(TILE: gl.constexpr, args, state, tile_expert_ptr, num_tiles_ptr, num_m, num_n,
                    GROUP_M: gl.constexpr, SCHED_BM: gl.constexpr):
    """A partition's persistent walk over num_m x num_n row tiles (this program's: tiles
    program_id, program_id + programs, ... in ``_row_tile``'s order, the same for every partition
    of a kernel): ``state = TILE(state, pid_m, pid_n, e, *args)`` for each used tile, the unused
    skipped; returns the last state. The state is what a partition carries from tile to tile (the
    ring's K-block count, a consumer's product registers); ``args`` the tile function's own (a
    tuple, constexprs included: they reach TILE as its parameters, still constant)."""
    nt = gl.load(num_tiles_ptr)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n, e = _row_tile(t, num_m, num_n, tile_expert_ptr, nt, GROUP_M, SCHED_BM)
        if e >= 0:
            state = TILE(state, pid_m, pid_n, e, *args)
    return state


# --------------------------------------------------------------------------------------------
# the down dgrad's epilogue partition
# --------------------------------------------------------------------------------------------

@gluon.jit
def wait_tile_free(acc_free, n):
    """A consumer, before storing its half of its n-th tile: the epilogue has read the tile before."""
    mbarrier.wait(acc_free, (n & 1) ^ 1)


@gluon.jit
def tile_handed_over(acc_full):
    """A consumer, after storing its half: every thread's part stored, then the partition's one
    arrival."""
    gl.thread_barrier()
    mbarrier.arrive(acc_full, count=1)


@gluon.jit
def wait_tile_full(acc_full, n):
    """The epilogue partition, before reading its n-th tile: both consumers have stored their halves."""
    mbarrier.wait(acc_full, n & 1)


@gluon.jit
def tile_read(acc_free):
    """The epilogue partition, once it has read the whole tile: every thread's reads done, then its
    one arrival (the consumers may store the next)."""
    gl.thread_barrier()
    mbarrier.arrive(acc_free, count=1)


@gluon.jit
def handoff_barriers():
    """The handoff's two barriers: ``acc_full`` of two arrivals (the consumers), ``acc_free`` of one
    (the epilogue partition)."""
    acc_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(acc_full, count=2)
    mbarrier.init(acc_free, count=1)
    return acc_full, acc_free


@gluon.jit
def handoff_smem(TILE_N: gl.constexpr):
    """The shared tile and its barriers (``handoff_barriers``): fp32 at 128 columns, bf16 at 256 (rows
    of 512 bytes either way: 2-element pieces swizzled across rows, so that the MMA layout's stores,
    8 rows a warp and 2 columns a thread, fall in different banks)."""
    acc_smem = gl.allocate_shared_memory(gl.float32 if TILE_N == 128 else gl.bfloat16, [BM, TILE_N],
                                         gl.SwizzledSharedLayout(2, 1, 8, order=[1, 0]))
    acc_full, acc_free = handoff_barriers()
    return acc_smem, acc_full, acc_free


@gluon.jit
def _gu_slice(rows, cols, gu_ptr, stride_gum, I, ACT: gl.constexpr):
    """A slice's saved g, u as stored (bf16; 0 past I); ungated (relu2): u for both. (bf16.py's
    ``_load_gu`` converts to fp32 as it loads; a prefetched slice held in bf16 takes half the
    registers.)"""
    mask = (cols < I)[None, :]
    ptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
    u = gl.load(ptrs + I, mask=mask, other=0.0)
    if ACT == ACT_RELU2:  # (g's columns never written)
        g = u
    else:
        g = gl.load(ptrs, mask=mask, other=0.0)
    return g, u


@gluon.jit
def _dgrad_epilogue_tile(n, pid_m, pid_n, e, acc_smem, acc_full, acc_free, gu_ptr, stride_gum, ws_ptr, dgu_ptr,
                         stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm, I, EPI_COLS: gl.constexpr,
                         ACT: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr, DGU_PAIRED: gl.constexpr,
                         TILE_N: gl.constexpr, PREFETCH: gl.constexpr):
    """The epilogue partition's tile (its n-th): bf16.py's ``_swiglu_bwd_math`` on EPI_COLS columns
    at a time of the shared tile, released once the last slice is read; the router weight's partial
    sum of the tile's TILE_N columns into dwp[:, pid_n]. PREFETCH: each slice's g, u loaded while
    the slice before is computed (the first's before the tile is handed over: they do not depend
    on it), so that the partition's four warps wait for one load latency a tile, not one a slice."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (EPI_COLS // 8), EPI_COLS // 8], [4, 1], [1, 0])
    rows = pid_m.to(gl.int64) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols0 = pid_n * TILE_N + gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    w = gl.load(ws_ptr + rows)
    dw = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
    if PREFETCH:
        g_next, u_next = _gu_slice(rows, cols0, gu_ptr, stride_gum, I, ACT)
    wait_tile_full(acc_full, n)
    for c in gl.static_range(0, TILE_N, EPI_COLS):
        cols = cols0 + c
        if PREFETCH:
            g, u = g_next, u_next
            if c + EPI_COLS < TILE_N:
                g_next, u_next = _gu_slice(rows, cols + EPI_COLS, gu_ptr, stride_gum, I, ACT)
        else:
            g, u = _gu_slice(rows, cols, gu_ptr, stride_gum, I, ACT)
        acc = acc_smem.slice(c, EPI_COLS, dim=1).load(layout).to(gl.float32)
        if c + EPI_COLS == TILE_N:  # the whole tile read
            tile_read(acc_free)
        if DGU_PAIRED:
            dw += _paired_bwd_slice(acc, g.to(gl.float32), u.to(gl.float32), rows, cols, pid_n * TILE_N + c, w,
                                    dgu_ptr, stride_dgum, hw_ptr, stride_hwm, I, ACT, LIMIT, ALPHA, EPI_COLS)
        else:
            dw += _swiglu_bwd_math(acc, g.to(gl.float32), u.to(gl.float32), rows, cols, w, dgu_ptr, stride_dgum,
                                   hw_ptr, stride_hwm, I, ACT, LIMIT, ALPHA)
    gl.store(dwp_ptr + rows * stride_dwpm + pid_n, dw)
    return n + 1


@gluon.jit
def _paired_bwd_slice(acc, g, u, rows, cols, col0, w, dgu_ptr, stride_dgum, hw_ptr, stride_hwm, I,
                      ACT: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr, EPI_COLS: gl.constexpr):
    """bf16.py's ``_swiglu_bwd_math`` with dg and du stored interleaved (dg's column c at 2c, du's
    at 2c + 1: gpt-oss's gate_up_proj order) from a layout of 16-byte pieces of the interleaved row
    (columns col0 .. col0 + EPI_COLS - 1); returns the slice's partial sums of dh_raw * h."""
    h = act_fwd(g, u, ACT, LIMIT, ALPHA)
    dw = gl.sum(acc * h, axis=1)
    dh = acc * w[:, None]
    dg, du = act_grads(g, u, dh, ACT, LIMIT, ALPHA)
    cmask = (cols < I)[None, :]
    gl.store(hw_ptr + rows[:, None] * stride_hwm + cols[None, :], (h * w[:, None]).to(hw_ptr.dtype.element_ty),
             mask=cmask)
    wide: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (EPI_COLS // 4), EPI_COLS // 4], [4, 1], [1, 0])
    pair = gl.convert_layout(gl.reshape(gl.join(dg, du), [dg.shape[0], 2 * EPI_COLS]), wide)
    prow = gl.convert_layout(rows, gl.SliceLayout(1, wide))
    pcol = 2 * col0 + gl.arange(0, 2 * EPI_COLS, layout=gl.SliceLayout(0, wide))
    gl.store(dgu_ptr + prow[:, None] * stride_dgum + pcol[None, :], pair.to(dgu_ptr.dtype.element_ty),
             mask=(pcol < 2 * I)[None, :])
    return dw


@gluon.jit
def dgrad_epilogue(acc_smem, acc_full, acc_free, gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                   dwp_ptr, stride_dwpm, tile_expert_ptr, num_tiles_ptr, num_m, I, GROUP_M: gl.constexpr,
                   SCHED_BM: gl.constexpr, EPI_COLS: gl.constexpr, ACT: gl.constexpr, LIMIT: gl.constexpr,
                   ALPHA: gl.constexpr, DGU_PAIRED: gl.constexpr, TILE_N: gl.constexpr, PREFETCH: gl.constexpr):
    """The epilogue partition (a ``gl.warp_specialize`` default partition of 4 warps): the kernel's
    tiles of TILE_N columns of I in the consumers' order, each through ``_dgrad_epilogue_tile``."""
    _walk_row_tiles(_dgrad_epilogue_tile, (acc_smem, acc_full, acc_free, gu_ptr, stride_gum, ws_ptr, dgu_ptr,
                                           stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm, I, EPI_COLS, ACT,
                                           LIMIT, ALPHA, DGU_PAIRED, TILE_N, PREFETCH), gl.to_tensor(0),
                    tile_expert_ptr, num_tiles_ptr, num_m, gl.cdiv(I, TILE_N), GROUP_M, SCHED_BM)
