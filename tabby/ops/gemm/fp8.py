"""FP8 expert GEMMs over the routed-row buffer, with fp32 promotion per K block of 128.

The layout contract is gemm.py's (routed rows ``[R, K]`` grouped by local expert, each expert's
segment padded to the tile height ``BM``; ``tile_expert``, ``num_tiles``, ``row_src``), and so
are the tile schedule (``grouped_tile``: GROUP_M row tiles per column sweep), the row tiles'
experts (``_row_tile_expert``: an unused tile computes and stores nothing) and the epilogues'
stores and pushes (``_store_rows``, ``_push_rows``): imported from there, not repeated.

Operands are the recipe's (tabby/reference_fp8.py):
- A: E4M3 rows ``aq [R, K]`` with fp32 scales ``a_scale [R, ceil(K/128)]`` (1x128 tiles);
- B: E4M3 weights ``bq [E, N, K]`` (nn.Linear layout: A @ B^T) with fp32 scales
  ``b_scale [E, ceil(N/128), ceil(K/128)]`` (128x128 blocks).

Main loop, for each K block ``kb`` of 128 (the quantization block, so BK = 128):
``part = tl.dot(a_fp8, b_fp8^T)`` into a fresh fp32 tile, then ``acc += part * (a_scale[rows, kb]
* b_scale[e, col block, kb])``. Hopper's FP8 MMA keeps about 14 bits while it accumulates; the
promotion bounds that to 128 products. ``tl.dot_scaled`` is not used: on sm_90 it is emulated.

K and N need not be multiples of 128 (the recipe's partial blocks are its zero-padded blocks:
tabby/reference_fp8.py). A partial last K block is read as zeros past K (masked loads where
``EVEN_K`` is false, TMA's out-of-bounds zero fill in gate/up) and promoted with its own scales;
a partial last N tile reads valid weight rows (indices modulo N, or TMA's zero fill) and its
columns past N are not stored; the weight scales' last block row is that tile's. ``EVEN_K`` is a
constexpr: at K a multiple of 128 the loops compile without masks
(tests/test_fp8_ptx_pinned.py pins that code at the benchmark's shapes).
The forward loops and the down dgrad's promote each block right after its own dot; the weight
gradient (``expert_wgrad_fp8``) writes block kb's promotion after block kb + 1's dot (the same
sum in the same order).
Deterministic like gemm.py: one program per output tile, K blocks in order, no atomics.

Kernels:
1. ``gate_up_swiglu_fp8``: g = A @ Wg[e]^T, u = A @ Wu[e]^T, h = silu(g) * u in fp32; g | u
   stored bf16 (for the backward); h quantized per 1x128 in the epilogue (BN = 128: a tile row
   is one 1x128 tile) into ``hq [R, I]`` E4M3 + ``h_scale [R, ceil(I/128)]``.
   With ``Fp8Gemm.tma`` A and the weights load through TMA (tensor descriptors: 16-byte aligned
   rows, H a multiple of 16), at kernel tiles of ``config.BM`` rows inside the schedule's
   (``SUB_M`` per schedule tile, each taking that tile's expert: ``_fp8_gate_up_mainloop_tma``);
   without, through pointer loads (``_fp8_gate_up_mainloop``).
2. ``rows_gemm_fp8`` / ``down_push_fp8``: A @ B[e]^T stored locally or pushed row by row to
   the origin (bf16).
3. ``down_dgrad_swiglu_fp8``: the down dgrad with the SwiGLU backward in its epilogue.
4. ``expert_wgrad_fp8``: the per-expert weight gradients from operands quantized per 128x1.
Each entry point runs the kernel its ``kernel`` argument names (``Fp8Gemm``: the plan's choice,
``functional/heuristics.py``) and decides nothing: ``core="ws"`` runs fp8_ws.py's
warp-specialized Gluon kernel (sm_90; 1-3: K a multiple of 16, contiguous 16-byte aligned
operands, schedule tiles a multiple of 128 rows; 4: ``padded``), the same sums (bitwise every
output but the down dgrad's row sums dw, within 1e-6) with one warpgroup's promotion under the
other's MMA; ``core="triton"`` the Triton kernels here, at the given tiles. Operands that the
named kernel cannot take raise ``ValueError``; no entry point switches to another kernel.

Under the interpreter Triton 3.6's fp8 ``tl.dot`` works as it is (it widens E4M3 to fp16,
exactly, and multiplies in fp32), so no upcast is needed there (unlike gemm.py's bf16 ``_dot``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...activation import SWIGLU, Activation
from .. import INTERPRET
from . import fp8_ws
from .activation import act_fwd
from ..quantize import BLOCK, E4M3, quantize_tile_rows
from .bf16 import (_TL_DTYPES, GemmConfig, _check_schedule, _push_rows, _row_tile_expert, _store_rows,
                   _swiglu_bwd_split_epilogue, grouped_tile, tma_aligned)

CORE_TRITON = "triton"  # this module's kernels
CORE_WS = "ws"  # fp8_ws.py's warp-specialized kernels (sm_90)


@dataclass(frozen=True)
class Fp8Gemm:
    """Which kernel runs one FP8 GEMM, at which tiles: the plan's choice (``functional/heuristics.py``),
    which the entry points here run as given.

    core:     ``CORE_WS`` (fp8_ws.py's warp-specialized Gluon kernels, sm_90) or ``CORE_TRITON``
    config:   the kernel's tiles. Triton: as launched (BM the schedule's tile height, except
              gate/up's, a divisor of it; BK 128, the quantization block; num_warps, num_stages,
              GROUP_M in kernel row tiles). ws: BM = BK = 128; BN 128, or 256 for the rows kernel
              of 128 x 256 tiles; num_warps 4 (a consumer warpgroup); num_stages the ring's depth
    tma:      Triton gate/up: A and the weights through tensor descriptors (16-byte aligned rows)
    lag:      ws dgrads reading the forward's copies (``launch_bt``): producer steps between a raw
              block's load and its transpose (0: not that kernel)
    programs: the ws kernels' persistent grid (None: one program per SM of the device)
    """
    core: str
    config: GemmConfig
    tma: bool = False
    lag: int = 0
    programs: int | None = None

    def __post_init__(self):
        c = self.config
        if self.core not in (CORE_TRITON, CORE_WS):
            raise ValueError(f"Fp8Gemm.core must be {CORE_TRITON!r} or {CORE_WS!r}, got {self.core!r}")
        if c.BK != BLOCK:
            raise ValueError(f"FP8 GEMMs take K in blocks of {BLOCK} (the quantization block), got BK={c.BK}")
        if self.core == CORE_WS and (c.BM != fp8_ws.BM or c.BN not in (fp8_ws.BN, 2 * fp8_ws.BN) or c.num_warps != 4
                                     or self.tma):
            raise ValueError(f"the warp-specialized kernels run 128-row tiles of 128 or 256 columns at 4 warps "
                             f"(TMA always), got {self}")
        if self.lag and (self.core != CORE_WS or not 0 < self.lag < c.num_stages):
            raise ValueError(f"lag {self.lag} needs the warp-specialized core and must lie in [1, stages "
                             f"{c.num_stages})")


def kernel_name(kernel: Fp8Gemm, gemm: str) -> str:
    """The kernel function that ``gemm``'s entry point ("gate_up", "rows", "down_dgrad", "wgrad")
    launches for ``kernel``."""
    if kernel.core == CORE_WS:
        if kernel.lag:
            return fp8_ws.rows_gemm_fp8_ws_bt_kernel.__name__
        wide = kernel.config.BN == 2 * fp8_ws.BN
        return {"gate_up": fp8_ws.gate_up_swiglu_fp8_ws_kernel, "wgrad": fp8_ws.expert_wgrad_fp8_ws_kernel,
                "rows": fp8_ws.rows_gemm_fp8_ws_wide_kernel if wide else fp8_ws.rows_gemm_fp8_ws_kernel,
                "down_dgrad": fp8_ws.rows_gemm_fp8_ws_kernel}[gemm].__name__
    return {"gate_up": gate_up_swiglu_fp8_kernel, "rows": rows_gemm_fp8_kernel,
            "down_dgrad": down_dgrad_swiglu_fp8_kernel, "wgrad": expert_wgrad_fp8_kernel}[gemm].__name__


def _ws_fits(kernel: Fp8Gemm, what: str, fits: bool, rule: str) -> None:
    if not fits:
        raise ValueError(f"{what}: the plan chose the warp-specialized kernel ({kernel.config}), and these "
                         f"operands do not suit it ({rule}): sm_90, contiguous 16-byte aligned rows")


@triton.jit
def _load_k_block(ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """One K block of 128 columns by pointer loads (``ptrs`` [rows, 128], ``offs_k`` the block's
    column offsets): whole where EVEN_K, else the columns at or past ``k_left`` (K less the block's
    first column) read as zeros, the last block's partial columns (the pointer main loops' load)."""
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_k < k_left)[None, :], other=0.0)
    return x


@triton.jit
def _fp8_mainloop(row0, pid_n, e, a_ptr, stride_am, as_ptr, stride_asm,
                  b_ptr, stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn,
                  N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """fp32 [BM, BN] = A[row0 : row0+BM, :K] @ B[e][cols of tile pid_n, :K]^T with fp32 promotion
    per K block of 128 (see the module docstring). Columns past N read B modulo N (in bounds);
    the caller masks them at the store. Not EVEN_K: the last K block's loads are masked to K
    (zeros past it: A's rows and B's rows end at K), its scales are the partial block's."""
    offs_m = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    offs_n = cols % N
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + row0 * stride_am + (offs_m[:, None] * stride_am + offs_k[None, :])
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + (offs_n[:, None] * stride_bn + offs_k[None, :])
    as_ptrs = as_ptr + (row0 + offs_m) * stride_asm
    # a tile of at most 128 columns lies in one weight block row (BN divides 128): one B scale per
    # K block, and the promotion is one multiply-add per accumulator element
    ONE_B_SCALE: tl.constexpr = 128 % BN == 0
    if ONE_B_SCALE:
        bs_ptrs = bs_ptr + e.to(tl.int64) * stride_bse + ((pid_n * BN) // 128) * stride_bsn
    else:
        bs_ptrs = bs_ptr + e.to(tl.int64) * stride_bse + (offs_n // 128) * stride_bsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    NK: tl.constexpr = (K + 127) // 128
    for kb in range(0, NK):
        a = _load_k_block(a_ptrs, offs_k, K - kb * 128, EVEN_K)
        b = _load_k_block(b_ptrs, offs_k, K - kb * 128, EVEN_K)
        part = tl.dot(a, tl.trans(b))
        sa = tl.load(as_ptrs + kb)
        sb = tl.load(bs_ptrs + kb)
        if ONE_B_SCALE:
            acc += part * (sa * sb)[:, None]
        else:
            acc += part * (sa[:, None] * sb[None, :])
        a_ptrs += 128
        b_ptrs += 128
    return acc


@triton.jit
def _fp8_gate_up_mainloop(row0, pid_n, e, a_ptr, stride_am, as_ptr, stride_asm,
                          wg_ptr, wu_ptr, stride_we, stride_wn, gs_ptr, us_ptr, stride_wse, stride_wsn,
                          H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 (g, u) [BM, 128] of row tile row0 and I-column tile pid_n (128 columns: one weight
    block row, so each K block has one scale per weight). Columns past I read the weights modulo I
    (in bounds; not stored); not EVEN_K: the last K block masked to H, as ``_fp8_mainloop``."""
    offs_m = tl.arange(0, BM)
    offs_n = (pid_n * 128 + tl.arange(0, 128)) % I
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + row0 * stride_am + (offs_m[:, None] * stride_am + offs_k[None, :])
    w_off = e.to(tl.int64) * stride_we + (offs_n[:, None] * stride_wn + offs_k[None, :])
    bg_ptrs = wg_ptr + w_off
    bu_ptrs = wu_ptr + w_off
    as_ptrs = as_ptr + (row0 + offs_m) * stride_asm
    ws_off = e.to(tl.int64) * stride_wse + pid_n * stride_wsn
    acc_g = tl.zeros((BM, 128), dtype=tl.float32)
    acc_u = tl.zeros((BM, 128), dtype=tl.float32)
    NK: tl.constexpr = (H + 127) // 128
    for kb in range(0, NK):
        a = _load_k_block(a_ptrs, offs_k, H - kb * 128, EVEN_K)
        bg = _load_k_block(bg_ptrs, offs_k, H - kb * 128, EVEN_K)
        bu = _load_k_block(bu_ptrs, offs_k, H - kb * 128, EVEN_K)
        pg = tl.dot(a, tl.trans(bg))
        pu = tl.dot(a, tl.trans(bu))
        sa = tl.load(as_ptrs + kb)
        sg = tl.load(gs_ptr + ws_off + kb)
        su = tl.load(us_ptr + ws_off + kb)
        acc_g += pg * (sa * sg)[:, None]
        acc_u += pu * (sa * su)[:, None]
        a_ptrs += 128
        bg_ptrs += 128
        bu_ptrs += 128
    return acc_g, acc_u


@triton.jit
def _fp8_gate_up_mainloop_tma(row0, pid_n, e, a_desc, as_ptr, stride_asm, wg_desc, wu_desc,
                              gs_ptr, us_ptr, stride_wse, stride_wsn, H: tl.constexpr, BM: tl.constexpr):
    """``_fp8_gate_up_mainloop`` with the operands through tensor descriptors (TMA): a_desc is A
    [R, H] in blocks [BM, 128], wg_desc / wu_desc the weights [E, I, H] in blocks [1, 128, 128];
    out-of-bounds K reads as zeros (the pointer loop's other=0.0), and so do weight rows past I
    (bounds are per dimension: the next expert's rows are not read). No per-thread load addresses
    are held (the pointer loop at BM = 128 holds 12 int64 ones, and spills them inside the loop:
    docs/fp8-measurements.md).
    Meant for BM = 64 at 8 warps: each warpgroup holds a 64 x 64 quarter of g and of u, 32 fp32
    registers per tile and thread (at BM = 128 ptxas spills 344 bytes: it issues u's MMA before
    g's promotion, so both 64-register products are live beside the two accumulators). Each
    block is promoted right after its own dot: the same sums in the same order as the pointer
    loop's."""
    offs_m = tl.arange(0, BM)
    as_ptrs = as_ptr + (row0 + offs_m) * stride_asm
    gs_ptrs = gs_ptr + e.to(tl.int64) * stride_wse + pid_n * stride_wsn
    us_ptrs = us_ptr + e.to(tl.int64) * stride_wse + pid_n * stride_wsn
    r0 = row0.to(tl.int32)
    n0 = pid_n * 128
    acc_g = tl.zeros((BM, 128), dtype=tl.float32)
    acc_u = tl.zeros((BM, 128), dtype=tl.float32)
    NK: tl.constexpr = (H + 127) // 128
    for kb in range(NK):
        k0 = kb * 128
        a = a_desc.load([r0, k0])
        bg = wg_desc.load([e, n0, k0]).reshape(128, 128)
        bu = wu_desc.load([e, n0, k0]).reshape(128, 128)
        sa = tl.load(as_ptrs + kb)
        pg = tl.dot(a, tl.trans(bg))
        acc_g += pg * (sa * tl.load(gs_ptrs + kb))[:, None]
        pu = tl.dot(a, tl.trans(bu))
        acc_u += pu * (sa * tl.load(us_ptrs + kb))[:, None]
    return acc_g, acc_u


@triton.jit
def gate_up_swiglu_fp8_tile(pid_m, pid_n, a_ptr, stride_am, as_ptr, stride_asm,
                            wg_ptr, wu_ptr, stride_we, stride_wn, gs_ptr, us_ptr, stride_wse, stride_wsn,
                            hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum,
                            tile_expert_ptr, num_tiles_ptr,
                            H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, EVEN_K: tl.constexpr,
                            SAVE_GU: tl.constexpr, INTERPRET: tl.constexpr, USE_TMA: tl.constexpr = False,
                            a_desc=None, wg_desc=None, wu_desc=None, SUB_M: tl.constexpr = 1,
                            ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0):
    """One (row tile, 128 I-columns): g, u with fp32 promotion; h = act(g, u) (ACT, LIMIT, ALPHA:
    ``activation.act_fwd``'s; the defaults: silu(g) * u) quantized per
    1x128 (hq, h_scale[:, pid_n]: the last tile partial where 128 does not divide I, its columns
    past I zeroed before the amax); g | u bf16 into gu [R, 2I] when SAVE_GU. Unused tiles store nothing.
    USE_TMA: A and the weights through the descriptors a_desc, wg_desc, wu_desc (``_fp8_gate_up_mainloop_tma``).
    SUB_M: the schedule's row tiles (tile_expert's) are SUB_M tiles of BM rows."""
    e = _row_tile_expert(pid_m // SUB_M, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        row0 = pid_m.to(tl.int64) * BM
        if USE_TMA:
            acc_g, acc_u = _fp8_gate_up_mainloop_tma(row0, pid_n, e, a_desc, as_ptr, stride_asm, wg_desc, wu_desc,
                                                     gs_ptr, us_ptr, stride_wse, stride_wsn, H, BM)
        else:
            acc_g, acc_u = _fp8_gate_up_mainloop(row0, pid_n, e, a_ptr, stride_am, as_ptr, stride_asm, wg_ptr,
                                                 wu_ptr, stride_we, stride_wn, gs_ptr, us_ptr, stride_wse,
                                                 stride_wsn, H, I, BM, EVEN_K)
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * 128 + tl.arange(0, 128)
        cmask = (cols < I)[None, :]
        h = act_fwd(acc_g, acc_u, ACT, LIMIT, ALPHA)
        h = tl.where(cmask, h, 0.0)  # columns past I take no part in the tile's scale
        hq, hs = quantize_tile_rows(h, INTERPRET)
        tl.store(hq_ptr + rows[:, None] * stride_hm + cols[None, :], hq, mask=cmask)
        tl.store(hs_ptr + rows * stride_hsm + pid_n, hs)
        if SAVE_GU:
            gptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
            tl.store(gptrs, acc_g.to(gu_ptr.dtype.element_ty), mask=cmask)
            tl.store(gptrs + I, acc_u.to(gu_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def gate_up_swiglu_fp8_kernel(a_ptr, stride_am, as_ptr, stride_asm,
                              wg_ptr, wu_ptr, stride_we, stride_wn, gs_ptr, us_ptr, stride_wse, stride_wsn,
                              hq_ptr, stride_hm, hs_ptr, stride_hsm, gu_ptr, stride_gum,
                              tile_expert_ptr, num_tiles_ptr, num_m,
                              H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP_M: tl.constexpr,
                              EVEN_K: tl.constexpr, SAVE_GU: tl.constexpr, INTERPRET: tl.constexpr,
                              USE_TMA: tl.constexpr, a_desc, wg_desc, wu_desc, SUB_M: tl.constexpr,
                              ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(I, 128), GROUP_M)
    gate_up_swiglu_fp8_tile(pid_m, pid_n, a_ptr, stride_am, as_ptr, stride_asm, wg_ptr, wu_ptr, stride_we,
                            stride_wn, gs_ptr, us_ptr, stride_wse, stride_wsn, hq_ptr, stride_hm, hs_ptr,
                            stride_hsm, gu_ptr, stride_gum, tile_expert_ptr, num_tiles_ptr, H, I, BM,
                            EVEN_K, SAVE_GU, INTERPRET, USE_TMA, a_desc, wg_desc, wu_desc, SUB_M, ACT, LIMIT, ALPHA)


def _check_fp8_rows(name, q, s, R):
    if q.dtype != E4M3 or q.shape[0] != R or q.stride(-1) != 1:
        raise ValueError(f"{name} must be float8_e4m3fn [R={R}, K] with a unit last stride, got "
                         f"{q.dtype} {tuple(q.shape)}")
    if s.dtype != torch.float32 or tuple(s.shape) != (R, triton.cdiv(q.shape[1], BLOCK)):
        raise ValueError(f"{name}'s scales must be fp32 [R, ceil(K/128)] = {(R, triton.cdiv(q.shape[1], BLOCK))}, "
                         f"got {s.dtype} {tuple(s.shape)}")


def _check_fp8_weights(name, q, s):
    E, N, K = q.shape
    want = (E, triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    if q.dtype != E4M3 or q.stride(-1) != 1:
        raise ValueError(f"{name} must be float8_e4m3fn [E, N, K] with a unit last stride, got {q.dtype}")
    # a last dimension of size 1 may have any stride (a transposed [E, nb, 1] stays "contiguous")
    if s.dtype != torch.float32 or tuple(s.shape) != want or (s.stride(-1) != 1 and s.shape[-1] != 1):
        raise ValueError(f"{name}'s scales must be fp32 {want} with a unit last stride, got {s.dtype} "
                         f"{tuple(s.shape)} strides {s.stride()}")


def gate_up_swiglu_fp8(aq, a_scale, wg_q, wg_scale, wu_q, wu_scale, tile_expert, num_tiles, *, kernel: Fp8Gemm,
                       tile_m: int, hq=None, h_scale=None, gu=None, save_gu: bool = True, act: Activation = SWIGLU):
    """Returns (hq [R, I] E4M3, h_scale [R, ceil(I/128)] fp32, gu [R, 2I] bf16 or None): h = act(g, u)
    (SwiGLU by default) quantized per 1x128.

    aq [R, H] E4M3 with a_scale [R, ceil(H/128)]; wg_q, wu_q [E, I, H] E4M3 with scales
    [E, ceil(I/128), ceil(H/128)] (same strides). h's 1x128 tiles are the kernel's column tiles
    (the last one partial where 128 does not divide I). Rows of unused tiles are left untouched.
    ``tile_m``: the schedule's tile height. ``kernel``: the warp-specialized kernel
    (``fp8_ws.gate_up_swiglu_fp8_ws``), or the Triton kernel at ``kernel.config`` (BN 128: one h
    tile a tile row; BM a divisor of tile_m), through tensor descriptors where ``kernel.tma``
    (which needs 16-byte aligned rows: else ``ValueError``), else through pointer loads. All give
    the same results (the same sums in the same order).
    """
    R, H = aq.shape
    E, I, H2 = wg_q.shape
    if H2 != H or wu_q.shape != wg_q.shape or wu_q.stride() != wg_q.stride() or wu_scale.stride() != wg_scale.stride():
        raise ValueError("w_gate and w_up must be [E, I, H] with the same strides, H matching the rows")
    _check_fp8_rows("aq", aq, a_scale, R)
    _check_fp8_weights("wg_q", wg_q, wg_scale)
    _check_fp8_weights("wu_q", wu_q, wu_scale)
    cfg = kernel.config
    if cfg.BN != BLOCK or tile_m % cfg.BM:
        raise ValueError(f"gate_up_swiglu_fp8 needs BN = {BLOCK} and BM dividing the schedule's tile {tile_m}, "
                         f"got {cfg}")
    _check_schedule(tile_expert, num_tiles, R, tile_m)
    if hq is None:
        hq = torch.empty(R, I, dtype=E4M3, device=aq.device)
    if h_scale is None:
        h_scale = torch.empty(R, triton.cdiv(I, BLOCK), dtype=torch.float32, device=aq.device)
    save_gu = save_gu or gu is not None
    if save_gu and gu is None:
        gu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=aq.device)
    if R == 0:  # no rows: nothing to compute (and no tensor descriptor over them)
        return hq, h_scale, (gu if save_gu else None)
    if kernel.core == CORE_WS:
        _ws_fits(kernel, "gate_up_swiglu_fp8", fp8_ws.fits_gate_up(aq, wg_q, wu_q, tile_m), "fp8_ws.fits_gate_up")
        return fp8_ws.gate_up_swiglu_fp8_ws(aq, a_scale, wg_q, wg_scale, wu_q, wu_scale, tile_expert, num_tiles,
                                            hq=hq, h_scale=h_scale, gu=gu, sched_bm=tile_m, save_gu=save_gu,
                                            stages=cfg.num_stages, grid=kernel.programs, GROUP_M=cfg.GROUP_M,
                                            act=act)
    gu_arg = gu if save_gu else h_scale
    ACT, LIMIT, ALPHA = act.constexprs()
    sub = tile_m // cfg.BM
    num_m = R // cfg.BM
    descs = (None, None, None)
    if kernel.tma:
        if not all(tma_aligned(t) for t in (aq, wg_q, wu_q)):
            raise ValueError("gate_up_swiglu_fp8: the plan chose TMA loads (Fp8Gemm.tma), which need 16-byte aligned "
                             "rows of A and the weights (bf16.tma_aligned)")
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (TensorDescriptor.from_tensor(aq, [cfg.BM, BLOCK]),
                 TensorDescriptor.from_tensor(wg_q, [1, BLOCK, BLOCK]),
                 TensorDescriptor.from_tensor(wu_q, [1, BLOCK, BLOCK]))
    gate_up_swiglu_fp8_kernel[(num_m * triton.cdiv(I, BLOCK),)](
        aq, aq.stride(0), a_scale, a_scale.stride(0), wg_q, wu_q, wg_q.stride(0), wg_q.stride(1),
        wg_scale, wu_scale, wg_scale.stride(0), wg_scale.stride(1), hq, hq.stride(0), h_scale, h_scale.stride(0),
        gu_arg, gu_arg.stride(0), tile_expert, num_tiles, num_m, H, I, BM=cfg.BM, GROUP_M=cfg.GROUP_M,
        EVEN_K=(H % BLOCK == 0), SAVE_GU=save_gu, INTERPRET=INTERPRET, USE_TMA=kernel.tma, a_desc=descs[0],
        wg_desc=descs[1], wu_desc=descs[2], SUB_M=sub, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return hq, h_scale, (gu if save_gu else None)


@triton.jit
def rows_gemm_fp8_kernel(a_ptr, stride_am, as_ptr, stride_asm, b_ptr, stride_be, stride_bn,
                         bs_ptr, stride_bse, stride_bsn, c_ptr, stride_cm,
                         row_src_ptr, dst_ptrs_ptr, TK, stride_dm,
                         tile_expert_ptr, num_tiles_ptr, num_m,
                         N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PUSH: tl.constexpr,
                         DST_DTYPE: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(N, BN), GROUP_M)
    e = _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        acc = _fp8_mainloop(pid_m.to(tl.int64) * BM, pid_n, e, a_ptr, stride_am, as_ptr, stride_asm, b_ptr,
                            stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn, N, K, BM, BN, EVEN_K)
        if PUSH:
            _push_rows(acc, pid_m, pid_n, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, N, BM, BN, DST_DTYPE)
        else:
            _store_rows(acc, pid_m, pid_n, c_ptr, stride_cm, N, BM, BN)


def rows_gemm_fp8(aq, a_scale, bq, b_scale, tile_expert, num_tiles, *, kernel: Fp8Gemm, tile_m: int, out=None,
                  out_dtype=torch.bfloat16, row_src=None, dst_ptrs=None, TK=None, dst_stride=None,
                  dst_dtype=torch.bfloat16):
    """Routed-row FP8 GEMM: for each used row tile m (expert e), ``A[m-tile] @ B[e]^T`` with fp32
    promotion per K block. aq [R, K] E4M3 + a_scale [R, ceil(K/128)]; bq [E, N, K] E4M3 + b_scale
    [E, ceil(N/128), ceil(K/128)]. Epilogue as gemm.rows_gemm: pushed (``dst_ptrs``, ``row_src``,
    ``TK``; returns None) or stored into ``out`` [R, N] (``out_dtype``; returned). ``kernel``:
    the warp-specialized kernel (``fp8_ws.launch``: 128 x 256 tiles at BN 256) or the Triton one
    at ``kernel.config`` (BM the schedule's ``tile_m``)."""
    R, K = aq.shape
    E, N, Kb = bq.shape
    if Kb != K:
        raise ValueError(f"A has K={K}, B has {Kb}")
    _check_fp8_rows("aq", aq, a_scale, R)
    _check_fp8_weights("bq", bq, b_scale)
    cfg = kernel.config
    _check_schedule(tile_expert, num_tiles, R, tile_m)
    push = dst_ptrs is not None
    if push:
        assert row_src is not None and TK is not None
        assert dst_ptrs.dtype == torch.int64 and row_src.dtype == torch.int32 and row_src.numel() == R
        c, stride_c = aq, 0
        stride_d = N if dst_stride is None else dst_stride
    else:
        if out is None:
            out = torch.empty(R, N, dtype=out_dtype, device=aq.device)
        assert out.shape == (R, N) and out.stride(-1) == 1
        c, stride_c = out, out.stride(0)
        row_src = dst_ptrs = tile_expert  # unused
        TK, stride_d = 1, 0
    if kernel.core == CORE_WS:
        _ws_fits(kernel, "rows_gemm_fp8", fp8_ws.fits(aq, bq, tile_m), "fp8_ws.fits")
        epi = ((row_src, dst_ptrs, TK, stride_d, dst_ptrs.view(dst_dtype)) if push else (c, stride_c))
        fp8_ws.launch(aq, a_scale, bq, b_scale, tile_expert, num_tiles, tile_m,
                      fp8_ws.EPI_PUSH if push else fp8_ws.EPI_STORE, epi, N, tile_n=cfg.BN, stages=cfg.num_stages,
                      grid=kernel.programs, GROUP_M=cfg.GROUP_M)
        return None if push else out
    if cfg.BM != tile_m:
        raise ValueError(f"rows_gemm_fp8: the Triton kernel's BM must be the schedule's tile {tile_m}, got {cfg}")
    num_m = R // cfg.BM
    rows_gemm_fp8_kernel[(num_m * triton.cdiv(N, cfg.BN),)](
        aq, aq.stride(0), a_scale, a_scale.stride(0), bq, bq.stride(0), bq.stride(1), b_scale, b_scale.stride(0),
        b_scale.stride(1), c, stride_c, row_src, dst_ptrs, TK, stride_d, tile_expert, num_tiles, num_m, N, K,
        BM=cfg.BM, BN=cfg.BN, GROUP_M=cfg.GROUP_M, EVEN_K=(K % BLOCK == 0), PUSH=push,
        DST_DTYPE=_TL_DTYPES[dst_dtype], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return None if push else out


def down_push_fp8(hq, h_scale, wd_q, wd_scale, tile_expert, num_tiles, row_src, dst_ptrs, TK, *, kernel: Fp8Gemm,
                  tile_m: int, dst_stride=None):
    """Down projection in FP8, each row of h[m-tile] @ Wd[e]^T pushed bf16 to its origin
    (``dst_ptrs[row_src[r] // TK]`` row ``row_src[r] % TK``), as gemm.down_push."""
    rows_gemm_fp8(hq, h_scale, wd_q, wd_scale, tile_expert, num_tiles, row_src=row_src, dst_ptrs=dst_ptrs, TK=TK,
                  dst_stride=dst_stride, kernel=kernel, tile_m=tile_m)


# --------------------------------------------------------------------------------------------
# Backward: down dgrad with the SwiGLU backward, per-expert weight gradients
# --------------------------------------------------------------------------------------------

@triton.jit
def down_dgrad_swiglu_fp8_kernel(a_ptr, stride_am, as_ptr, stride_asm, b_ptr, stride_be, stride_bn,
                                 bs_ptr, stride_bse, stride_bsn,
                                 gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                                 dwp_ptr, stride_dwpm, tile_expert_ptr, num_tiles_ptr, num_m,
                                 H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                                 ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0):
    """gemm.down_dgrad_swiglu_tile with the FP8 main loop: dh_raw = dys @ Wd[e] from dys per 1x128
    and Wd^T [E, I, H] (the weight's blocks transposed) per 128x128; the same epilogue (its
    column mask leaves the columns of a partial last I tile past I out of dw, dgu and hw)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(I, BN), GROUP_M)
    e = _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        acc = _fp8_mainloop(pid_m.to(tl.int64) * BM, pid_n, e, a_ptr, stride_am, as_ptr, stride_asm, b_ptr,
                            stride_be, stride_bn, bs_ptr, stride_bse, stride_bsn, I, H, BM, BN, EVEN_K)
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        w = tl.load(ws_ptr + rows)
        dw = _swiglu_bwd_split_epilogue(acc, rows, pid_n * BN, w, gu_ptr, stride_gum, dgu_ptr, stride_dgum,
                                        hw_ptr, stride_hwm, I, BM, BN, ACT, LIMIT, ALPHA)
        tl.store(dwp_ptr + rows * stride_dwpm + pid_n, dw)


def _swiglu_bwd_outputs(gu, ws, nt_n: int, outputs=None, act: Activation = SWIGLU):
    """The down dgrad's outputs for gu [R, 2I] (dgu [R, 2I] bf16, hw [R, I] bf16, dw_part [R, nt_n]
    fp32: a partial sum per column tile; ``outputs``: the three given, else made here) and the
    warp-specialized kernels' activation-backward arguments over them (``act``'s limit and alpha last)."""
    R, I = gu.shape[0], gu.shape[1] // 2
    if outputs is None:
        dgu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=gu.device)
        hw = torch.empty(R, I, dtype=torch.bfloat16, device=gu.device)
        dw_part = torch.empty(R, nt_n, dtype=torch.float32, device=gu.device)
    else:
        dgu, hw, dw_part = outputs
        if (dgu.shape, hw.shape, dw_part.shape) != ((R, 2 * I), (R, I), (R, nt_n)) or not (
                dgu.dtype == hw.dtype == torch.bfloat16 and dw_part.dtype == torch.float32):
            raise ValueError(f"the down dgrad's outputs must be dgu [{R}, {2 * I}], hw [{R}, {I}] bf16 and dw_part "
                             f"[{R}, {nt_n}] fp32; got {[(tuple(t.shape), t.dtype) for t in outputs]}")
    _, limit, alpha = act.constexprs()
    return dgu, hw, dw_part, (gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0), dw_part, dw_part.stride(0),
                              limit, alpha)


def down_dgrad_swiglu_fp8(dys_q, dys_scale, wd_t_q, wd_t_scale, gu, ws, tile_expert, num_tiles, *, kernel: Fp8Gemm,
                          tile_m: int, outputs=None, act: Activation = SWIGLU):
    """gemm.down_dgrad_swiglu_bwd in FP8 (``act``'s backward; SwiGLU's by default): dys [R, H] E4M3
    per 1x128; wd_t [E, I, H] E4M3 (W_down's 128x128 blocks transposed: :func:`transpose_blocks`)
    with its scales. Returns (dgu [R, 2I] bf16,
    hw [R, I] bf16, dw_part [R, ceil(I/BN)] fp32), as the bf16 kernel (``outputs``: those three,
    given; else made here). ``kernel``: the warp-specialized kernel at 128 x 128 (``fp8_ws.launch``)
    or the Triton one (BM ``tile_m``)."""
    R, H = dys_q.shape
    E, I, H2 = wd_t_q.shape
    if H2 != H:
        raise ValueError(f"down_dgrad_swiglu_fp8: W_down^T [E, I, H] must match dys [R, H={H}]; got "
                         f"{tuple(wd_t_q.shape)}")
    _check_fp8_rows("dys_q", dys_q, dys_scale, R)
    _check_fp8_weights("wd_t_q", wd_t_q, wd_t_scale)
    assert gu.shape == (R, 2 * I) and ws.shape == (R,) and ws.dtype == torch.float32
    cfg = kernel.config
    if kernel.lag or (kernel.core == CORE_TRITON and cfg.BM != tile_m):
        raise ValueError(f"down_dgrad_swiglu_fp8: {kernel} is not a kernel of this dgrad (lag 0; Triton: BM the "
                         f"schedule's tile {tile_m})")
    _check_schedule(tile_expert, num_tiles, R, tile_m)
    nt_n = triton.cdiv(I, cfg.BN)
    dgu, hw, dw_part, epi = _swiglu_bwd_outputs(gu, ws, nt_n, outputs, act)
    if kernel.core == CORE_WS:
        _ws_fits(kernel, "down_dgrad_swiglu_fp8", fp8_ws.fits(dys_q, wd_t_q, tile_m), "fp8_ws.fits")
        fp8_ws.launch(dys_q, dys_scale, wd_t_q, wd_t_scale, tile_expert, num_tiles, tile_m, fp8_ws.epi_act_bwd(act),
                      epi, I, tile_n=cfg.BN, stages=cfg.num_stages, grid=kernel.programs, GROUP_M=cfg.GROUP_M)
        return dgu, hw, dw_part
    num_m = R // cfg.BM
    ACT, LIMIT, ALPHA = act.constexprs()
    down_dgrad_swiglu_fp8_kernel[(num_m * nt_n,)](
        dys_q, dys_q.stride(0), dys_scale, dys_scale.stride(0), wd_t_q, wd_t_q.stride(0), wd_t_q.stride(1),
        wd_t_scale, wd_t_scale.stride(0), wd_t_scale.stride(1), gu, gu.stride(0), ws, dgu, dgu.stride(0), hw,
        hw.stride(0), dw_part, dw_part.stride(0), tile_expert, num_tiles, num_m, H, I, BM=cfg.BM, BN=cfg.BN,
        GROUP_M=cfg.GROUP_M, EVEN_K=(H % BLOCK == 0), ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dgu, hw, dw_part


def _check_bt(kernel: Fp8Gemm, what: str, aq, weights, tile_m: int) -> None:
    """The dgrads reading the forward's copies run only on the warp-specialized transposing kernel."""
    if kernel.core != CORE_WS or not kernel.lag or kernel.config.BN != fp8_ws.BN:
        raise ValueError(f"{what}: needs the warp-specialized transposing kernel (core 'ws', BN {fp8_ws.BN}, "
                         f"lag >= 1), got {kernel}")
    _ws_fits(kernel, what, fp8_ws.fits_bt(aq, weights, tile_m), "fp8_ws.fits_bt")


def down_dgrad_swiglu_fp8_t(dys_q, dys_scale, wd_q, wd_scale, gu, ws, tile_expert, num_tiles, *, kernel: Fp8Gemm,
                            tile_m: int, outputs=None, act: Activation = SWIGLU):
    """``down_dgrad_swiglu_fp8`` reading W_down's forward copy wd_q [E, H, I] (128x128 scales
    [E, ceil(H/128), ceil(I/128)]) transposed in the kernel, the same values: no W_down^T in
    memory. ``kernel``: the warp-specialized transposing kernel (``fp8_ws.launch_bt``: core "ws",
    ``lag`` >= 1)."""
    R, H = dys_q.shape
    E, H2, I = wd_q.shape
    if H2 != H:
        raise ValueError(f"down_dgrad_swiglu_fp8_t: dys {tuple(dys_q.shape)} and W_down {tuple(wd_q.shape)} "
                         "differ in H")
    _check_bt(kernel, "down_dgrad_swiglu_fp8_t", dys_q, (wd_q,), tile_m)
    _check_fp8_rows("dys_q", dys_q, dys_scale, R)
    _check_fp8_weights("wd_q", wd_q, wd_scale)
    assert gu.shape == (R, 2 * I) and ws.shape == (R,) and ws.dtype == torch.float32
    _check_schedule(tile_expert, num_tiles, R, tile_m)
    cfg = kernel.config
    dgu, hw, dw_part, epi = _swiglu_bwd_outputs(gu, ws, triton.cdiv(I, fp8_ws.BN), outputs, act)
    fp8_ws.launch_bt(dys_q, dys_scale, (wd_q,), wd_scale.transpose(-2, -1).contiguous(), tile_expert, num_tiles,
                     tile_m, fp8_ws.epi_act_bwd(act), epi, I, stages=cfg.num_stages, lag=kernel.lag,
                     grid=kernel.programs, GROUP_M=cfg.GROUP_M)
    return dgu, hw, dw_part


def gate_up_dgrad_push_fp8_t(dgu_q, dgu_scale, wg_q, wu_q, b_scale, tile_expert, num_tiles, row_src, dst_ptrs, TK,
                             *, kernel: Fp8Gemm, tile_m: int, dst_dtype=torch.bfloat16):
    """The gate/up dgrad, dg @ W_gate + du @ W_up per routed row pushed to its origin (as
    ``rows_gemm_fp8``'s push), reading W_gate's and W_up's forward copies [E, I, H] transposed in
    the kernel: no [W_gate^T | W_up^T] in memory. A = dgu_q [R, 2Ip] (Ip: I rounded up to 128,
    each half's padding columns zeros) with its 1x128 scales; ``b_scale`` [E, ceil(H/128), 2Ip/128]
    the two weights' block scales transposed side by side. ``kernel``: as
    ``down_dgrad_swiglu_fp8_t``'s."""
    R, K = dgu_q.shape
    E, I, H = wg_q.shape
    if wu_q.shape != wg_q.shape or K != 2 * triton.cdiv(I, BLOCK) * BLOCK:
        raise ValueError(f"gate_up_dgrad_push_fp8_t: dgu {tuple(dgu_q.shape)}, W_gate {tuple(wg_q.shape)}, W_up "
                         f"{tuple(wu_q.shape)}: need the same weights and dgu's K = 2 * I rounded up to {BLOCK}")
    _check_bt(kernel, "gate_up_dgrad_push_fp8_t", dgu_q, (wg_q, wu_q), tile_m)
    _check_fp8_rows("dgu_q", dgu_q, dgu_scale, R)
    assert b_scale.shape == (E, triton.cdiv(H, BLOCK), K // BLOCK) and b_scale.dtype == torch.float32
    assert dst_ptrs.dtype == torch.int64 and row_src.dtype == torch.int32 and row_src.numel() == R
    _check_schedule(tile_expert, num_tiles, R, tile_m)
    cfg = kernel.config
    fp8_ws.launch_bt(dgu_q, dgu_scale, (wg_q, wu_q), b_scale.contiguous(), tile_expert, num_tiles, tile_m,
                     fp8_ws.EPI_PUSH, (row_src, dst_ptrs, TK, H, dst_ptrs.view(dst_dtype)), H, stages=cfg.num_stages,
                     lag=kernel.lag, grid=kernel.programs, GROUP_M=cfg.GROUP_M)


@triton.jit
def transpose_bytes_kernel(q_ptr, stride_qe, stride_qn, t_ptr, stride_te, stride_tk, N, K, BT: tl.constexpr):
    """t[e, k, n] = q[e, n, k] over one BT x BT tile (bytes: E4M3 values as uint8)."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BT + tl.arange(0, BT)
    k = tl.program_id(2) * BT + tl.arange(0, BT)
    m = (n < N)[:, None] & (k < K)[None, :]
    v = tl.load(q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn + k[None, :], mask=m)
    tl.store(t_ptr + e * stride_te + k.to(tl.int64)[:, None] * stride_tk + n[None, :], tl.trans(v), mask=tl.trans(m))


def transpose_blocks(q: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None):
    """The quantized weight [E, N, K] (scales [E, ceil(N/128), ceil(K/128)]) transposed: [E, K, N]
    and its scales [E, ceil(K/128), ceil(N/128)], exactly: a 128x128 block's scale serves both
    orientations, partial blocks included (the transpose of a block holds the same elements, so
    the same amax). ``out``: where the values go, an [E, K, N] view with a unit last stride (e.g.
    one half of a wider buffer), returned as the values."""
    E, N, K = q.shape
    if out is None:
        out = torch.empty(E, K, N, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != (E, K, N) or out.stride(-1) != 1 or q.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"transpose_blocks: out must be {q.dtype} [E, K, N] = {(E, K, N)} with a unit last stride")
    if q.numel():
        # 128 x 128 byte tiles at 8 warps: the fastest of the tiles measured (docs/fp8-measurements.md)
        BT = 128
        transpose_bytes_kernel[(E, triton.cdiv(N, BT), triton.cdiv(K, BT))](
            q.view(torch.uint8), q.stride(0), q.stride(1), out.view(torch.uint8), out.stride(0), out.stride(1), N, K,
            BT=BT, num_warps=8)
    return out, s.transpose(-2, -1).contiguous()


@triton.jit
def _wgrad_fp8_scales(kb, as_ptr, stride_asr, bs_ptr, stride_bsr, offs_m, offs_n):
    """The promotion factors of 128-row block kb: the outer product a_scale[kb][m] * b_scale[kb][n]."""
    sa = tl.load(as_ptr + kb * stride_asr + offs_m)
    sb = tl.load(bs_ptr + kb * stride_bsr + offs_n)
    return sa[:, None] * sb[None, :]


@triton.jit
def _wgrad_fp8_partial(acc, kb, start, end, R, a_row, a_off, b_row, b_off, as_ptr, stride_asr, bs_ptr, stride_bsr,
                       offs_m, offs_n):
    """acc + block kb's product, promoted, for a block that the segment [start, end) covers only in
    part: loaded whole within the buffer (rows < R: 16-byte loads when R is a multiple of 16), its
    rows outside the segment zeroed in registers (their products are zeros, as a row mask's)."""
    rows = kb * 128 + tl.arange(0, 128)
    inb = (rows < R)[None, :]
    keep = ((rows >= start) & (rows < end))[None, :]
    a = tl.load(a_row + kb * 128 + a_off, mask=inb, other=0.0)
    b = tl.load(b_row + kb * 128 + b_off, mask=inb, other=0.0)
    a = tl.where(keep, a, tl.zeros_like(a))
    b = tl.where(keep, b, tl.zeros_like(b))
    part = tl.dot(a, tl.trans(b))
    return acc + part * _wgrad_fp8_scales(kb, as_ptr, stride_asr, bs_ptr, stride_bsr, offs_m, offs_n)


@triton.jit
def _wgrad_fp8_full(acc, p, kb, kf0, a_row, a_off, b_row, b_off, as_ptr, stride_asr, bs_ptr, stride_bsr,
                    offs_m, offs_n):
    """One step of the main loop over the blocks inside the segment: issues block kb's MMA (unmasked
    loads: the pipeliner's async copies) and, meanwhile, promotes ``p``, the product of block kb - 1
    (zeros at the first step, kb = kf0: ``acc + 0 * s`` is acc). Returns (acc, block kb's product)."""
    a = tl.load(a_row + kb * 128 + a_off)
    b = tl.load(b_row + kb * 128 + b_off)
    nxt = tl.dot(a, tl.trans(b))
    acc = acc + p * _wgrad_fp8_scales(tl.maximum(kb - 1, kf0), as_ptr, stride_asr, bs_ptr, stride_bsr, offs_m,
                                      offs_n)
    return acc, nxt


@triton.jit
def expert_wgrad_fp8_kernel(at_ptr, stride_at, as_ptr, stride_asr, bt_ptr, stride_bt, bs_ptr, stride_bsr,
                            c_ptr, stride_ce, stride_cm, expert_start_ptr, expert_count_ptr, R,
                            M: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            GROUP_M: tl.constexpr, INTERPRET: tl.constexpr, PADDED: tl.constexpr = False):
    """C[e] tile = A_seg^T @ B_seg over expert e's rows, from the transposed operands (At [M, R],
    Bt [N, R]: both read with the rows, the GEMM's K, contiguous: K-major, as the FP8 wgmma takes
    both operands), one program, 128-row blocks in order, each block's product scaled by the
    operands' 128x1 scales (fp32 promotion per 128 rows). An expert with no rows writes zeros.

    The blocks the segment covers only in part (at most one before and one after the others) are
    loaded apart and masked to its rows in registers; the blocks inside it go through a loop of
    unmasked loads, which the pipeliner turns into num_stages-deep async copies (a row mask along
    the contiguous K has no 16-byte constancy: it would make every load byte-wise and leave the
    loop unpipelined). In that loop the
    promotion of block kb - 1 is written after block kb's dot, so that ptxas issues it while the
    MMA runs (Triton still waits for each dot in its own iteration); the sum is the same, in the
    same order: acc + part_kb * (sa_kb x sb_kb), block after block.

    PADDED (the layer's routed rows): every segment starts at a multiple of 128 and the rows from
    its end to the next multiple of 128 are zeros in both operands (padding rows, quantized as
    zeros). Its last block then goes through the loop unmasked like the others: zero rows add
    exact zeros, the same MMA inputs as the masked load's zeroed registers, so the same bits."""
    num_m: tl.constexpr = (M + BM - 1) // BM
    num_n: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    e = pid // (num_m * num_n)
    pid_m, pid_n = grouped_tile(pid % (num_m * num_n), num_m, num_n, GROUP_M)
    start = tl.load(expert_start_ptr + e)
    end = start + tl.load(expert_count_ptr + e)
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M  # the scales' (past M: modulo M, not stored)
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_k = tl.arange(0, 128)
    # int64 tile bases, int32 offsets within the tile (fewer registers in the loop than int64
    # pointers); a tile's rows past M read row M - 1 (not stored)
    a_row = at_ptr + (pid_m * BM).to(tl.int64) * stride_at
    b_row = bt_ptr + (pid_n * BN).to(tl.int64) * stride_bt
    a_off = (tl.minimum(pid_m * BM + tl.arange(0, BM), M - 1) - pid_m * BM)[:, None] * stride_at + offs_k[None, :]
    b_off = (tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1) - pid_n * BN)[:, None] * stride_bt + offs_k[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PADDED:  # every block the segment touches, unmasked (its tail rows are zeros)
        kf0 = start // 128
        kf1 = (end + 127) // 128
    else:  # the blocks [kf0, kf1) lie inside the segment
        kf0 = (start + 127) // 128
        kf1 = end // 128
        if start % 128 != 0:  # the first block, partly before the segment (or an empty segment's block)
            acc = _wgrad_fp8_partial(acc, start // 128, start, end, R, a_row, a_off, b_row, b_off, as_ptr,
                                     stride_asr, bs_ptr, stride_bsr, offs_m, offs_n)
    p = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot take range() of a runtime scalar: the same steps
        kb = kf0
        while kb < kf1:
            acc, p = _wgrad_fp8_full(acc, p, kb, kf0, a_row, a_off, b_row, b_off, as_ptr, stride_asr, bs_ptr,
                                     stride_bsr, offs_m, offs_n)
            kb += 1
    else:
        for kb in range(kf0, kf1):
            acc, p = _wgrad_fp8_full(acc, p, kb, kf0, a_row, a_off, b_row, b_off, as_ptr, stride_asr, bs_ptr,
                                     stride_bsr, offs_m, offs_n)
    if kf1 > kf0:  # the last full block's promotion
        acc = acc + p * _wgrad_fp8_scales(kf1 - 1, as_ptr, stride_asr, bs_ptr, stride_bsr, offs_m, offs_n)
    if not PADDED:
        if (end % 128 != 0) & (kf1 >= kf0):  # the last block, partly past the segment (not the first one)
            acc = _wgrad_fp8_partial(acc, kf1, start, end, R, a_row, a_off, b_row, b_off, as_ptr, stride_asr,
                                     bs_ptr, stride_bsr, offs_m, offs_n)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    cptrs = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None] * stride_cm + rn[None, :]
    tl.store(cptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def expert_wgrad_fp8(at, a_scale, bt, b_scale, expert_start, expert_count, *, kernel: Fp8Gemm,
                     out_dtype=torch.bfloat16, padded: bool = False):
    """C [E, M, N], C[e] = A[s:s+c]^T @ B[s:s+c] (s = expert_start[e], c = expert_count[e]) from
    operands quantized per 128x1 and stored transposed (``ops.quantize.quantize_cols``): at [M, R]
    E4M3 with a_scale [ceil(R/128), M], bt [N, R] with b_scale [ceil(R/128), N]; any row
    strides (row slices of taller buffers), unit column stride. Deterministic: one program per
    output tile, the expert's rows in order. ``padded``: the operands are the layer's routed rows
    (segments start at multiples of 128, rows between a segment's end and the next multiple of 128
    zeros, R a multiple of 128; the caller's promise, as ``quantize_cols`` with ``row_src`` makes
    them): each segment's last block is loaded unmasked, inside the pipelined loop. ``kernel``:
    the warp-specialized kernel (``fp8_ws.expert_wgrad_fp8_ws``: ``padded`` only, a bf16 or fp16
    result) or the Triton one at ``kernel.config``. The Triton kernel copies operands whose rows
    are not 16-byte multiples at 16-byte aligned addresses into ones that are (zeros past R: the
    same sums), so that its loads stay 16-byte async copies."""
    M, R = at.shape
    if padded and R % BLOCK:
        raise ValueError(f"expert_wgrad_fp8(padded=True) needs R a multiple of {BLOCK}, got {R}")
    N = bt.shape[0]
    E = expert_count.numel()
    nr = triton.cdiv(R, BLOCK)
    for name, q, s, C in (("at", at, a_scale, M), ("bt", bt, b_scale, N)):
        if q.dtype != E4M3 or q.stride(-1) != 1 or q.shape[1] != R:
            raise ValueError(f"{name} must be float8_e4m3fn [C, R={R}] with a unit last stride")
        if s.dtype != torch.float32 or tuple(s.shape) != (nr, C) or s.stride(-1) != 1:
            raise ValueError(f"{name}'s scales must be fp32 [ceil(R/128), C] = {(nr, C)}, got {tuple(s.shape)}")
    cfg = kernel.config
    if kernel.core == CORE_WS:
        if not padded:
            raise ValueError("expert_wgrad_fp8: the warp-specialized kernel computes the layer's padded segments "
                             "only (padded=True)")
        _ws_fits(kernel, "expert_wgrad_fp8", fp8_ws.fits_wgrad(at, bt, out_dtype), "fp8_ws.fits_wgrad, a 16-bit result")
        return fp8_ws.expert_wgrad_fp8_ws(at, a_scale, bt, b_scale, expert_start, expert_count, out_dtype=out_dtype,
                                          stages=cfg.num_stages, grid=kernel.programs, GROUP_M=cfg.GROUP_M)
    R_k = R
    if R % 16 or any(q.stride(0) % 16 or q.data_ptr() % 16 for q in (at, bt)):
        # rows of 16-byte multiples, 16-byte aligned: the main loop's loads become 16-byte async
        # copies (byte-wise, they would spill); the zero padding past R lies in no segment
        R_k = triton.cdiv(R, 16) * 16
        at, bt = (torch.zeros(q.shape[0], R_k, dtype=q.dtype, device=q.device).narrow(1, 0, R).copy_(q)
                  for q in (at, bt))
    if max(cfg.BM * at.stride(0), cfg.BN * bt.stride(0)) >= 2 ** 31:
        raise ValueError("expert_wgrad_fp8: a tile's rows must span less than 2^31 bytes (int32 offsets)")
    out = torch.empty(E, M, N, dtype=out_dtype, device=at.device)
    grid = (E * triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN),)
    expert_wgrad_fp8_kernel[grid](at, at.stride(0), a_scale, a_scale.stride(0), bt, bt.stride(0), b_scale,
                                  b_scale.stride(0), out, out.stride(0), out.stride(1), expert_start, expert_count,
                                  R_k, M, N, BM=cfg.BM, BN=cfg.BN, GROUP_M=cfg.GROUP_M, INTERPRET=INTERPRET,
                                  PADDED=padded, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
