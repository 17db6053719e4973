"""The forward megakernel's tasks: what one ticket does once the kernel has decoded it.

``fill`` copies rows of a routed row tile from their source ranks; ``routed_compute`` computes a
gate/up or a down ticket of a routed row tile; ``shared_compute`` one of the shared expert. Each
waits for what its ticket reads (``protocol``), unless the ticket's first polls already saw it
there (``ready``), and leaves the ticket's signal to the kernel (``sync.signal_take``), except a
comm program's fill, which signals itself.

Arguments: the kernel's argument tuples as they came (``kernel.py``: ``sync_args``, ``route``,
``routed``, ``shared``, ``descs``, ``saved``, ``tokens``), the pass's ``epoch``, and the launch's
constants ``C`` (``kernel.MegaConsts``) and instrumentation ``PROBE`` (``kernel.ProbeConsts``).

Row-tile index vs ring row: the tile functions of gemm.py / comm.py address rows as
``tile * BM`` and use ``tile`` for the schedule's tables (tile_expert, row_src). Here the tables are
indexed by the row tile i and the ring by its slot s: the ring bases passed down are shifted by
``(s - i) * BM`` rows, so that row ``i * BM`` of the shifted base is row ``s * BM`` of the ring.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import comm, sync
from ..gemm import bf16 as gemm
from .protocol import TR_FILL, TR_FILL_REMOTE, routed_signal, routed_waits, trace_ready, wait_counter

_ERR_WAIT_TILE = tl.constexpr(sync.ERR_WAIT_TILE)
_ERR_WAIT_RING_SLOT = tl.constexpr(sync.ERR_WAIT_RING_SLOT)
_ERR_WAIT_PEER_READY = tl.constexpr(sync.ERR_WAIT_PEER_READY)


@triton.jit
def fill(i, part, sync_args, epoch, route, xs, saved, W, rec, ready, tr_base, C: tl.constexpr,
         PROBE: tl.constexpr, SIGNAL: tl.constexpr):
    """Copy part ``part`` (BM // FS rows) of routed row tile i from the rows' source ranks into its
    ring slot of ``xs`` (SAVE: into row i*BM of the full xs buffer, and the rows' router weights
    into ``saved.row_w``), after its slot's last readers are done (with per-tile counters, TR, the
    rows are its own: no wait). LOCAL_A: this rank's rows are not copied (the gate/up tiles read them
    from x; their router weights are still kept). A part of padding rows only is not written at all:
    whatever its rows hold reaches only padding rows of h, g | u and y, which nothing reads (the
    GEMMs are row-wise, the pushes and the backward's weight gradients take real rows only).
    SIGNAL: add to the part's fill counter here (a comm program; a compute program's kernel loop
    signals with the next ticket's take)."""
    BM: tl.constexpr = C.BM
    FS: tl.constexpr = C.FS
    s = i % C.NS
    if not C.TR:
        w1, t1, _, _ = routed_waits(kind=0, i=i, p=i, NS=C.NS, FS=FS, G=C.G, D=0)
        wait_counter(sync_args.counters, idx=w1, target=t1, wait_budget=sync_args.wait_budget, err_ptr=sync_args.err,
                     code=_ERR_WAIT_RING_SLOT, rank=sync_args.rank, epoch=epoch, TMA=False, ready=ready)
    trace_ready(rec, PROBE.TRACE_EV, C.INTERPRET)
    if PROBE.TRACE_EV > 0:  # local or remote rows (measurement only: these loads exist only when tracing)
        rs = tl.load(route.row_src + (i * FS + part) * (BM // FS) + tl.arange(0, BM // FS))
        n_remote = tl.sum(((rs >= 0) & (rs // route.TK != sync_args.rank)).to(tl.int32), axis=0)
        tl.store(rec, tl.where(n_remote > 0, TR_FILL_REMOTE, TR_FILL).to(tl.int64))
    if (PROBE.ABLATE & 1) == 0:
        # rows i*BM + part*BM/FS ..: "tile" i*FS + part of height BM // FS
        if C.SAVE:
            comm.pull_rows_tile(tile=i * FS + part, row_src=route.row_src, src_ptrs=route.x_ptrs, dst=xs, H=C.H,
                                TK=route.TK, k=route.k, w_ptrs=saved.w_ptrs, ws_out=saved.row_w, BR=BM // FS,
                                BH=C.BH, WITH_WEIGHTS=True, ROWS_16B=(C.H % 8) == 0, STAGES=C.FILL_STAGES, W=W,
                                WP=C.WP, SKIP_EMPTY=True, SKIP_RANK=C.LOCAL_A, rank=sync_args.rank)
        else:
            dst = xs + (s - i).to(tl.int64) * (BM * C.H)  # row i*BM of dst = row s*BM of the ring
            comm.pull_rows_tile(tile=i * FS + part, row_src=route.row_src, src_ptrs=route.x_ptrs, dst=dst, H=C.H,
                                TK=route.TK, k=route.k, w_ptrs=route.x_ptrs, ws_out=xs, BR=BM // FS, BH=C.BH,
                                WITH_WEIGHTS=False, ROWS_16B=(C.H % 8) == 0, STAGES=C.FILL_STAGES, W=W, WP=C.WP,
                                SKIP_EMPTY=True, SKIP_RANK=C.LOCAL_A, rank=sync_args.rank)
    if C.TMA:  # the gate/up tiles read these rows through TMA (the async proxy)
        sync.fence_proxy_async()
    if SIGNAL:
        sync.add_release(sync_args.counters + routed_signal(kind=0, i=i, p=i, NS=C.NS, TR=C.TR, tr_base=tr_base),
                         value=1, SCOPE="gpu")


@triton.jit
def down_cols(blk, c0, e, hh, route, routed, h_desc, wd_desc, shift, BM: tl.constexpr, C: tl.constexpr,
              TILE_M: tl.constexpr = 0):
    """Down column tiles c0 .. c0+DN_COLS-1 of row block ``blk`` (BM rows of h at ``hh``; a half tile:
    blk = 2i, TILE_M = 2BM), pushed to their rows' origins. With TMA one K loop runs over all the
    columns (``gemm.push_col_tiles_tma``); pointer loads run the column tiles one after another."""
    if C.TMA:
        gemm.push_col_tiles_tma(blk=blk, c0=c0, e=e, a_desc=h_desc, b_desc=wd_desc, row_src_ptr=route.row_src,
                                dst_ptrs_ptr=route.y_ptrs, TK=route.TK, stride_dm=C.H, N=C.H, K=C.I, BM=BM,
                                BN=C.BN_DN, BK=C.BK_DN, NC=C.DN_COLS, DST_DTYPE=tl.bfloat16,
                                INTERPRET=C.INTERPRET, a_row_shift=shift)
    else:
        pid_m = blk
        if TILE_M > 0:
            pid_m = blk // (TILE_M // BM)
        for c in range(0, C.DN_COLS):
            gemm.rows_gemm_tile(pid_m=pid_m, pid_n=c0 + c, a_desc=h_desc, b_desc=wd_desc, a_ptr=hh, a2_ptr=hh,
                                stride_am=C.I, b_ptr=routed.w_down, b2_ptr=routed.w_down, stride_be=routed.wd_e,
                                stride_be2=routed.wd_e, stride_bo=routed.wd_n, c_ptr=hh, stride_cm=0,
                                row_src_ptr=route.row_src, dst_ptrs_ptr=route.y_ptrs, TK=route.TK, stride_dm=C.H,
                                tile_expert_ptr=route.tile_expert, num_tiles_ptr=route.num_tiles, N=C.H, K=C.I, K2=0,
                                BM=BM, BN=C.BN_DN, BK=C.BK_DN, B_NK=True, TWO_PHASE=False,
                                EVEN_K=C.I % C.BK_DN == 0, PUSH=True, DST_DTYPE=tl.bfloat16, USE_TMA=False,
                                INTERPRET=C.INTERPRET, a_row_shift=shift, TILE_M=TILE_M)


@triton.jit
def local_a_rows(i, row_src, xs, x_rows, TK, k, rank, H: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                 TOKENS: tl.constexpr = False):
    """Pointers to the A rows of routed row tile i's first R rows (LOCAL_A): a row from this rank
    (``row_src // TK == rank``) in x_rows (the layer's input [T, H]), row ``(row_src % TK) // k``;
    any other in xs, row i*BM + r (filled, or padding; TOKENS: xs is every rank's tokens [W*T, H],
    row ``row_src // k`` = src*T + t, padding rows its row 0). Offsets from the one pointer xs, not
    a pointer per buffer, so the loads keep their 16-byte vectors: both buffers 16-byte aligned, H a
    multiple of 8 (the launcher checks)."""
    rows = i * BM + tl.arange(0, R)
    rs = tl.load(row_src + rows)
    mine = (rs >= 0) & (rs // TK == rank)
    tok = tl.where(mine, (rs % TK) // k, 0).to(tl.int64)
    ESIZE: tl.constexpr = xs.dtype.element_ty.primitive_bitwidth // 8
    dx = (x_rows.to(tl.int64, bitcast=True) - xs.to(tl.int64, bitcast=True)) // ESIZE  # x - xs, elements
    if TOKENS:
        other = tl.where(rs >= 0, rs // k, 0).to(tl.int64) * H
    else:
        other = rows.to(tl.int64) * H
    return xs + tl.multiple_of(tl.where(mine, dx + tok * H, other), 16 // ESIZE)


@triton.jit
def routed_compute(kind, i, n, p, sync_args, epoch, route, routed, descs, saved, x_rows, tokens, n_local, tr_base,
                rec, ready, C: tl.constexpr, PROBE: tl.constexpr):
    """A gate/up (kind 1) ticket of routed row tile i, column tile n, or a down (kind 2) ticket of
    row tile i, column tiles n*DN_COLS .. n*DN_COLS+DN_COLS-1 (``rec``: its trace record). p: the
    ticket's position in the routed order, whose ring slot is p % NS (p = i but with TOKENS, whose
    A rows come from x and the pulled tokens ``routed.xs`` [W*T, H]).

    HALF: a tile whose real rows (a prefix) fit in its first BM/2 is computed as a BM/2-row tile by
    both its gate/up and its down tickets (same columns and K order: bitwise the same outputs). A
    padding tile (its first row_src < 0: the schedule pads experts to a multiple of its ``align``
    tiles) computes nothing; its waits and signals count like any other's. What the schedule says of
    the tile (its expert, whether it is a half tile) is read before the ticket's own waits (the
    schedule was written before the launch), so those loads overlap them.
    """
    BM: tl.constexpr = C.BM
    H: tl.constexpr = C.H
    I: tl.constexpr = C.I
    s = p % C.NS
    first_row = tl.load(route.row_src + i * BM)
    if C.HALF:
        half_row = tl.load(route.row_src + i * BM + BM // 2)  # < 0: the real rows fit in the first BM/2
    shift = (s - i) * BM  # row i*BM of a shifted ring base (or TMA coordinate) is row s*BM of the ring
    if C.SAVE or C.TOKENS:  # xs is the full routed-row buffer (row i*BM) or the tokens, not a ring
        xs_shift = shift * 0
    else:
        xs_shift = shift
    if kind == 1:  # gate/up column tile n of row tile i
        w1, t1, w2, t2 = routed_waits(kind=1, i=i, p=p, NS=C.NS, FS=C.FS, G=C.G, D=C.D, TR=C.TR, tr_base=tr_base,
                                      TOK=C.TOKENS, n_local=n_local, pull_idx=tokens.pull_idx)
        code1 = _ERR_WAIT_TILE
        if C.TOKENS:  # (the wait for the peers' tokens)
            code1 = _ERR_WAIT_PEER_READY
        wait_counter(sync_args.counters, idx=w1, target=t1, wait_budget=sync_args.wait_budget, err_ptr=sync_args.err,
                     code=code1, rank=sync_args.rank, epoch=epoch, TMA=C.TMA, ready=ready)
        wait_counter(sync_args.counters, idx=w2, target=t2, wait_budget=sync_args.wait_budget, err_ptr=sync_args.err,
                     code=_ERR_WAIT_RING_SLOT, rank=sync_args.rank, epoch=epoch, TMA=False, ready=ready)
        trace_ready(rec, PROBE.TRACE_EV, C.INTERPRET)
        xs = routed.xs + xs_shift.to(tl.int64) * H
        hh = routed.h_ring + shift.to(tl.int64) * I
        if C.SAVE:  # g | u for the backward, at row i*BM of the full buffer
            gu_out = saved.gu
        else:
            gu_out = hh  # unused
        if (PROBE.ABLATE & 2) == 0:
            # Two nested ifs, not a flag: without HALF the half-tile code is not compiled at all.
            full = first_row >= 0
            if C.HALF:
                if (half_row < 0) & (first_row >= 0):
                    full = False
                    a_half = None
                    if C.LOCAL_A:
                        a_half = local_a_rows(i, route.row_src, xs, x_rows, route.TK, route.k, sync_args.rank, H=H,
                                              BM=BM, R=BM // 2, TOKENS=C.TOKENS)
                    gemm.gate_up_swiglu_tile(
                        pid_m=i, pid_n=n, xs_ptr=xs, stride_xm=H, wg_ptr=routed.w_gate, wu_ptr=routed.w_up,
                        stride_we=routed.wg_e, stride_wn=routed.wg_n, h_ptr=hh, stride_hm=I, gu_ptr=gu_out,
                        stride_gum=2 * I, tile_expert_ptr=route.tile_expert, num_tiles_ptr=route.num_tiles, H=H, I=I,
                        BM=BM // 2, BN=C.BN_GU, BK=C.BK_GU, EVEN_K=H % C.BK_GU == 0, SAVE_GU=C.SAVE,
                        INTERPRET=C.INTERPRET, n_rows=0, MASK_ROWS=False, USE_TMA=C.TMA, xs_desc=descs.xs_half,
                        wg_desc=descs.w_gate, wu_desc=descs.w_up, a_row_shift=xs_shift, TILE_M=BM, A_ROWS=C.LOCAL_A,
                        a_rows=a_half, ACT=C.ACT, LIMIT=C.LIMIT, ALPHA=C.ALPHA)
            if full:
                a_full = None
                if C.LOCAL_A:
                    a_full = local_a_rows(i, route.row_src, xs, x_rows, route.TK, route.k, sync_args.rank, H=H, BM=BM,
                                          R=BM, TOKENS=C.TOKENS)
                gemm.gate_up_swiglu_tile(
                    pid_m=i, pid_n=n, xs_ptr=xs, stride_xm=H, wg_ptr=routed.w_gate, wu_ptr=routed.w_up,
                    stride_we=routed.wg_e, stride_wn=routed.wg_n, h_ptr=hh, stride_hm=I, gu_ptr=gu_out,
                    stride_gum=2 * I, tile_expert_ptr=route.tile_expert, num_tiles_ptr=route.num_tiles, H=H, I=I,
                    BM=BM, BN=C.BN_GU, BK=C.BK_GU, EVEN_K=H % C.BK_GU == 0, SAVE_GU=C.SAVE, INTERPRET=C.INTERPRET,
                    n_rows=0, MASK_ROWS=False, USE_TMA=C.TMA, xs_desc=descs.xs, wg_desc=descs.w_gate,
                    wu_desc=descs.w_up, a_row_shift=xs_shift, TILE_M=0, A_ROWS=C.LOCAL_A, a_rows=a_full,
                    ACT=C.ACT, LIMIT=C.LIMIT, ALPHA=C.ALPHA)
        if C.TMA:  # the down tiles read h through TMA (fenced before the caller's release)
            sync.fence_proxy_async()
    else:  # down column tiles of row tile i, rows pushed to their origins
        e = tl.load(route.tile_expert + i)  # -1 for a padding tile, which computes nothing below
        w1, t1, _, _ = routed_waits(kind=2, i=i, p=p, NS=C.NS, FS=C.FS, G=C.G, D=C.D)
        wait_counter(sync_args.counters, idx=w1, target=t1, wait_budget=sync_args.wait_budget, err_ptr=sync_args.err,
                     code=_ERR_WAIT_TILE, rank=sync_args.rank, epoch=epoch, TMA=C.TMA, ready=ready)
        trace_ready(rec, PROBE.TRACE_EV, C.INTERPRET)
        hh = routed.h_ring + shift.to(tl.int64) * I
        if (PROBE.ABLATE & 2) == 0:
            full = first_row >= 0
            if C.HALF:
                if (half_row < 0) & (first_row >= 0):
                    full = False
                    down_cols(i * 2, n * C.DN_COLS, e, hh, route, routed, h_desc=descs.h_half, wd_desc=descs.w_down,
                              shift=shift, BM=BM // 2, C=C, TILE_M=BM)
            if full:
                down_cols(i, n * C.DN_COLS, e, hh, route, routed, h_desc=descs.h, wd_desc=descs.w_down, shift=shift,
                          BM=BM, C=C, TILE_M=0)


@triton.jit
def shared_compute(kind, j, n, sync_args, epoch, shared, descs, rec, ready, C: tl.constexpr, PROBE: tl.constexpr):
    """The shared expert over x row tile j: gate/up (kind 1) into ``shared.h``, or down (kind 2),
    after the row tile's gate/up tiles, into ``shared.out`` (local rows). The kernel signals a
    gate/up tile's end (sh_gu[j])."""
    H: tl.constexpr = C.H
    IS: tl.constexpr = C.IS
    if kind == 1:
        gemm.gate_up_swiglu_tile(
            pid_m=j, pid_n=n, xs_ptr=shared.x, stride_xm=H, wg_ptr=shared.w_gate, wu_ptr=shared.w_up, stride_we=0,
            stride_wn=H, h_ptr=shared.h, stride_hm=IS, gu_ptr=shared.h, stride_gum=0, tile_expert_ptr=shared.tiles,
            num_tiles_ptr=shared.n_ptr, H=H, I=IS, BM=C.BM, BN=C.BN_GUS, BK=C.BK_GUS, EVEN_K=H % C.BK_GUS == 0,
            SAVE_GU=False, INTERPRET=C.INTERPRET, n_rows=shared.T, MASK_ROWS=True, USE_TMA=C.TMA, xs_desc=descs.x,
            wg_desc=descs.s_gate, wu_desc=descs.s_up)
        if C.TMA:  # the shared down tiles read h through TMA (fenced before the caller's release)
            sync.fence_proxy_async()
    else:
        wait_counter(sync_args.counters, idx=C.SH_GU + j, target=C.GS, wait_budget=sync_args.wait_budget,
                     err_ptr=sync_args.err, code=_ERR_WAIT_TILE, rank=sync_args.rank, epoch=epoch, TMA=C.TMA,
                     ready=ready)
        trace_ready(rec, PROBE.TRACE_EV, C.INTERPRET)
        gemm.rows_gemm_tile(
            pid_m=j, pid_n=n, a_desc=descs.h_sh, b_desc=descs.s_down, a_ptr=shared.h, a2_ptr=shared.h, stride_am=IS,
            b_ptr=shared.w_down, b2_ptr=shared.w_down, stride_be=0, stride_be2=0, stride_bo=IS, c_ptr=shared.out,
            stride_cm=H, row_src_ptr=shared.tiles, dst_ptrs_ptr=shared.tiles, TK=1, stride_dm=0,
            tile_expert_ptr=shared.tiles, num_tiles_ptr=shared.n_ptr, N=H, K=IS, K2=0, BM=C.BM, BN=C.BN_DNS,
            BK=C.BK_DNS, B_NK=True, TWO_PHASE=False, EVEN_K=IS % C.BK_DNS == 0, PUSH=False, DST_DTYPE=tl.bfloat16,
            USE_TMA=C.TMA, INTERPRET=C.INTERPRET)
