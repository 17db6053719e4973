"""Expert GEMMs over the routed-row buffer: tile functions, thin kernels and launchers.

Routed rows live in a buffer of ``R`` rows (``R`` a multiple of the schedule's tile height
``BM``), grouped by local expert, each expert's segment padded to ``BM``. The schedule gives:

- ``tile_expert`` int32 [R // BM]: local expert of each BM-row tile, -1 for unused tiles;
- ``num_tiles`` int32 [1]: number of used row tiles (a device scalar: never read on the host);
- ``expert_start`` int32 [E + 1]: padded segment starts (multiples of BM);
- ``expert_count`` int32 [E]: real rows of each expert;
- ``row_src`` int32 [R]: ``src * TK + t * k + kk`` of each row's (token, k) (``TK = T * k``),
  -1 for padding rows.

Weights are in ``nn.Linear`` layout: ``w_gate, w_up [E, I, H]``, ``w_down [E, H, I]``.

Roles (1-4: each a ``@triton.jit`` tile function that a persistent megakernel can call with tile
coordinates, a thin kernel mapping ``program_id`` to tiles, and a Python launcher; 5: a persistent
kernel and its launchers, no tile function):

1. ``gate_up_swiglu``: ``h = silu(xs @ Wg[e]^T) * (xs @ Wu[e]^T)`` (optionally saving g, u).
2. ``rows_gemm`` / ``down_push``: ``A[rows] @ B[e]^T`` or ``A @ B[e]`` (optionally two K
   phases with different A and B), stored locally or pushed row by row to their origin
   through a table of destination base addresses.
3. ``down_dgrad_swiglu_bwd``: ``dh_raw = dys @ Wd[e]`` with the SwiGLU backward, the router
   weight and the router-weight-gradient partials in the epilogue.
4. ``gate_up_dgrad_push``: ``dxs = dg @ Wg[e] + du @ Wu[e]`` pushed to the origin.
5. ``expert_wgrad`` / ``expert_wgrad_gate_up``: ``C[e] = A_seg^T @ B_seg`` over each expert's
   whole row range (``expert_start``, ``expert_count``), one program per SM walking its output
   tiles.

Everything is sync-free (grids depend on shapes, and 5's on the SM count, only; a program whose
tile is unused returns) and deterministic (no atomics; every output element is computed by one
program in a fixed K order, whatever the grid). Under ``TRITON_INTERPRET=1`` every ``tl.dot``
goes through ``_dot``, which works around the interpreter's broken bf16 dot by upcasting to fp32.

Notes for callers of the tile functions (the megakernel):
- Model dimensions (H, I, N, K, M) are ``tl.constexpr``: loop trip counts are then known, the
  interpreter can iterate them (it cannot take ``range()`` of a runtime scalar under numpy >= 2.4,
  and turns plain assignments into tensors: constexpr locals are written ``X: tl.constexpr = ...``),
  and the compiler can prove the contiguity it needs to vectorize and pipeline the loads.
- The row-tile height BM of kinds 1-4 must equal the schedule's tile height.
- Push epilogues need 16-byte aligned destination bases and row strides (``_push_rows``).
- Each tile function checks ``tile_expert`` / ``num_tiles`` itself and does nothing for an unused
  tile; ``grouped_tile`` maps a linear id to (m, n) in L2-friendly groups of GROUP_M row tiles.

Every launcher runs the tiles it is given (``config``: the plan's, ``functional/heuristics.py``,
measured choices: docs/performance.md, "GEMM tiles") and decides none. Roles 1-4 take either this
file's tiles (``GemmConfig``) or the plan's ``Bf16Gemm``, whose core may be bf16_ws.py's
warp-specialized kernels for roles 1 and 2 (the same sums, in the same order).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...activation import SWIGLU, Activation
from ...validate import LAYOUT_KN, LAYOUT_KN_PAIRED, LAYOUT_NK, LAYOUTS, gate_up_layout
from .. import INTERPRET
from .activation import ACT_RELU2, act_fwd, act_grads


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch knobs of one GEMM.

    For the routed-row kernels (1-4) ``BM`` is the schedule's tile height and must equal it.
    ``GROUP_M`` row tiles are walked together (grouped ordering) for L2 reuse of B tiles.
    """
    BM: int = 128
    BN: int = 128
    BK: int = 64
    num_warps: int = 8
    num_stages: int = 3
    GROUP_M: int = 8

    def with_(self, **kw) -> "GemmConfig":
        return replace(self, **kw)


CORE_TRITON = "triton"  # this file's kernels
CORE_WS = "ws"  # bf16_ws.py's warp-specialized persistent kernels (Gluon, sm_90)


@dataclass(frozen=True)
class Bf16Gemm:
    """Which kernel runs one routed bf16 GEMM, at which tiles: the plan's choice
    (``functional/heuristics.py``), which the entry points here run as given.

    core:     ``CORE_WS`` (bf16_ws.py: gate/up and down) or ``CORE_TRITON`` (this file's kernel at
              ``config``)
    config:   the tiles. Triton: as launched. ws: BM the schedule's tile height (a multiple of the
              kernels' 128-row tiles), BK 64, BN the tile's columns (256 or 128; gate/up: 128
              columns of h), num_warps 4 (a consumer warpgroup), num_stages the ring's depth
    programs: the ws kernels' persistent grid (None: one program per SM)
    """
    core: str
    config: GemmConfig
    programs: int | None = None

    def __post_init__(self):
        if self.core not in (CORE_TRITON, CORE_WS):
            raise ValueError(f"Bf16Gemm.core must be {CORE_TRITON!r} or {CORE_WS!r}, got {self.core!r}")


def _choice(config) -> tuple:
    """(the ws kernel or None, the Triton tiles or None) of an entry point's ``config``: a
    ``GemmConfig`` (this file's kernel at those tiles) or the plan's ``Bf16Gemm``."""
    if isinstance(config, Bf16Gemm):
        return (config, None) if config.core == CORE_WS else (None, config.config)
    return None, config


def _ws_module():
    from . import bf16_ws  # (bf16_ws imports this file's helpers: imported at first use)

    return bf16_ws


# The layer's standalone GEMMs, the keys of ``Plan.gemm`` (functional/plan.py).
# How the routed weights lie in memory (``validate.weights_layout``), as the kernels' W_LAYOUT.
W_NK = tl.constexpr(0)  # Tabby's: unit stride along H (w_gate, w_up) / I (w_down)
W_KN = tl.constexpr(1)  # transposed: unit stride along I (w_gate, w_up) / H (w_down)
W_KN_PAIRED = tl.constexpr(2)  # transposed, g and u interleaved along I (w_up one element after w_gate)
W_LAYOUT_CODES = {LAYOUT_NK: W_NK.value, LAYOUT_KN: W_KN.value, LAYOUT_KN_PAIRED: W_KN_PAIRED.value}


def paired_gate_up(w_gate: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up_proj [E, H, 2I] (g's column i at 2i, u's at 2i + 1) as it lies, from w_gate
    [E, I, H] of the ``LAYOUT_KN_PAIRED`` layout (w_up starts one element after it)."""
    E, I, H = w_gate.shape
    return w_gate.as_strided((E, H, 2 * I), (w_gate.stride(0), w_gate.stride(2), 1))


KIND_GATE_UP = "gate_up"  # two accumulators (g and u) per tile: BN=128 means 256 columns of MMA
KIND_DOWN = "down"  # rows_gemm, B[e] [N, K] (A @ B^T), local store or push
KIND_DGRAD_SWIGLU = "dgrad_swiglu"  # heavy epilogue
KIND_GATE_UP_DGRAD = "gate_up_dgrad"  # rows_gemm, B[e] [K, N] two-phase, push
KIND_WGRAD_DOWN = "wgrad_down"  # expert_wgrad(dys, hw): dW_down, C[e] [H, I]
KIND_WGRAD_GATE_UP = "wgrad_gate_up"  # expert_wgrad_gate_up(dgu, xs): dW_gate | dW_up, C[e] [I, H]


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b with fp32 accumulation (the interpreter's bf16 dot is broken: upcast there)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a linear tile id to (pid_m, pid_n), walking GROUP_M row tiles per column sweep."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr):
    """Local expert of row tile pid_m, or -1 when the tile is unused (past num_tiles or marked -1)."""
    nt = tl.load(num_tiles_ptr)
    e = tl.load(tile_expert_ptr + pid_m)
    return tl.where(pid_m < nt, e, -1)


@triton.jit
def _rows_mainloop(pid_m, pid_n, e,
                   a_ptr, a2_ptr, stride_am,
                   b_ptr, b2_ptr, stride_be, stride_be2, stride_bo,
                   N: tl.constexpr, K: tl.constexpr, K2: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   B_NK: tl.constexpr, TWO_PHASE: tl.constexpr, EVEN_K: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """fp32 [BM, BN] = A[rows of tile pid_m, :K] @ op(B[e])[:K, cols of tile pid_n] (+ phase 2).

    A: row stride ``stride_am``, unit column stride. B[e] at ``b_ptr + e * stride_be``:
    B2[e] at ``b2_ptr + e * stride_be2`` (same row stride and layout as B).
    ``B_NK``: B[e] is [N, K] (row stride ``stride_bo``, unit K stride), result A @ B[e]^T;
    otherwise B[e] is [K, N] (row stride ``stride_bo``, unit N stride), result A @ B[e].
    ``TWO_PHASE``: after K columns of (a_ptr, b_ptr) come K2 of (a2_ptr, b2_ptr), same strides
    and layouts, in one pipelined loop (each phase masked on its own K).
    ``EVEN_K``: K (and K2) are multiples of BK: no K masks.
    Columns of B past N are read modulo N (in bounds); the caller masks them at the store.
    """
    row0 = pid_m.to(tl.int64) * BM
    offs_m = tl.arange(0, BM)
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_k = tl.arange(0, BK)
    # Per-tile int32 offsets from 64-bit tile bases.
    a_off = offs_m[:, None] * stride_am + offs_k[None, :]
    if B_NK:
        b_off = offs_n[:, None] * stride_bo + offs_k[None, :]  # [BN, BK]
    else:
        b_off = offs_k[:, None] * stride_bo + offs_n[None, :]  # [BK, BN]
    a1 = a_ptr + row0 * stride_am
    b1 = b_ptr + e.to(tl.int64) * stride_be
    if TWO_PHASE:
        a2 = a2_ptr + row0 * stride_am
        b2 = b2_ptr + e.to(tl.int64) * stride_be2
    else:
        a2 = a1
        b2 = b1
    # Annotated constexpr assignments: the interpreter turns plain assignments into tensors,
    # and range() of a tensor fails there.
    NK1: tl.constexpr = (K + BK - 1) // BK
    NK: tl.constexpr = NK1 + ((K2 + BK - 1) // BK if TWO_PHASE else 0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, NK):
        if TWO_PHASE:
            ph1 = kt < NK1
            k0 = tl.where(ph1, kt, kt - NK1) * BK
            kcur = tl.where(ph1, K, K2)
            a_base = tl.where(ph1, a1, a2)
            b_base = tl.where(ph1, b1, b2)
        else:
            k0 = kt * BK
            kcur = K
            a_base = a1
            b_base = b1
        if B_NK:
            kstep_b = k0
        else:
            kstep_b = k0 * stride_bo  # < K * N: fits int32
        if EVEN_K:
            a = tl.load(a_base + k0 + a_off)
            b = tl.load(b_base + kstep_b + b_off)
        else:
            kmask = offs_k < kcur - k0
            a = tl.load(a_base + k0 + a_off, mask=kmask[None, :], other=0.0)
            if B_NK:
                b = tl.load(b_base + kstep_b + b_off, mask=kmask[None, :], other=0.0)
            else:
                b = tl.load(b_base + kstep_b + b_off, mask=kmask[:, None], other=0.0)
        if B_NK:
            acc = _dot(a, tl.trans(b), acc, INTERPRET)
        else:
            acc = _dot(a, b, acc, INTERPRET)
    return acc


@triton.jit
def _rows_mainloop_tma(pid_m, pid_n, e, a_desc, b_desc, K: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       B_NK: tl.constexpr, INTERPRET: tl.constexpr, a_row_shift=0):
    """As ``_rows_mainloop`` (one phase) with tensor-descriptor (TMA) loads.

    a_desc: A [R, K], block [BM, BK]; the tile's rows start at A row ``pid_m * BM + a_row_shift``
    (the megakernel's ring slot). b_desc: B [E, N, K] with block [1, BN, BK] (``B_NK``) or
    B [E, K, N] with block [1, BK, BN]. Out-of-bounds rows, K and N read as zeros.
    """
    row0 = pid_m * BM + a_row_shift
    n0 = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    NK: tl.constexpr = (K + BK - 1) // BK
    for kt in range(0, NK):
        k0 = kt * BK
        a = a_desc.load([row0, k0])
        if B_NK:
            b = b_desc.load([e, n0, k0]).reshape(BN, BK)
            acc = _dot(a, tl.trans(b), acc, INTERPRET)
        else:
            b = b_desc.load([e, k0, n0]).reshape(BK, BN)
            acc = _dot(a, b, acc, INTERPRET)
    return acc


@triton.jit
def _store_rows(acc, pid_m, pid_n, c_ptr, stride_cm, N, BM: tl.constexpr, BN: tl.constexpr):
    """Store the tile into local C [R, N] (row stride stride_cm), cast to C's element type."""
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(cols < N)[None, :])


@triton.jit
def _push_rows_prep(pid_m, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, BM: tl.constexpr, DST_DTYPE: tl.constexpr):
    """Where the rows of tile pid_m go (see ``_push_rows``): (ref, row_off [BM], valid [BM]), row r's
    destination row starting at ``ref + row_off[r]``; a tile of several column tiles computes it once."""
    rows = pid_m * BM + tl.arange(0, BM)
    rs = tl.load(row_src_ptr + rows)
    valid = rs >= 0
    rs = tl.where(valid, rs, 0)
    src = rs // TK
    drow = (rs % TK).to(tl.int64)
    base = tl.load(dst_ptrs_ptr + src, mask=valid, other=0)
    # Address each row as an element offset from a pointer argument (the table itself, cast):
    # a pointer made by an int-to-pointer cast loses its alignment in the compiler's analysis and
    # the stores fall back to one element at a time; this way rows are stored with 16-byte vectors.
    # Needs 16-byte aligned destination bases (allocations are) and row strides.
    ESIZE: tl.constexpr = DST_DTYPE.primitive_bitwidth // 8
    ref = dst_ptrs_ptr.to(tl.pointer_type(DST_DTYPE), bitcast=True)
    ref_addr = dst_ptrs_ptr.to(tl.int64, bitcast=True)
    row_off = tl.multiple_of((base - ref_addr) // ESIZE + drow * stride_dm, 16 // ESIZE)
    return ref, row_off, valid


@triton.jit
def _push_rows_store(acc, ref, row_off, valid, pid_n, N, BN: tl.constexpr, DST_DTYPE: tl.constexpr):
    """Store column tile pid_n of a tile at the rows that ``_push_rows_prep`` found."""
    cols = pid_n * BN + tl.arange(0, BN)
    ptrs = ref + row_off[:, None] + cols[None, :]
    tl.store(ptrs, acc.to(DST_DTYPE), mask=valid[:, None] & (cols < N)[None, :])


@triton.jit
def _push_rows(acc, pid_m, pid_n, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, N,
               BM: tl.constexpr, BN: tl.constexpr, DST_DTYPE: tl.constexpr):
    """Store each row r of the tile (row_src[r] >= 0) at its origin.

    Destination of row r: ``dst_ptrs[row_src[r] // TK]`` (a base address, int64) as a
    ``DST_DTYPE`` pointer, row ``row_src[r] % TK`` (row stride ``stride_dm``), columns as here.
    """
    ref, row_off, valid = _push_rows_prep(pid_m, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, BM, DST_DTYPE)
    _push_rows_store(acc, ref, row_off, valid, pid_n, N, BN, DST_DTYPE)


@triton.jit
def push_col_tiles_tma(blk, c0, e, a_desc, b_desc, row_src_ptr, dst_ptrs_ptr, TK, stride_dm,
                       N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       NC: tl.constexpr, DST_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, a_row_shift=0):
    """Column tiles c0 .. c0+NC-1 of row block ``blk`` (rows blk*BM ..) of A @ B[e]^T, each pushed to its
    rows' origins (``_push_rows``), in ONE K loop of NC * cdiv(K, BK) steps through TMA loads.

    One loop, not NC tiles one after another: Triton's software pipeline issues the loads of column
    c+1's first K steps before column c's epilogue, so the pipeline fills once per NC columns (the
    megakernel's down tickets of several column tiles). a_desc: A [R, K], block [BM, BK], rows from
    ``blk * BM + a_row_shift``; b_desc: B [E, N, K], block [1, BN, BK].
    """
    row0 = blk * BM + a_row_shift
    NK: tl.constexpr = (K + BK - 1) // BK
    ref, row_off, valid = _push_rows_prep(blk, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, BM, DST_DTYPE)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, NC * NK):
        c = kk // NK
        kt = kk - c * NK
        a = a_desc.load([row0, kt * BK])
        b = b_desc.load([e, (c0 + c) * BN, kt * BK]).reshape(BN, BK)
        acc = _dot(a, tl.trans(b), acc, INTERPRET)
        if kt == NK - 1:
            _push_rows_store(acc, ref, row_off, valid, c0 + c, N, BN, DST_DTYPE)
            acc = tl.zeros((BM, BN), dtype=tl.float32)


# --------------------------------------------------------------------------------------------
# 1. gate/up GEMM with the SwiGLU in its epilogue
# --------------------------------------------------------------------------------------------

@triton.jit
def gate_up_swiglu_tile(pid_m, pid_n,
                        xs_ptr, stride_xm,
                        wg_ptr, wu_ptr, stride_we, stride_wn,
                        h_ptr, stride_hm, gu_ptr, stride_gum,
                        tile_expert_ptr, num_tiles_ptr,
                        H: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        EVEN_K: tl.constexpr, SAVE_GU: tl.constexpr, INTERPRET: tl.constexpr,
                        n_rows=0, MASK_ROWS: tl.constexpr = False,
                        USE_TMA: tl.constexpr = False, xs_desc=None, wg_desc=None, wu_desc=None, a_row_shift=0,
                        TILE_M: tl.constexpr = 0, A_ROWS: tl.constexpr = False, a_rows=None,
                        ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                        HAS_BIAS: tl.constexpr = False, bg_ptr=None, bu_ptr=None, stride_bias_e=0,
                        W_LAYOUT: tl.constexpr = 0, BIAS_STRIDE_N: tl.constexpr = 1):
    """One (row tile, I-column tile): g = xs @ Wg[e]^T, u = xs @ Wu[e]^T, h = act(g, u) (ACT, LIMIT,
    ALPHA: ``activation.act_fwd``'s; the defaults: silu(g) * u).

    xs [R, H] (row stride stride_xm); Wg, Wu [E, I, H] (strides stride_we, stride_wn, 1);
    h [R, I] bf16; gu [R, 2I] bf16 (g in [0, I), u in [I, 2I)) when SAVE_GU.
    Unused tiles store nothing.
    MASK_ROWS (the megakernel's shared expert over x [n_rows, H], n_rows not a multiple of BM):
    rows >= n_rows of xs are not read (taken as zeros); h / gu rows are still all stored.
    USE_TMA: the operands come through tensor descriptors instead (``_gate_up_mainloop_tma``):
    xs_desc over xs [R', H] (the tile's rows start at row ``pid_m * BM + a_row_shift``; rows past
    R' read as zeros, which is MASK_ROWS for free), wg_desc / wu_desc over Wg / Wu [E, I, H].
    TILE_M (a half tile; 0: BM): the schedule's tiles are TILE_M rows high and this one computes
    only the first BM rows of tile pid_m (the megakernel's tiles whose real rows fit in half).
    A_ROWS (with USE_TMA): the tile's A rows are gathered through ``a_rows`` [BM] (a pointer per
    row, to its first element; 16-byte aligned) instead of xs_desc; the weights still come through
    wg_desc / wu_desc (``_gate_up_mainloop_rows_tma``; the megakernel's local rows read from x).
    HAS_BIAS: g and u get the expert's biases bg[e], bu[e] ([E, I], row stride stride_bias_e, column
    stride BIAS_STRIDE_N) before the activation (and as kept in gu).
    W_LAYOUT (the pointer loads only): how Wg, Wu lie in memory, ``W_NK`` above, or transposed
    (``W_KN``: unit stride along I, ``stride_wn`` between rows of H; ``W_KN_PAIRED``: also g and u
    interleaved, Wg[e][i, h] at 2i + h * stride_wn and Wu one element after; see ``_gate_up_mainloop``).
    """
    e = _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        blk = pid_m  # first row = blk * BM
        if TILE_M > 0:
            blk = pid_m * (TILE_M // BM)
        row0 = blk.to(tl.int64) * BM
        if A_ROWS:
            acc_g, acc_u = _gate_up_mainloop_rows_tma(a_rows, pid_n * BN, e, wg_desc, wu_desc, H, BM, BN, BK,
                                                      INTERPRET)
        elif USE_TMA:
            acc_g, acc_u = _gate_up_mainloop_tma(blk * BM + a_row_shift, pid_n * BN, e, xs_desc, wg_desc, wu_desc,
                                                 H, BM, BN, BK, INTERPRET)
        else:
            acc_g, acc_u = _gate_up_mainloop(row0, pid_n, e, xs_ptr, stride_xm, wg_ptr, wu_ptr, stride_we, stride_wn,
                                             H, I, BM, BN, BK, EVEN_K, INTERPRET, n_rows, MASK_ROWS, W_LAYOUT,
                                             ACT != ACT_RELU2)
        offs_m = tl.arange(0, BM)
        rows = row0 + offs_m
        cols = pid_n * BN + tl.arange(0, BN)
        cmask = (cols < I)[None, :]
        if HAS_BIAS:
            boff = e.to(tl.int64) * stride_bias_e + cols * BIAS_STRIDE_N
            acc_g += tl.load(bg_ptr + boff, mask=cols < I, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bu_ptr + boff, mask=cols < I, other=0.0).to(tl.float32)[None, :]
        h = act_fwd(acc_g, acc_u, ACT, LIMIT, ALPHA)
        tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=cmask)
        if SAVE_GU:
            gptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
            if ACT != ACT_RELU2:  # (ungated: g's columns left unwritten, never read)
                tl.store(gptrs, acc_g.to(gu_ptr.dtype.element_ty), mask=cmask)
            tl.store(gptrs + I, acc_u.to(gu_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _gate_up_block_tma(a, e, n0, k0, wg_desc, wu_desc, acc_g, acc_u, BN: tl.constexpr, BK: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """One K block of gate/up against weights read through TMA: (acc_g, acc_u) plus A's block ``a``
    [BM, BK] times (Wg[e], Wu[e])[n0 : n0 + BN, k0 : k0 + BK]^T (the K step of both TMA main loops)."""
    bg = wg_desc.load([e, n0, k0]).reshape(BN, BK)
    bu = wu_desc.load([e, n0, k0]).reshape(BN, BK)
    acc_g = _dot(a, tl.trans(bg), acc_g, INTERPRET)
    acc_u = _dot(a, tl.trans(bu), acc_u, INTERPRET)
    return acc_g, acc_u


@triton.jit
def _gate_up_mainloop_tma(a_row0, n0, e, xs_desc, wg_desc, wu_desc, H: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ([BM, BN], [BM, BN]) = xs[a_row0 :, :] @ (Wg[e], Wu[e])[n0 :, :]^T through TMA loads.

    No pointer tensors: the loop holds only the two accumulators, so the tile fits in registers
    inside a persistent kernel (with pointer loads it spills at BN=128).
    """
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    NK: tl.constexpr = (H + BK - 1) // BK
    for kt in range(0, NK):
        k0 = kt * BK
        a = xs_desc.load([a_row0, k0])
        acc_g, acc_u = _gate_up_block_tma(a, e, n0, k0, wg_desc, wu_desc, acc_g, acc_u, BN, BK, INTERPRET)
    return acc_g, acc_u


@triton.jit
def _gate_up_mainloop_rows_tma(a_rows, n0, e, wg_desc, wu_desc, H: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ([BM, BN], [BM, BN]) = A @ (Wg[e], Wu[e])[n0 :, :]^T with A's rows gathered through the
    pointers ``a_rows`` [BM] (Hopper's TMA cannot gather rows) and the weights through TMA.
    Columns past H read as zeros."""
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    offs_k = tl.arange(0, BK)
    NK: tl.constexpr = (H + BK - 1) // BK
    for kt in range(0, NK):
        k0 = kt * BK
        if H % BK == 0:
            a = tl.load(a_rows[:, None] + (k0 + offs_k)[None, :])
        else:
            a = tl.load(a_rows[:, None] + (k0 + offs_k)[None, :], mask=(k0 + offs_k < H)[None, :], other=0.0)
        acc_g, acc_u = _gate_up_block_tma(a, e, n0, k0, wg_desc, wu_desc, acc_g, acc_u, BN, BK, INTERPRET)
    return acc_g, acc_u


@triton.jit
def _gate_up_mainloop(row0, pid_n, e, xs_ptr, stride_xm, wg_ptr, wu_ptr, stride_we, stride_wn,
                      H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, n_rows, MASK_ROWS: tl.constexpr,
                      W_LAYOUT: tl.constexpr = 0, GATED: tl.constexpr = True):
    """The pointer-load K loop of ``gate_up_swiglu_tile``: fp32 (acc_g, acc_u) [BM, BN] each.
    W_LAYOUT ``W_NK``: Wg[e], Wu[e] [I, H] with unit H stride (rows stride_wn apart); ``W_KN``: unit I
    stride (rows of H stride_wn apart); ``W_KN_PAIRED``: ``_gate_up_mainloop_paired``. Without GATED
    (an ungated activation) Wg is not read and acc_g stays zero."""
    if W_LAYOUT == W_KN_PAIRED:
        return _gate_up_mainloop_paired(row0, pid_n, e, xs_ptr, stride_xm, wg_ptr, stride_we, stride_wn, H, I, BM,
                                        BN, BK, EVEN_K, INTERPRET)
    offs_m = tl.arange(0, BM)
    offs_n = (pid_n * BN + tl.arange(0, BN)) % I
    offs_k = tl.arange(0, BK)
    a_ptrs = xs_ptr + row0 * stride_xm + (offs_m[:, None] * stride_xm + offs_k[None, :])
    w_off = e.to(tl.int64) * stride_we
    if W_LAYOUT == W_KN:
        b_off = offs_k[:, None] * stride_wn + offs_n[None, :]  # [BK, BN]
        b_step = BK * stride_wn
    else:
        b_off = offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        b_step = BK
    bg_ptrs = wg_ptr + w_off + b_off
    bu_ptrs = wu_ptr + w_off + b_off
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, (H + BK - 1) // BK):
        if EVEN_K:
            if MASK_ROWS:
                a = tl.load(a_ptrs, mask=(row0 + offs_m < n_rows)[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs)
            if GATED:
                bg = tl.load(bg_ptrs)
            bu = tl.load(bu_ptrs)
        else:
            kmask = offs_k < H - kt * BK
            if MASK_ROWS:
                a = tl.load(a_ptrs, mask=(row0 + offs_m < n_rows)[:, None] & kmask[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            if W_LAYOUT == W_KN:
                if GATED:
                    bg = tl.load(bg_ptrs, mask=kmask[:, None], other=0.0)
                bu = tl.load(bu_ptrs, mask=kmask[:, None], other=0.0)
            else:
                if GATED:
                    bg = tl.load(bg_ptrs, mask=kmask[None, :], other=0.0)
                bu = tl.load(bu_ptrs, mask=kmask[None, :], other=0.0)
        if W_LAYOUT == W_KN:
            if GATED:
                acc_g = _dot(a, bg, acc_g, INTERPRET)
            acc_u = _dot(a, bu, acc_u, INTERPRET)
        else:
            if GATED:
                acc_g = _dot(a, tl.trans(bg), acc_g, INTERPRET)
            acc_u = _dot(a, tl.trans(bu), acc_u, INTERPRET)
        a_ptrs += BK
        bg_ptrs += b_step
        bu_ptrs += b_step
    return acc_g, acc_u


@triton.jit
def _gate_up_mainloop_paired(row0, pid_n, e, xs_ptr, stride_xm, w_ptr, stride_we, stride_wk,
                             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """``_gate_up_mainloop`` on transposed weights whose g and u columns interleave (gpt-oss's
    gate_up_proj [E, H, 2I]: row h holds g_0 u_0 g_1 u_1 ..., rows stride_wk apart): each K step
    loads the tile's 2 BN contiguous columns [BK, 2BN] and runs one [BM, 2BN] product; the
    accumulator's even columns are g, its odd ones u."""
    offs_m = tl.arange(0, BM)
    offs_c = (pid_n * 2 * BN + tl.arange(0, 2 * BN)) % (2 * I)
    offs_k = tl.arange(0, BK)
    a_ptrs = xs_ptr + row0 * stride_xm + (offs_m[:, None] * stride_xm + offs_k[None, :])
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + (offs_k[:, None] * stride_wk + offs_c[None, :])  # [BK, 2BN]
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for kt in range(0, (H + BK - 1) // BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = offs_k < H - kt * BK
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = _dot(a, b, acc, INTERPRET)
        a_ptrs += BK
        b_ptrs += BK * stride_wk
    acc_g, acc_u = tl.split(tl.reshape(acc, (BM, BN, 2)))
    return acc_g, acc_u


@triton.jit
def gate_up_swiglu_kernel(xs_ptr, stride_xm, wg_ptr, wu_ptr, stride_we, stride_wn,
                          h_ptr, stride_hm, gu_ptr, stride_gum,
                          tile_expert_ptr, num_tiles_ptr, num_m, H: tl.constexpr, I: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          EVEN_K: tl.constexpr, SAVE_GU: tl.constexpr, INTERPRET: tl.constexpr,
                          ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                          HAS_BIAS: tl.constexpr = False, bg_ptr=None, bu_ptr=None, stride_bias_e=0,
                          W_LAYOUT: tl.constexpr = 0, BIAS_STRIDE_N: tl.constexpr = 1):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(I, BN), GROUP_M)
    gate_up_swiglu_tile(pid_m=pid_m, pid_n=pid_n, xs_ptr=xs_ptr, stride_xm=stride_xm, wg_ptr=wg_ptr, wu_ptr=wu_ptr,
                        stride_we=stride_we, stride_wn=stride_wn, h_ptr=h_ptr, stride_hm=stride_hm, gu_ptr=gu_ptr,
                        stride_gum=stride_gum, tile_expert_ptr=tile_expert_ptr, num_tiles_ptr=num_tiles_ptr, H=H, I=I,
                        BM=BM, BN=BN, BK=BK, EVEN_K=EVEN_K, SAVE_GU=SAVE_GU, INTERPRET=INTERPRET,
                        ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, HAS_BIAS=HAS_BIAS, bg_ptr=bg_ptr, bu_ptr=bu_ptr,
                        stride_bias_e=stride_bias_e, W_LAYOUT=W_LAYOUT, BIAS_STRIDE_N=BIAS_STRIDE_N)


def _check_rows(name, t, R, BM):
    if t.shape[0] != R:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {R}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last stride")


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor (TMA) can address ``t``: a 16-byte aligned base, a unit last
    stride and 16-byte multiples for the other strides."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all((st * es) % 16 == 0 for st in t.stride()[:-1])


def _check_schedule(tile_expert, num_tiles, R, BM):
    if R % BM:
        raise ValueError(f"rows R={R} must be a multiple of BM={BM}")
    if tile_expert.numel() != R // BM:
        raise ValueError(f"tile_expert has {tile_expert.numel()} entries, expected R // BM = {R // BM}")
    if tile_expert.dtype != torch.int32 or num_tiles.dtype != torch.int32:
        raise ValueError("tile_expert and num_tiles must be int32")


def gate_up_swiglu(xs: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   tile_expert: torch.Tensor, num_tiles: torch.Tensor, *,
                   h: torch.Tensor | None = None, gu: torch.Tensor | None = None, save_gu: bool = False,
                   config: GemmConfig | Bf16Gemm, act: Activation = SWIGLU, biases=None):
    """h [R, I] = act(xs @ Wg[e]^T, xs @ Wu[e]^T) per row tile (SwiGLU: silu(g) * u); returns h, or
    (h, gu) with save_gu. ``biases``: None or (b_gate, b_up) [E, I] (unit column stride, equal
    strides), added to g and u before the activation.

    xs [R, H] bf16; w_gate, w_up [E, I, H] bf16 (same strides) in a layout of ``validate.LAYOUTS``
    (``validate.gate_up_layout``; on the ws core the transposed ones need H a multiple of 64);
    gu [R, 2I] bf16 (g then u) is written when ``save_gu`` (or when ``gu`` is given).
    Tiles of unused row tiles are left untouched in h / gu.
    """
    R, H = xs.shape
    E, I, H2 = w_gate.shape
    assert H2 == H and w_up.shape == w_gate.shape and w_up.stride() == w_gate.stride()
    ws, cfg = _choice(config)
    bm = (ws.config if ws else cfg).BM
    _check_schedule(tile_expert, num_tiles, R, bm)
    _check_rows("xs", xs, R, bm)
    layout = gate_up_layout(w_gate, w_up)
    if layout is None:
        raise ValueError(f"w_gate, w_up in none of the layouts {LAYOUTS} (validate.gate_up_layout): strides "
                         f"{w_gate.stride()}, {w_up.stride()}")
    if h is None:
        h = torch.empty(R, I, dtype=xs.dtype, device=xs.device)
    save_gu = save_gu or gu is not None
    if save_gu and gu is None:
        gu = torch.empty(R, 2 * I, dtype=xs.dtype, device=xs.device)
    if ws:
        _ws_module().gate_up_swiglu_ws(xs, w_gate, w_up, tile_expert, num_tiles, h, gu if save_gu else None,
                                       sched_bm=bm, stages=ws.config.num_stages, grid=ws.programs,
                                       GROUP_M=ws.config.GROUP_M, act=act, layout=layout, biases=biases)
        return (h, gu) if save_gu else h
    gu_arg = gu if save_gu else h
    num_m = R // cfg.BM
    grid = (num_m * triton.cdiv(I, cfg.BN),)
    ACT, LIMIT, ALPHA = act.constexprs()
    bg, bu = biases if biases is not None else (None, None)
    if biases is not None:
        assert bg.shape == bu.shape == (E, I) and bg.stride() == bu.stride() and bg.stride(-1) in (1, 2)
    row_stride = w_gate.stride(1) if layout == LAYOUT_NK else w_gate.stride(2)
    gate_up_swiglu_kernel[grid](
        xs, xs.stride(0), w_gate, w_up, w_gate.stride(0), row_stride,
        h, h.stride(0), gu_arg, gu_arg.stride(0), tile_expert, num_tiles, num_m, H, I,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, EVEN_K=(H % cfg.BK == 0),
        SAVE_GU=save_gu, INTERPRET=INTERPRET, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, HAS_BIAS=biases is not None,
        bg_ptr=bg, bu_ptr=bu, stride_bias_e=bg.stride(0) if biases is not None else 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_layout_args(layout, bg))
    return (h, gu) if save_gu else h


def _layout_args(layout: str, bias) -> dict:
    """The gate/up kernel's layout constexprs, left out (their defaults) for Tabby's layout without a
    strided bias, so that the plain kernel's code stays what it was."""
    kw = {}
    if layout != LAYOUT_NK:
        kw["W_LAYOUT"] = W_LAYOUT_CODES[layout]
    if bias is not None and bias.stride(-1) != 1:
        kw["BIAS_STRIDE_N"] = bias.stride(-1)
    return kw


# --------------------------------------------------------------------------------------------
# 2 / 4. Generic routed-row GEMM: local store or push to origin
# --------------------------------------------------------------------------------------------

@triton.jit
def rows_gemm_tile(pid_m, pid_n,
                   a_desc, b_desc,
                   a_ptr, a2_ptr, stride_am,
                   b_ptr, b2_ptr, stride_be, stride_be2, stride_bo,
                   c_ptr, stride_cm,
                   row_src_ptr, dst_ptrs_ptr, TK, stride_dm,
                   tile_expert_ptr, num_tiles_ptr,
                   N: tl.constexpr, K: tl.constexpr, K2: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   B_NK: tl.constexpr, TWO_PHASE: tl.constexpr, EVEN_K: tl.constexpr,
                   PUSH: tl.constexpr, DST_DTYPE: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
                   a_row_shift=0, TILE_M: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False, bias_ptr=None,
                   stride_bias_e=0):
    """One (row tile, N-column tile) of A @ op(B[e]) (see ``_rows_mainloop``); HAS_BIAS: + bias[e]
    ([E, N], row stride stride_bias_e) on every row.

    USE_TMA (one phase only): load through the tensor descriptors a_desc / b_desc (see
    ``_rows_mainloop_tma``; A rows start at ``pid_m * BM + a_row_shift``) instead of the pointers.

    PUSH: rows with row_src >= 0 go to their origin (see ``_push_rows``); otherwise the tile is
    stored into C [R, N]. Unused tiles store nothing.
    TILE_M (a half tile; 0: BM): the schedule's tiles are TILE_M rows high and this one computes
    only the first BM rows of tile pid_m.
    """
    e = _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        blk = pid_m  # first row = blk * BM
        if TILE_M > 0:
            blk = pid_m * (TILE_M // BM)
        if USE_TMA:
            acc = _rows_mainloop_tma(blk, pid_n, e, a_desc, b_desc, K=K, BM=BM, BN=BN, BK=BK, B_NK=B_NK,
                                     INTERPRET=INTERPRET, a_row_shift=a_row_shift)
        else:
            acc = _rows_mainloop(blk, pid_n, e, a_ptr=a_ptr, a2_ptr=a2_ptr, stride_am=stride_am, b_ptr=b_ptr,
                                 b2_ptr=b2_ptr, stride_be=stride_be, stride_be2=stride_be2, stride_bo=stride_bo, N=N,
                                 K=K, K2=K2, BM=BM, BN=BN, BK=BK, B_NK=B_NK, TWO_PHASE=TWO_PHASE, EVEN_K=EVEN_K,
                                 INTERPRET=INTERPRET)
        if HAS_BIAS:
            bcols = pid_n * BN + tl.arange(0, BN)
            acc += tl.load(bias_ptr + e.to(tl.int64) * stride_bias_e + bcols, mask=bcols < N,
                           other=0.0).to(tl.float32)[None, :]
        if PUSH:
            _push_rows(acc, blk, pid_n, row_src_ptr, dst_ptrs_ptr, TK, stride_dm, N, BM, BN, DST_DTYPE)
        else:
            _store_rows(acc, blk, pid_n, c_ptr, stride_cm, N, BM, BN)


@triton.jit
def rows_gemm_kernel(a_ptr, a2_ptr, stride_am,
                     b_ptr, b2_ptr, stride_be, stride_be2, stride_bo,
                     c_ptr, stride_cm,
                     row_src_ptr, dst_ptrs_ptr, TK, stride_dm,
                     tile_expert_ptr, num_tiles_ptr, num_m,
                     N: tl.constexpr, K: tl.constexpr, K2: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     B_NK: tl.constexpr, TWO_PHASE: tl.constexpr, EVEN_K: tl.constexpr,
                     PUSH: tl.constexpr, DST_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
                     HAS_BIAS: tl.constexpr = False, bias_ptr=None, stride_bias_e=0):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(N, BN), GROUP_M)
    rows_gemm_tile(pid_m=pid_m, pid_n=pid_n, a_desc=None, b_desc=None, a_ptr=a_ptr, a2_ptr=a2_ptr,
                   stride_am=stride_am, b_ptr=b_ptr, b2_ptr=b2_ptr, stride_be=stride_be, stride_be2=stride_be2,
                   stride_bo=stride_bo, c_ptr=c_ptr, stride_cm=stride_cm, row_src_ptr=row_src_ptr,
                   dst_ptrs_ptr=dst_ptrs_ptr, TK=TK, stride_dm=stride_dm, tile_expert_ptr=tile_expert_ptr,
                   num_tiles_ptr=num_tiles_ptr, N=N, K=K, K2=K2, BM=BM, BN=BN, BK=BK, B_NK=B_NK,
                   TWO_PHASE=TWO_PHASE, EVEN_K=EVEN_K, PUSH=PUSH, DST_DTYPE=DST_DTYPE, USE_TMA=False,
                   INTERPRET=INTERPRET, HAS_BIAS=HAS_BIAS, bias_ptr=bias_ptr, stride_bias_e=stride_bias_e)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def rows_gemm(a: torch.Tensor, b: torch.Tensor, tile_expert: torch.Tensor, num_tiles: torch.Tensor, *,
              b_layout: str = "nk", a2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              row_src: torch.Tensor | None = None, dst_ptrs: torch.Tensor | None = None,
              TK: int | None = None, dst_stride: int | None = None, dst_dtype: torch.dtype = torch.bfloat16,
              config: GemmConfig | Bf16Gemm, bias: torch.Tensor | None = None):
    """Routed-row GEMM: for each used row tile m (expert e = tile_expert[m]),
    ``rows = A[m-tile] @ op(B[e])`` (+ ``A2[m-tile] @ op(B2[e])`` when a2/b2 are given).

    a [R, K] (any row stride, unit column stride); b [E, N, K] for ``b_layout="nk"`` (A @ B^T,
    e.g. nn.Linear weights) or [E, K, N] for ``"kn"`` (A @ B). a2 [R, K2] / b2 (same layout,
    shape [E, N, K2] / [E, K2, N] and strides as b): a second K phase, accumulated after the first.
    Epilogue: with ``dst_ptrs`` (int64 [W] base addresses) and ``row_src`` (int32 [R]) each row
    r with row_src[r] >= 0 is pushed, as ``dst_dtype``, to row ``row_src[r] % TK`` (row stride
    ``dst_stride``, default N) of buffer ``row_src[r] // TK``; returns None. Otherwise stores into
    ``out`` [R, N] (allocated as ``out_dtype``, default a's dtype) and returns it. ``bias`` [E, N]
    (unit column stride): added to every row of expert e.
    """
    R, K = a.shape
    E = b.shape[0]
    if b_layout == "nk":
        N, Kb = b.shape[1], b.shape[2]
    elif b_layout == "kn":
        Kb, N = b.shape[1], b.shape[2]
    else:
        raise ValueError("b_layout must be 'nk' or 'kn'")
    assert Kb == K, f"A has K={K}, B has {Kb}"
    assert b.stride(-1) == 1 and a.stride(-1) == 1
    two = a2 is not None
    if two:
        assert b2 is not None and b2.stride(1) == b.stride(1) and b2.stride(-1) == 1, "b2 must have b's row stride"
        assert a2.stride(0) == a.stride(0) and a2.stride(-1) == 1 and a2.shape[0] == R
        K2 = a2.shape[1]
        Kb2 = b2.shape[2] if b_layout == "nk" else b2.shape[1]
        Nb2 = b2.shape[1] if b_layout == "nk" else b2.shape[2]
        assert Kb2 == K2 and Nb2 == N and b2.shape[0] == E
    else:
        K2 = 0
    ws, cfg = _choice(config)
    bm = (ws.config if ws else cfg).BM
    _check_schedule(tile_expert, num_tiles, R, bm)
    push = dst_ptrs is not None
    if push:
        assert row_src is not None and TK is not None
        assert dst_ptrs.dtype == torch.int64 and row_src.dtype == torch.int32 and row_src.numel() == R
        c = a  # unused
        stride_c = 0
        stride_d = N if dst_stride is None else dst_stride
    else:
        if out is None:
            out = torch.empty(R, N, dtype=out_dtype or a.dtype, device=a.device)
        assert out.shape == (R, N) and out.stride(-1) == 1
        c, stride_c = out, out.stride(0)
        row_src = tile_expert  # unused
        dst_ptrs = tile_expert  # unused
        TK, stride_d = 1, 0
    if bias is not None:
        assert bias.shape == (E, N) and bias.stride(-1) == 1
    if ws:
        if two:
            raise ValueError("rows_gemm: the warp-specialized kernel runs one K phase (the down projection); the "
                             "gate/up dgrad runs on this file's kernel (a GemmConfig)")
        bws = _ws_module()
        epi = (row_src, dst_ptrs, TK, stride_d, dst_ptrs.view(dst_dtype)) if push else (c, stride_c)
        bws.rows_launch(a, b, tile_expert, num_tiles, bm, bws.EPI_PUSH if push else bws.EPI_STORE, epi,
                        tile_n=ws.config.BN, stages=ws.config.num_stages, grid=ws.programs, GROUP_M=ws.config.GROUP_M,
                        b_kn=b_layout == "kn", bias=bias)
        return None if push else out
    num_m = R // cfg.BM
    grid = (num_m * triton.cdiv(N, cfg.BN),)
    even_k = K % cfg.BK == 0 and K2 % cfg.BK == 0
    rows_gemm_kernel[grid](
        a, a2 if two else a, a.stride(0),
        b, b2 if two else b, b.stride(0), (b2 if two else b).stride(0), b.stride(1),
        c, stride_c, row_src, dst_ptrs, TK, stride_d,
        tile_expert, num_tiles, num_m, N, K, K2,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
        B_NK=(b_layout != "kn"), TWO_PHASE=two, EVEN_K=even_k, PUSH=push,
        DST_DTYPE=_TL_DTYPES[dst_dtype], INTERPRET=INTERPRET, HAS_BIAS=bias is not None, bias_ptr=bias,
        stride_bias_e=bias.stride(0) if bias is not None else 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return None if push else out


def down_push(h: torch.Tensor, w_down: torch.Tensor, tile_expert: torch.Tensor, num_tiles: torch.Tensor,
              row_src: torch.Tensor, dst_ptrs: torch.Tensor, TK: int, *, dst_stride: int | None = None,
              config: GemmConfig | Bf16Gemm, bias: torch.Tensor | None = None):
    """Down projection with push epilogue: row r of h[m-tile] @ Wd[e]^T (+ bias[e]) ([R, I] x [E, H, I])
    goes, bf16, to ``dst_ptrs[row_src[r] // TK]`` row ``row_src[r] % TK`` (each destination [TK, H]).
    w_down with a unit last stride, or the transposed view of a down_proj [E, I, H] (read in place)."""
    b, b_layout = _down_operand(w_down)
    rows_gemm(h, b, tile_expert, num_tiles, b_layout=b_layout, row_src=row_src, dst_ptrs=dst_ptrs,
              TK=TK, dst_stride=dst_stride, config=config, bias=bias)


def down_local(h: torch.Tensor, w_down: torch.Tensor, tile_expert: torch.Tensor, num_tiles: torch.Tensor, *,
               out: torch.Tensor | None = None, config: GemmConfig | Bf16Gemm) -> torch.Tensor:
    """Down projection into a local [R, H] buffer (rows of unused tiles untouched)."""
    b, b_layout = _down_operand(w_down)
    return rows_gemm(h, b, tile_expert, num_tiles, b_layout=b_layout, out=out, config=config)


def _down_operand(w_down: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(B, b_layout) of the down projection h @ Wd[e]^T for w_down [E, H, I] as given: itself "nk", or
    (unit stride along H: a transposed down_proj [E, I, H]) that [E, I, H] "kn"."""
    if w_down.stride(-1) == 1:
        return w_down, "nk"
    assert w_down.stride(1) == 1, f"w_down [E, H, I] needs a unit stride along I or H, got {w_down.stride()}"
    return w_down.transpose(1, 2), "kn"


def _gate_up_dgrad_args(dgu: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, gated: bool = True,
                        dgu_paired: bool = False) -> dict:
    """rows_gemm's operands for dg @ Wg[e] + du @ Wu[e] with the weights as they lie
    (``validate.gate_up_layout``): Tabby's [E, I, H] "kn" in two K phases; transposed ([E, H, I] with
    unit I stride) "nk" in two phases; g and u interleaved (gpt-oss), with dgu interleaved alike
    (``dgu_paired``: the down dgrad's ``dgu_paired``), one "nk" phase of K = 2I over gate_up_proj
    [E, H, 2I] as it lies (K-major). Not ``gated`` (an ungated activation: no dg, w_gate unread):
    du @ Wu[e] alone, one phase."""
    E, I, H = w_gate.shape
    assert dgu.shape[1] == 2 * I
    layout = gate_up_layout(w_gate, w_up)
    if dgu_paired:
        if layout != LAYOUT_KN_PAIRED or not gated:
            raise ValueError(f"gate_up_dgrad: dgu interleaved goes with gated weights in {LAYOUT_KN_PAIRED!r}, "
                             f"not {layout!r}")
        return dict(a=dgu, b=paired_gate_up(w_gate), b_layout="nk")
    if not gated:
        if layout == LAYOUT_NK:
            return dict(a=dgu[:, I:], b=w_up, b_layout="kn")
        if layout == LAYOUT_KN:
            return dict(a=dgu[:, I:], b=w_up.transpose(1, 2), b_layout="nk")
    if layout == LAYOUT_NK:
        return dict(a=dgu[:, :I], b=w_gate, b_layout="kn", a2=dgu[:, I:], b2=w_up)
    if layout == LAYOUT_KN:
        return dict(a=dgu[:, :I], b=w_gate.transpose(1, 2), b_layout="nk", a2=dgu[:, I:], b2=w_up.transpose(1, 2))
    if layout == LAYOUT_KN_PAIRED:
        raise ValueError(f"gate_up_dgrad: weights in {LAYOUT_KN_PAIRED!r} take dgu interleaved (dgu_paired=True)")
    raise ValueError(f"w_gate, w_up in none of the layouts {LAYOUTS}: strides {w_gate.stride()}, {w_up.stride()}")


def gate_up_dgrad_push(dgu: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       tile_expert: torch.Tensor, num_tiles: torch.Tensor,
                       row_src: torch.Tensor, dst_ptrs: torch.Tensor, TK: int, *,
                       dst_stride: int | None = None, config: GemmConfig | Bf16Gemm, gated: bool = True,
                       dgu_paired: bool = False):
    """dxs = dg @ Wg[e] + du @ Wu[e] (dgu [R, 2I]: dg = dgu[:, :I], du = dgu[:, I:], or ``dgu_paired``
    interleaved; w [E, I, H] in a layout of ``validate.LAYOUTS``; not ``gated``: du @ Wu[e] only), each
    row pushed bf16 to its origin as in ``down_push`` (destinations [TK, H])."""
    rows_gemm(tile_expert=tile_expert, num_tiles=num_tiles, row_src=row_src, dst_ptrs=dst_ptrs, TK=TK,
              dst_stride=dst_stride, config=config, **_gate_up_dgrad_args(dgu, w_gate, w_up, gated, dgu_paired))


def gate_up_dgrad_local(dgu: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                        tile_expert: torch.Tensor, num_tiles: torch.Tensor, *,
                        out: torch.Tensor | None = None, config: GemmConfig | Bf16Gemm) -> torch.Tensor:
    """dxs [R, H] = dg @ Wg[e] + du @ Wu[e] into a local buffer."""
    return rows_gemm(tile_expert=tile_expert, num_tiles=num_tiles, out=out, config=config,
                     **_gate_up_dgrad_args(dgu, w_gate, w_up))


# --------------------------------------------------------------------------------------------
# 3. down dgrad with the SwiGLU backward in its epilogue
# --------------------------------------------------------------------------------------------

@triton.jit
def down_dgrad_swiglu_tile(pid_m, pid_n,
                           dys_ptr, stride_dym,
                           wd_ptr, stride_we, stride_wh,
                           gu_ptr, stride_gum, ws_ptr,
                           dgu_ptr, stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm,
                           tile_expert_ptr, num_tiles_ptr,
                           H: tl.constexpr, I: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           EVEN_K: tl.constexpr, EPI_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                           ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                           W_LAYOUT: tl.constexpr = 0, DGU_PAIRED: tl.constexpr = False):
    """One (row tile, I-column tile) of the down dgrad + SwiGLU backward (ACT, LIMIT, ALPHA: another
    activation's backward, ``activation.act_grads``; the formulas below are SwiGLU's).

    dh_raw = dys[m-tile] @ Wd[e] (dys [R, H], Wd [E, H, I]: K = H, B[e] is [K, N]; W_LAYOUT ``W_KN``:
    a transposed down_proj [E, I, H] instead, B[e] [N, K], rows stride_wh apart).
    With g, u from gu [R, 2I] and the router weight ws[r] (fp32):
    dw_part[r, pid_n] = sum_cols dh_raw * h (h = silu(g) * u); dh = ws * dh_raw;
    dg = dh * u * sig(g) * (1 + g * (1 - sig(g))); du = dh * silu(g);
    dgu [R, 2I] bf16 (dg, du; DGU_PAIRED: interleaved, dg's column i at 2i, du's at 2i + 1);
    hw [R, I] bf16 = ws * h.
    """
    e = _row_tile_expert(pid_m, tile_expert_ptr, num_tiles_ptr)
    if e >= 0:
        acc = _rows_mainloop(pid_m, pid_n, e, a_ptr=dys_ptr, a2_ptr=dys_ptr, stride_am=stride_dym, b_ptr=wd_ptr,
                             b2_ptr=wd_ptr, stride_be=stride_we, stride_be2=stride_we, stride_bo=stride_wh, N=I, K=H,
                             K2=0, BM=BM, BN=BN, BK=BK, B_NK=W_LAYOUT != W_NK, TWO_PHASE=False, EVEN_K=EVEN_K,
                             INTERPRET=INTERPRET)
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        w = tl.load(ws_ptr + rows)
        if EPI_SPLIT:
            dw = _swiglu_bwd_split_epilogue(acc, rows, pid_n * BN, w, gu_ptr, stride_gum, dgu_ptr, stride_dgum,
                                            hw_ptr, stride_hwm, I, BM, BN, ACT, LIMIT, ALPHA, DGU_PAIRED)
        else:
            dw = _swiglu_bwd_epilogue(acc, rows, pid_n * BN + tl.arange(0, BN), w, gu_ptr, stride_gum, dgu_ptr,
                                      stride_dgum, hw_ptr, stride_hwm, I, ACT, LIMIT, ALPHA, DGU_PAIRED)
        tl.store(dwp_ptr + rows * stride_dwpm + pid_n, dw)


@triton.jit
def _swiglu_bwd_split_epilogue(acc, rows, col0, w, gu_ptr, stride_gum, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                               I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                               DGU_PAIRED: tl.constexpr = False):
    """``_swiglu_bwd_epilogue`` on the tile's two column halves, one after the other: a whole-tile
    epilogue keeps ~6 fp32 tiles live and spills at BN=128."""
    acc_lo, acc_hi = _split_cols(acc, BM, BN)
    dw_lo = _swiglu_bwd_epilogue(acc_lo, rows, col0 + tl.arange(0, BN // 2), w, gu_ptr, stride_gum, dgu_ptr,
                                 stride_dgum, hw_ptr, stride_hwm, I, ACT, LIMIT, ALPHA, DGU_PAIRED)
    dw_hi = _swiglu_bwd_epilogue(acc_hi, rows, col0 + BN // 2 + tl.arange(0, BN // 2), w, gu_ptr, stride_gum,
                                 dgu_ptr, stride_dgum, hw_ptr, stride_hwm, I, ACT, LIMIT, ALPHA, DGU_PAIRED)
    return dw_lo + dw_hi


@triton.jit
def _swiglu_bwd_epilogue(acc, rows, cols, w, gu_ptr, stride_gum, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                         I: tl.constexpr, ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                         DGU_PAIRED: tl.constexpr = False):
    """The activation's backward (``activation.act_grads``; the defaults: SwiGLU) on a slice of dh_raw
    (its rows and columns given); returns sum_cols dh_raw * h. Layout-free (no arange of its own),
    so that gemm_fp8_ws's Gluon kernel calls it too. DGU_PAIRED: dg and du stored interleaved (dg's
    column c at 2c, du's at 2c + 1: the order of gpt-oss's gate_up_proj), one contiguous row piece."""
    g, u = _load_gu(rows, cols, gu_ptr, stride_gum, I, ACT)
    return _swiglu_bwd_math(acc, g, u, rows, cols, w, dgu_ptr, stride_dgum, hw_ptr,
                            stride_hwm, I, ACT, LIMIT, ALPHA, DGU_PAIRED)


@triton.jit
def _split_cols(x, BM: tl.constexpr, BN: tl.constexpr):
    """A [BM, BN] tile's column halves."""
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _load_gu(rows, cols, gu_ptr, stride_gum, I: tl.constexpr, ACT: tl.constexpr = 0):
    """The saved g, u of a tile's rows and columns (fp32; 0 past I). Ungated (relu2): u for both."""
    cmask = (cols < I)[None, :]
    gptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
    if ACT == ACT_RELU2:  # ungated: no g (its columns unwritten), no dg
        u = tl.load(gptrs + I, mask=cmask, other=0.0).to(tl.float32)
        g = u
    else:
        g = tl.load(gptrs, mask=cmask, other=0.0).to(tl.float32)
        u = tl.load(gptrs + I, mask=cmask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _swiglu_bwd_math(acc, g, u, rows, cols, w, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                     I: tl.constexpr, ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                     DGU_PAIRED: tl.constexpr = False):
    """``_swiglu_bwd_epilogue`` from g, u already loaded (fp32)."""
    cmask = (cols < I)[None, :]
    h = act_fwd(g, u, ACT, LIMIT, ALPHA)
    dw = tl.sum(acc * h, axis=1)  # masked columns: g = u = 0 -> h = 0 (every kind)
    dh = acc * w[:, None]
    dg, du = act_grads(g, u, dh, ACT, LIMIT, ALPHA)
    if DGU_PAIRED:  # (gated kinds only)
        pcols = tl.reshape(tl.join(2 * cols, 2 * cols + 1), (2 * cols.shape[0], ))
        pvals = tl.reshape(tl.join(dg, du), (dg.shape[0], 2 * dg.shape[1]))
        tl.store(dgu_ptr + rows[:, None] * stride_dgum + pcols[None, :], pvals.to(dgu_ptr.dtype.element_ty),
                 mask=(pcols < 2 * I)[None, :])
    else:
        dptrs = dgu_ptr + rows[:, None] * stride_dgum + cols[None, :]
        if ACT != ACT_RELU2:
            tl.store(dptrs, dg.to(dgu_ptr.dtype.element_ty), mask=cmask)
        tl.store(dptrs + I, du.to(dgu_ptr.dtype.element_ty), mask=cmask)
    tl.store(hw_ptr + rows[:, None] * stride_hwm + cols[None, :], (h * w[:, None]).to(hw_ptr.dtype.element_ty),
             mask=cmask)
    return dw


@triton.jit
def down_dgrad_swiglu_kernel(dys_ptr, stride_dym, wd_ptr, stride_we, stride_wh,
                             gu_ptr, stride_gum, ws_ptr,
                             dgu_ptr, stride_dgum, hw_ptr, stride_hwm, dwp_ptr, stride_dwpm,
                             tile_expert_ptr, num_tiles_ptr, num_m, H: tl.constexpr, I: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                             EVEN_K: tl.constexpr, EPI_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                             ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 0.0,
                             W_LAYOUT: tl.constexpr = 0, DGU_PAIRED: tl.constexpr = False):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, tl.cdiv(I, BN), GROUP_M)
    down_dgrad_swiglu_tile(pid_m, pid_n, dys_ptr, stride_dym, wd_ptr, stride_we, stride_wh,
                           gu_ptr, stride_gum, ws_ptr, dgu_ptr, stride_dgum, hw_ptr, stride_hwm,
                           dwp_ptr, stride_dwpm, tile_expert_ptr, num_tiles_ptr, H, I,
                           BM, BN, BK, EVEN_K, EPI_SPLIT, INTERPRET, ACT, LIMIT, ALPHA, W_LAYOUT, DGU_PAIRED)


def down_dgrad_swiglu_bwd(dys: torch.Tensor, w_down: torch.Tensor, gu: torch.Tensor, ws: torch.Tensor,
                          tile_expert: torch.Tensor, num_tiles: torch.Tensor, *,
                          dgu: torch.Tensor | None = None, hw: torch.Tensor | None = None,
                          dw_part: torch.Tensor | None = None, config: GemmConfig | Bf16Gemm,
                          act: Activation = SWIGLU, dgu_paired: bool = False):
    """Down dgrad fused with the activation's backward (``act``; SwiGLU's by default). Returns
    (dgu, hw, dw_part); ``dgu_paired``: dgu's dg and du interleaved (gpt-oss's gate_up_proj order,
    a gated ``act``; dgu must not be gu then: a tile writes other tiles' g columns).

    dys [R, H] bf16 (unscaled dy rows); w_down [E, H, I] bf16 (unit last stride, or the transposed view
    of a down_proj [E, I, H]); gu [R, 2I] bf16 (saved g, u);
    ws [R] fp32 router weight of each row (0 for padding). Outputs: dgu [R, 2I] bf16 (dg, du),
    hw [R, I] bf16 (ws * h), dw_part [R, cdiv(I, BN)] fp32 partial router-weight gradients
    (reduce with ``reduce_dw``). Rows of unused tiles are left untouched.
    """
    R, H = dys.shape
    E, H2, I = w_down.shape
    assert H2 == H and gu.shape == (R, 2 * I) and ws.shape == (R,) and ws.dtype == torch.float32
    assert gu.stride(-1) == 1 and ws.stride(0) == 1
    b, b_layout = _down_operand(w_down)  # (its transpose: B of dh = dy @ Wd[e])
    ws_kernel, cfg = _choice(config)
    # (bf16_ws's kernel: config.BN columns of I a tile, the schedule's rows in 128-row kernel tiles)
    _check_schedule(tile_expert, num_tiles, R, ws_kernel.config.BM if ws_kernel else cfg.BM)
    nt_n = triton.cdiv(I, ws_kernel.config.BN if ws_kernel else cfg.BN)
    if dgu is None:
        dgu = torch.empty(R, 2 * I, dtype=dys.dtype, device=dys.device)
    if hw is None:
        hw = torch.empty(R, I, dtype=dys.dtype, device=dys.device)
    if dw_part is None:
        dw_part = torch.empty(R, nt_n, dtype=torch.float32, device=dys.device)
    if ws_kernel:
        return _ws_module().down_dgrad_ws(dys, w_down, gu, ws, tile_expert, num_tiles, dgu, hw, dw_part,
                                          sched_bm=ws_kernel.config.BM, stages=ws_kernel.config.num_stages,
                                          tile_n=ws_kernel.config.BN, grid=ws_kernel.programs,
                                          GROUP_M=ws_kernel.config.GROUP_M, act=act, dgu_paired=dgu_paired)
    _check_rows("dys", dys, R, cfg.BM)
    assert dw_part.shape == (R, nt_n) and dw_part.dtype == torch.float32
    num_m = R // cfg.BM
    grid = (num_m * nt_n,)
    ACT, LIMIT, ALPHA = act.constexprs()
    kw = dict(W_LAYOUT=W_KN.value) if b_layout == "kn" else {}  # (a transposed down_proj: B[e] [I, H] is [N, K])
    if dgu_paired:
        if not act.gated or dgu.data_ptr() == gu.data_ptr():
            raise ValueError("down_dgrad_swiglu_bwd: dgu_paired needs a gated activation and dgu apart from gu")
        kw["DGU_PAIRED"] = True
    down_dgrad_swiglu_kernel[grid](
        dys, dys.stride(0), b, b.stride(0), b.stride(1),
        gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0), dw_part, dw_part.stride(0),
        tile_expert, num_tiles, num_m, H, I,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, EVEN_K=(H % cfg.BK == 0),
        EPI_SPLIT=(cfg.BN >= 32), INTERPRET=INTERPRET, ACT=ACT, LIMIT=LIMIT, ALPHA=ALPHA, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **kw)
    return dgu, hw, dw_part


@triton.jit
def expert_row_sums_kernel(v_ptr, stride_vm, s_ptr, out_ptr, stride_oe, expert_start_ptr, expert_count_ptr, N,
                           BR: tl.constexpr, BN: tl.constexpr, SCALED: tl.constexpr):
    """out[e, cols] = sum over expert e's rows r (its segment [start, start + count)) of v[r, cols]
    (times s[r] where SCALED), in fp32, rows in blocks of BR in order: one program a (expert, column
    block), so the sum's order is fixed (deterministic)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    start = tl.load(expert_start_ptr + e).to(tl.int64)
    count = tl.load(expert_count_ptr + e)
    acc = tl.zeros((BR, BN), dtype=tl.float32)
    for r0 in range(0, count, BR):
        offs = r0 + tl.arange(0, BR)
        rmask = offs < count
        rows = start + offs
        v = tl.load(v_ptr + rows[:, None] * stride_vm + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        if SCALED:
            v = v * tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
        acc += v
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + cols, tl.sum(acc, axis=0), mask=cmask)


def expert_row_sums(v: torch.Tensor, expert_start: torch.Tensor, expert_count: torch.Tensor,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """[E, N] fp32: each expert's rows of v [R, N] summed (times ``scale`` [R] fp32 where given), in a
    fixed order: the gradients of the experts' biases."""
    E, N = expert_count.numel(), v.shape[1]
    out = torch.empty(E, N, dtype=torch.float32, device=v.device)
    if E == 0:
        return out
    assert v.stride(-1) == 1 and (scale is None or (scale.dtype == torch.float32 and scale.stride(0) == 1))
    BN = 128
    expert_row_sums_kernel[(E, triton.cdiv(N, BN))](v, v.stride(0), scale if scale is not None else v, out,
                                                    out.stride(0), expert_start, expert_count, N, BR=16, BN=BN,
                                                    SCALED=scale is not None, num_warps=4)
    return out


@triton.jit
def reduce_dw_tile(pid, dwp_ptr, stride_dwpm, dw_ptr, R, NT, BR: tl.constexpr, NT_P2: tl.constexpr):
    """dw[r] = sum over n of dw_part[r, n] for BR rows, a fixed-shape (deterministic) reduction."""
    rows = pid * BR + tl.arange(0, BR)
    cols = tl.arange(0, NT_P2)
    m = (rows < R)[:, None] & (cols < NT)[None, :]
    x = tl.load(dwp_ptr + rows[:, None] * stride_dwpm + cols[None, :], mask=m, other=0.0)
    tl.store(dw_ptr + rows, tl.sum(x, axis=1), mask=rows < R)


@triton.jit
def reduce_dw_kernel(dwp_ptr, stride_dwpm, dw_ptr, R, NT, BR: tl.constexpr, NT_P2: tl.constexpr):
    reduce_dw_tile(tl.program_id(0), dwp_ptr, stride_dwpm, dw_ptr, R, NT, BR, NT_P2)


def reduce_dw(dw_part: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """dw [R] fp32 = dw_part.sum(1), in a fixed order (deterministic)."""
    R, NT = dw_part.shape
    if out is None:
        out = torch.empty(R, dtype=torch.float32, device=dw_part.device)
    BR = 128
    reduce_dw_kernel[(triton.cdiv(R, BR),)](dw_part, dw_part.stride(0), out, R, NT, BR=BR,
                                             NT_P2=max(2, triton.next_power_of_2(NT)), num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# 5. Per-expert weight gradients over the whole row range
# --------------------------------------------------------------------------------------------
#
# One persistent launch of one program per SM. The output tiles are numbered expert-major (an
# expert's rows stay in L2 while its tiles run), then by pair (dW_gate, dW_up), then grouped (m, n);
# program pid of P takes tiles pid, pid + P, pid + 2P, ... and walks them as ONE loop over its
# (tile, K step) pairs, so the software pipeline issues the next tile's first loads before the
# current tile's last MMA and its store. A tile has max(cdiv(rows, BK), 1) K steps, known at run
# time (an expert without rows takes one all-masked step and stores zeros); the loop's trip count
# is their sum over the program's tiles (``_wgrad_steps_of``).
#
# Deterministic for any P: one program computes a whole output tile, over its K steps 0, 1, ...,
# nk - 1 in order, into an accumulator that is zero at the tile's first step and stored at its
# last. Each element's sum thus has one order, fixed by its expert's rows and the tile config
# alone, whichever program takes the tile and however many programs there are (P is a run-time
# value: one compiled kernel for every grid).

@triton.jit
def _wgrad_steps_of(pid, P, per_e, expert_count_ptr, E, BK: tl.constexpr, NE_P2: tl.constexpr):
    """The loop trip count of program pid of P: the K steps of its tiles pid, pid + P, ... (per_e tiles
    an expert, expert-major), the sum over experts of max(cdiv(rows, BK), 1) x the expert's tiles it takes."""
    ee = tl.arange(0, NE_P2)
    cnt = tl.load(expert_count_ptr + ee, mask=ee < E, other=0)
    steps = tl.maximum((cnt + BK - 1) // BK, 1)
    # the program's tiles below t number cdiv(t - pid, P) (0 if t <= pid); expert e's lie in [e, e + 1) * per_e
    hi = (ee + 1) * per_e - pid
    lo = ee * per_e - pid
    mine = tl.where(hi > 0, (hi + P - 1) // P, 0) - tl.where(lo > 0, (lo + P - 1) // P, 0)
    return tl.sum(tl.where(ee < E, steps * mine, 0), axis=0)


@triton.jit
def _wgrad_tile_ptrs(a_sel, stride_ar, b_ptr, stride_br, start, pid_m, pid_n, M: tl.constexpr, N: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The first K step's A [BK, BM] and B [BK, BN] pointers of output tile (pid_m, pid_n) over rows from start."""
    offs_k = tl.arange(0, BK)
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    a_ptrs = a_sel + start * stride_ar + (offs_k[:, None] * stride_ar + offs_m[None, :])
    b_ptrs = b_ptr + start * stride_br + (offs_k[:, None] * stride_br + offs_n[None, :])
    return a_ptrs, b_ptrs


@triton.jit
def _wgrad_step(acc, kt, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs, b_ptrs, P,
                a_ptr, a2_ptr, stride_ar, b_ptr, stride_br, c_ptr, c2_ptr, stride_ce, stride_cm,
                expert_start_ptr, expert_count_ptr, M: tl.constexpr, N: tl.constexpr,
                NUM_PAIRS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, INTERPRET: tl.constexpr):
    """One step of the (tile, K step) loop: K step kt of the current tile. At kt == nk the program's
    next tile (tile + P) starts at its step 0; at its last step (kt == nk - 1) the tile is stored and
    the accumulator zeroed for the next."""
    num_m: tl.constexpr = (M + BM - 1) // BM
    num_n: tl.constexpr = (N + BN - 1) // BN
    per_pair: tl.constexpr = num_m * num_n
    if kt == nk:
        tile += P
        e = tile // (per_pair * NUM_PAIRS)
        rem = tile % (per_pair * NUM_PAIRS)
        pair = rem // per_pair
        pid_m, pid_n = grouped_tile(rem % per_pair, num_m, num_n, GROUP_M)
        start = tl.load(expert_start_ptr + e).to(tl.int64)
        cnt = tl.load(expert_count_ptr + e)
        nk = tl.maximum(tl.cdiv(cnt, BK), 1)
        kt = 0
        if NUM_PAIRS == 2:
            a_sel = tl.where(pair == 0, a_ptr, a2_ptr)
        else:
            a_sel = a_ptr
        a_ptrs, b_ptrs = _wgrad_tile_ptrs(a_sel, stride_ar, b_ptr, stride_br, start, pid_m, pid_n, M, N, BM, BN, BK)
    kmask = (tl.arange(0, BK) < cnt - kt * BK)[:, None]
    a = tl.load(a_ptrs, mask=kmask, other=0.0)
    b = tl.load(b_ptrs, mask=kmask, other=0.0)
    acc = _dot(tl.trans(a), b, acc, INTERPRET)
    if kt == nk - 1:
        if NUM_PAIRS == 2:
            c_sel = tl.where(pair == 0, c_ptr, c2_ptr)
        else:
            c_sel = c_ptr
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        cptrs = c_sel + e.to(tl.int64) * stride_ce + rm[:, None] * stride_cm + rn[None, :]
        tl.store(cptrs, acc.to(c_sel.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    return acc, kt + 1, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs + BK * stride_ar, b_ptrs + BK * stride_br


@triton.jit
def expert_wgrad_kernel(a_ptr, a2_ptr, stride_ar, b_ptr, stride_br, c_ptr, c2_ptr, stride_ce, stride_cm,
                        expert_start_ptr, expert_count_ptr, E, M: tl.constexpr, N: tl.constexpr,
                        NUM_PAIRS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, NE_P2: tl.constexpr, INTERPRET: tl.constexpr):
    """C[e] = A_seg^T @ B_seg for each of the E experts (and C2[e] = A2_seg^T @ B_seg when NUM_PAIRS
    is 2) by a persistent grid (the comment above). A, A2 [R, >= M] (row stride stride_ar, unit
    column stride), B [R, >= N] likewise; C, C2 [E, M, N] (strides stride_ce, stride_cm, 1)."""
    # M, N constexpr: with them known, (offs % M) keeps the contiguity the loads need to vectorize
    # (and to be pipelined); a runtime M would make every A and B load element-wise.
    num_m: tl.constexpr = (M + BM - 1) // BM
    num_n: tl.constexpr = (N + BN - 1) // BN
    per_e: tl.constexpr = num_m * num_n * NUM_PAIRS
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    total = _wgrad_steps_of(pid, P, per_e, expert_count_ptr, E, BK, NE_P2)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kt = 0
    nk = 0  # kt == nk: the first step starts the program's first tile, pid
    tile = pid - P
    e = pid * 0
    pair = pid * 0
    pid_m = pid * 0
    pid_n = pid * 0
    cnt = pid * 0
    a_ptrs, b_ptrs = _wgrad_tile_ptrs(a_ptr, stride_ar, b_ptr, stride_br, pid.to(tl.int64) * 0, pid_m, pid_n, M, N,
                                      BM, BN, BK)
    if INTERPRET:
        # The interpreter (numpy >= 2.4) cannot take range() of a runtime scalar: same steps, a while loop.
        it = 0
        while it < total:
            acc, kt, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs, b_ptrs = _wgrad_step(
                acc, kt, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs, b_ptrs, P, a_ptr, a2_ptr, stride_ar, b_ptr,
                stride_br, c_ptr, c2_ptr, stride_ce, stride_cm, expert_start_ptr, expert_count_ptr, M, N, NUM_PAIRS,
                BM, BN, BK, GROUP_M, INTERPRET)
            it += 1
    else:
        for _ in range(0, total):
            acc, kt, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs, b_ptrs = _wgrad_step(
                acc, kt, nk, tile, e, pair, pid_m, pid_n, cnt, a_ptrs, b_ptrs, P, a_ptr, a2_ptr, stride_ar, b_ptr,
                stride_br, c_ptr, c2_ptr, stride_ce, stride_cm, expert_start_ptr, expert_count_ptr, M, N, NUM_PAIRS,
                BM, BN, BK, GROUP_M, INTERPRET)


def _wgrad_launch(a, a2, b, expert_start, expert_count, M, out, out2, cfg, programs):
    E = expert_count.numel()
    N = out.shape[2]
    assert expert_start.dtype == torch.int32 and expert_count.dtype == torch.int32
    assert expert_start.numel() >= E
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and a.shape[0] == b.shape[0]
    assert out.shape == (E, M, N) and out.stride(-1) == 1
    pairs = 1 if a2 is None else 2
    if pairs == 2:
        assert a2.stride() == a.stride() and out2.stride() == out.stride() and out2.shape == out.shape
    num_tiles = E * pairs * triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)
    grid = (max(1, min(num_tiles, programs)),)
    expert_wgrad_kernel[grid](
        a, a2 if pairs == 2 else a, a.stride(0), b, b.stride(0), out, out2 if pairs == 2 else out,
        out.stride(0), out.stride(1), expert_start, expert_count, E, M, N,
        NUM_PAIRS=pairs, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
        NE_P2=max(2, triton.next_power_of_2(E)), INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def expert_wgrad(a: torch.Tensor, b: torch.Tensor, expert_start: torch.Tensor, expert_count: torch.Tensor, *,
                 config: GemmConfig | Bf16Gemm, programs: int, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C [E, M, N] with C[e] = A[s:s+c]^T @ B[s:s+c] (s = expert_start[e], c = expert_count[e]).

    a [R, M], b [R, N]: any row strides (e.g. column slices of wider buffers), unit column stride.
    fp32 accumulation, each output tile by one program over its expert's rows in order (bitwise the
    same whatever the grid); experts with no rows get zeros. E.g. dW_down = expert_wgrad(dys, hw, ...)
    -> [E, H, I]. ``config``: the tiles (``Plan.gemm[KIND_WGRAD_DOWN]``); ``programs``: the
    persistent grid (``Plan.wgrad_programs``).
    """
    M, N = a.shape[1], b.shape[1]
    E = expert_count.numel()
    ws, cfg = _choice(config)
    if out is None:
        out = torch.empty(E, M, N, dtype=out_dtype, device=a.device)
    if ws:
        _ws_module().expert_wgrad_ws([a], b, expert_start, expert_count, [out], stages=ws.config.num_stages,
                                     grid=ws.programs, GROUP_M=ws.config.GROUP_M)
        return out
    _wgrad_launch(a, None, b, expert_start, expert_count, M, out, None, cfg, programs)
    return out


def expert_wgrad_gate_up(dgu: torch.Tensor, xs: torch.Tensor, expert_start: torch.Tensor,
                         expert_count: torch.Tensor, *, config: GemmConfig | Bf16Gemm, programs: int,
                         out_gate: torch.Tensor | None = None, out_up: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.bfloat16):
    """dW_gate[e] = dg_seg^T @ xs_seg, dW_up[e] = du_seg^T @ xs_seg (dgu [R, 2I], xs [R, H]) in one
    launch; returns (dW_gate, dW_up), each [E, I, H]. ``config``, ``programs``: as ``expert_wgrad``'s
    (``Plan.gemm[KIND_WGRAD_GATE_UP]``, ``Plan.wgrad_programs``)."""
    I = dgu.shape[1] // 2
    H = xs.shape[1]
    E = expert_count.numel()
    ws, cfg = _choice(config)
    if out_gate is None:
        out_gate = torch.empty(E, I, H, dtype=out_dtype, device=dgu.device)
    if out_up is None:
        out_up = torch.empty(E, I, H, dtype=out_dtype, device=dgu.device)
    if ws:
        _ws_module().expert_wgrad_ws([dgu[:, :I], dgu[:, I:]], xs, expert_start, expert_count, [out_gate, out_up],
                                     stages=ws.config.num_stages, grid=ws.programs, GROUP_M=ws.config.GROUP_M)
        return out_gate, out_up
    _wgrad_launch(dgu[:, :I], dgu[:, I:], xs, expert_start, expert_count, I, out_gate, out_up, cfg, programs)
    return out_gate, out_up
