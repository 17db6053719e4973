"""The forward megakernel: dispatch (pull), gate/up + SwiGLU, down + push and the shared expert in
ONE persistent launch, signalling at tile granularity through counters in GPU memory.

It replaces the dispatch, gate_up and down_push launches of ``moe_forward``; the small launches
before (publish, wait READY, schedule) and after (signal/wait DONE, combine) are unchanged.

Ring. Routed row tile ``i`` (schedule order, ``i < num_tiles``; a device value) lives in slot
``s = i % NS`` of two rings, generation ``g = i // NS``:

    xs_ring [NS*BM, H]   bf16   its pulled x rows     (rows from sched.row_src[i*BM:(i+1)*BM])
    h_ring  [NS*BM, I]   bf16   silu(x Wg^T) * (x Wu^T)

Counters (int32, one array per rank, zeroed by a memset before each launch; layout below):

    ready[s]     +1 after each fill part of slot s (FS per tile)   (fill   -> gate/up)
    gu_done[s]   +1 per finished gate/up column tile of the slot    (gate/up -> down, and slot free for fill)
    dn_done[s]   +1 per finished down ticket of the slot            (down   -> h slot free for gate/up)
    sh_gu[j]     +1 per finished shared gate/up column tile of x row tile j (shared gate/up -> shared down)

    fill(i, p)   waits gu_done[s] >= G*g        (every gate/up ticket of tile i-NS has read xs slot s)
    gate/up(i,n) waits ready[s] >= FS*(g+1) and dn_done[s] >= D*g (every down tile of tile i-NS read h slot s)
    down(i,n)    waits gu_done[s] >= G*(g+1)
    (G = cdiv(I, BN_gate_up) gate/up tickets per row tile; D = cdiv(H, BN_down) / DN_COLS down tickets per
    row tile, each DN_COLS column tiles in one K loop, ``MoEConfig.fwd_down_cols``.)
    A differentiated forward (SAVE) writes its rows to the full xs buffer (row i*BM), not the ring,
    so there (TILE_READY, ``MoEConfig.fwd_tile_ready``) a fill waits for nothing and signals its own
    tile's counter ``tile_ready[i]``, and gate/up(i, n) waits ``tile_ready[i] >= FS`` instead of
    ``ready[s]``: per slot, a fill of tile i + NS could otherwise count towards tile i. The kernel
    writes these waits and signals in one place each (``_routed_waits``, ``_routed_signal``). Every
    wait is bounded (``sync.wait_geq``, scope gpu): a lost signal becomes an error record
    (ERR_WAIT_TILE / ERR_WAIT_RING_SLOT), never a hang.

Work order: one global ticket sequence in which every producer precedes its consumers. Shared
expert first (no dispatch needed; it covers the wait for the first pulled rows): for x row tile
j = 0..n_sh: [gate/up(j, *)] [down(j-1, *)]. Then the routed tiles in groups of GM consecutive
row tiles (``group_m``; 4 by default): a prologue of fills for groups 0..P-1, then for group
q = 0..: [fills of group q+P] [gate/up(q, *)] [down(q-L, *)], each of the last two column-major
(column tile outer, the GM row tiles inner, so that the row tiles of one expert read a weight
block at the same time, once from HBM; the GROUP_M of the standalone GEMMs). Each fill is FS
tickets of BM/FS rows. Tiles past the last are empty tickets. With NSg = NS / GM ring groups:
P in [0, NSg) (the fills of group q+P wait for the gate/ups of group q+P-NSg, which come
earlier) and L in [1, NSg) (gate/up of group q waits for the downs of group q-NSg, handed out in
stage q-NSg+L < q). The lag L keeps down tiles from being handed out while their gate/ups still
run. Programs take tickets with an atomic counter, so a program only ever waits on a ticket
already taken by a running program: deadlock-free, even when not all programs of the grid are
resident. Under the interpreter program 0 takes every ticket in order. A compute program's
ticket starts with its polls in one round trip (``sync.poll2``: up to two counters, from two
warps) and ends with its signal, in whose fence's shadow the next ticket is taken
(``sync.signal_take``, ``MoEConfig.fwd_ticket_ahead``).

SM split (``COMM`` > 0 programs): programs ``pid < COMM`` take fill tickets from their own
counter, in tile order, and never compute; the others take compute tickets (the order above
without fills). Under the interpreter programs run one after another, so the comm program 0
finishes only if it never has to wait for a slot: num_tiles <= NS (the CPU tests use that).

Memory ordering on the GPU (read off the sm_90 SASS that tests/test_megakernel_compile.py builds;
the GPU tests pass on 2 x H200 with it, bench/results/mega-tests-*.log): a wait polls with an
acquire read (SASS: LDG.E.STRONG.GPU for ``wait_geq``'s poll, ATOMG.E.ADD.STRONG.GPU of 0 for
``poll2``'s; then CCTL.IVALL, which invalidates the SM's L1, so ring rows left in L1 by an earlier
generation are not read stale), then a CTA barrier so every thread's ordinary loads come after it. A signal is a CTA
barrier after the tile's ordinary stores, then, on one thread, MEMBAR.ALL.GPU and the release add
(the pattern of cooperative groups' grid sync). Exception: ``dn_done`` only says that a down
tile has finished reading its h slot, so it is a relaxed add after the barrier
(``sync.add_reads_done``) and does not wait for the rows the tile pushed over NVLink (the DONE
signal after the kernel publishes those). With ``fwd_tma`` the GEMM operands come through TMA
(the async proxy) while the ring is written with ordinary stores: the writer fences
(``fence.proxy.async``) before its release and the reader after its acquire. Compiled at the
kimi-k2 shape, the kernel uses 255 registers with pointer loads and 200 with TMA, no spills; with
half tiles and saved rows (session 5, ``ptxas -v`` at qwen3-30b-a3b) 255 with either, no spills.

Half tiles (``HALF``, ``MoEConfig.fwd_half_tiles``): a row tile whose real rows (a prefix) fit in
BM/2 is computed as a BM/2-row tile by both its gate/up and its down tickets (same columns and K
order, so bitwise the same outputs, half the MMA work); and a fill part that holds only padding
rows is not copied. Padding rows of the ring (or saved xs) then hold stale data, which reaches
only padding rows of h, g | u and y: the GEMMs are row-wise and nothing reads those rows.

Padding tiles (``MoEConfig.fwd_align_tiles``): the schedule pads each expert to a multiple of
``align`` row tiles, so that the row tiles of an expert stay inside one group of the ticket order
(tiles of one expert in two groups read its weights from HBM twice). A padding tile
(``tile_expert`` -1, ``row_src`` all -1) takes its tickets, waits and signals like any other, and
computes nothing.

Row-tile index vs ring row: the tile functions of gemm.py / comm.py address rows as
``tile * BM`` and use ``tile`` for the schedule tables (tile_expert, row_src). Here the tables
are indexed by ``i`` and the data by slot ``s``: the ring bases passed down are shifted by
``(s - i) * BM`` rows, so that row ``i * BM`` of the shifted base is row ``s * BM`` of the ring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import INTERPRET, comm, gemm, sync
from .sync import globaltimer

_ERR_WAIT_TILE = tl.constexpr(sync.ERR_WAIT_TILE)
_ERR_WAIT_RING_SLOT = tl.constexpr(sync.ERR_WAIT_RING_SLOT)
_ERR_WAIT_PEER_READY = tl.constexpr(sync.ERR_WAIT_PEER_READY)
_ERR_WAIT_PEER_DONE = tl.constexpr(sync.ERR_WAIT_PEER_DONE)

# Counter layout (int32 indices): tickets, then per-slot counters, then per-x-row-tile counters.
C_TICKET, C_FILL_TICKET, C_READY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def counter_layout(n_slots: int, n_sh: int, n_tiles: int = 0) -> dict:
    """Indices into the counter array; ``tile_ready`` (``n_tiles`` counters, one per routed row tile)
    is used by a forward that keeps its rows (SAVE with per-tile fill counters, ``fwd_tile_ready``);
    ``programs_done`` counts the programs that have finished (PEERS: the last one signals DONE);
    ``pulled`` is set to 1 by the token pull's copy stream when every peer's x is here (TOKENS)."""
    NS, r = n_slots, C_READY.value
    tr = r + 3 * NS + max(n_sh, 1)
    return dict(ticket=C_TICKET.value, fill_ticket=C_FILL_TICKET.value, ready=r, gu_done=r + NS,
                dn_done=r + 2 * NS, sh_gu=r + 3 * NS, tile_ready=tr, programs_done=tr + n_tiles,
                pulled=tr + n_tiles + 1, total=tr + n_tiles + 2)


# Trace (measurement only, ``MoEConfig.fwd_trace_events``): int64 [programs, TRACE_HEAD + 4 * events].
# Header per program: [tickets taken, globaltimer ns at start, at end, clock64 at start, at end];
# then per ticket [kind code, clock at take, clock after its waits, clock at its end].
TRACE_HEAD = tl.constexpr(8)
# A fill part with a row from another rank is "fill remote" (its loads cross NVLink); "fill": every
# row local (or padding).
TR_FILL, TR_GU, TR_DN, TR_SH_GU, TR_SH_DN, TR_EMPTY, TR_FILL_REMOTE = (tl.constexpr(v) for v in range(7))
TRACE_KINDS = ("fill", "gate/up", "down", "shared gate/up", "shared down", "empty", "fill remote")
LAST_TRACE = None  # the trace of the last traced launch (set by functional.moe; measurement only)
LAST_TRACE_BY_RANK = {}  # ... of each rank (the CPU harness runs ranks as threads of one process)


@triton.jit
def _clock(INTERPRET: tl.constexpr):
    """The SM's cycle counter (0 under the interpreter, which has no clock)."""
    if INTERPRET:
        return tl.zeros((), tl.int64)
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gtime(INTERPRET: tl.constexpr):
    """%globaltimer in ns (0 under the interpreter)."""
    if INTERPRET:
        return tl.zeros((), tl.int64)
    return globaltimer()


@triton.jit
def _trace_ready(rec, TRACE_EV: tl.constexpr, INTERPRET: tl.constexpr):
    """Stamp the end of a ticket's waits (``rec``: its trace record, when tracing)."""
    if TRACE_EV > 0:
        tl.store(rec + 2, _clock(INTERPRET))


@triton.jit
def _decode(t, n, F, G, D, L):
    """Ticket t of a pipeline of n row tiles -> (kind, tile, column): kind 0 fill, 1 gate/up, 2 down.

    Stage s = 0 .. n+L-1: [fill(s): F sub-tickets, column = part] [gate/up(s, 0..G-1)] (s < n)
    [down(s-L, 0..D-1)] (s >= L); stages without any task are skipped. The down lag L >= 1 lets
    a row tile's gate/up tiles finish before its down tiles are handed out, so that the programs
    taking them rarely wait.
    """
    FG = F + G
    FGD = FG + D
    A = tl.minimum(n, L)  # stages with fills and gate/ups only
    B = tl.maximum(n - L, 0)  # stages with all three
    r1 = A * FG
    r2 = r1 + B * FGD
    u2 = tl.maximum(t - r1, 0)
    u3 = tl.maximum(t - r2, 0)
    s = tl.where(t < r1, t // FG, A + u2 // FGD)
    off = tl.where(t < r1, t % FG, u2 % FGD)
    kind = tl.where(off < F, 0, tl.where(off < FG, 1, 2))
    kind = tl.where(t < r2, kind, 2)
    tile = tl.where(t < r2, tl.where(kind == 2, s - L, s), B + u3 // D)
    col = tl.where(t < r2, tl.where(kind == 0, off, tl.where(kind == 1, off - F, off - FG)), u3 % D)
    return kind, tile, col


@triton.jit
def _routed_task(tr, nt, pre, L, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GM: tl.constexpr):
    """Routed ticket tr -> (kind, row tile, column or fill part); row tile >= nt: an empty ticket.

    A prologue of the fills of groups 0..pre-1, then ``_decode``'s stages over groups of GM row
    tiles: [fills of group q+pre] [gate/up of group q] [down of group q-L], the last two
    column-major (column tile outer, row tile of the group inner).
    """
    F1: tl.constexpr = F if F > 0 else 1  # F = 0 (split mode): no fill tickets at all
    ng = (nt + GM - 1) // GM
    kind, q, c = _decode(tl.maximum(tr - pre * GM * F, 0), ng, GM * F, GM * G, GM * D, L)
    i = tl.where(kind == 0, (q + pre) * GM + c // F1, q * GM + c % GM)
    n = tl.where(kind == 0, c % F1, c // GM)
    pro = tr < pre * GM * F  # prologue
    kind = tl.where(pro, 0, kind)
    i = tl.where(pro, tr // F1, i)
    n = tl.where(pro, tr % F1, n)
    return kind, i, n


@triton.jit
def _routed_waits(kind, i, p, NS: tl.constexpr, FS: tl.constexpr, G, D, TR: tl.constexpr = False, tr_base=0,
                  TOK: tl.constexpr = False, n_local=0, pull_idx=0):
    """The ring protocol's waits of routed ticket (kind, row tile i at position p of the order; p = i
    but with TOK), the one place they are written (module docstring): (idx1, target1, idx2, target2)
    into the counters; idx < 0: no wait. The ring slot and generation come from p.
    fill: its slot retired; gate/up: its rows filled and the h slot retired; down: its h rows.
    TR (per-tile fill counters, when the rows go to the full xs buffer): a fill waits for nothing
    (its rows are its own) and gate/up waits for ``tile_ready[i] >= FS`` (at ``tr_base + i``).
    TOK (token pull: no fills): gate/up waits for ``pulled`` (every peer's x copied here) unless its
    position is among the first ``n_local``, whose tiles hold this rank's rows only."""
    s = p % NS
    g = p // NS
    idx1 = tl.where(kind == 0, C_READY + NS + s, tl.where(kind == 1, C_READY + s, C_READY + NS + s))
    target1 = tl.where(kind == 0, G * g, tl.where(kind == 1, FS * (g + 1), G * (g + 1)))
    if TR:
        idx1 = tl.where(kind == 0, -1, tl.where(kind == 1, tr_base + i, idx1))
        target1 = tl.where(kind == 1, FS, target1)
    if TOK:
        idx1 = tl.where(kind == 1, tl.where(p >= n_local, pull_idx, -1), idx1)
        target1 = tl.where(kind == 1, 1, target1)
    idx2 = tl.where(kind == 1, C_READY + 2 * NS + s, -1)
    return idx1, target1, idx2, D * g


@triton.jit
def _routed_signal(kind, i, p, NS: tl.constexpr, TR: tl.constexpr = False, tr_base=0):
    """The counter routed ticket (kind, row tile i at position p) adds 1 to when done: fill -> ready[s]
    (TR: tile_ready[i]), gate/up -> gu_done[s] (both release), down -> dn_done[s] (relaxed: it only
    frees the h slot); s = p % NS."""
    s = p % NS
    fill_idx = C_READY + s
    if TR:
        fill_idx = tr_base + i
    return tl.where(kind == 0, fill_idx, tl.where(kind == 1, C_READY + NS + s, C_READY + 2 * NS + s))


@triton.jit
def _decode_ticket(t, sh_total, n_sh, nt, pre, lag, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   GM: tl.constexpr, GS: tl.constexpr, DS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Ticket t of the compute order -> (is_sh, kind_s, j, n_s, kind, i, n): a shared-expert ticket
    (t < sh_total; kind_s 1 gate/up, 2 down of x row tile j, column n_s) or a routed one
    (``_routed_task``: kind, row tile i, column or fill part n)."""
    is_sh = t < sh_total
    if HAS_SHARED:
        kind_s, j, n_s = _decode(t, n_sh, 0, GS, DS, 1)
    else:
        kind_s, j, n_s = 0, 0, 0
    kind, i, n = _routed_task(t - sh_total, nt, pre, lag, F, G, D, GM)
    return is_sh, kind_s, j, n_s, kind, i, n


@triton.jit
def _ticket_waits(is_sh, kind_s, j, kind, p, nt, G: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                  NS: tl.constexpr, FS: tl.constexpr, TR: tl.constexpr, tr_base, SH_IDX,
                  TOK: tl.constexpr = False, n_local=0, pull_idx=0):
    """The counters a decoded ticket (``_decode_ticket``; p: its position in the routed order, the row
    tile itself but with TOK, whose waits need no tile) waits for, (idx1, target1, idx2, target2) as
    ``_routed_waits`` (index -1: none): a shared down tile waits for its gate/up tiles, a shared
    gate/up tile and an empty ticket (past the last row tile) for nothing."""
    w1, t1, w2, t2 = _routed_waits(kind, p, p, NS, FS, G, D, TR, tr_base, TOK, n_local, pull_idx)
    w1 = tl.where(is_sh, tl.where(kind_s == 2, SH_IDX + j, -1), tl.where(p < nt, w1, -1))
    t1 = tl.where(is_sh, GS, t1)
    w2 = tl.where(is_sh | (p >= nt), -1, w2)
    return w1, t1, w2, t2


@triton.jit
def _wait(cnt_ptr, idx, target, wait_budget, err_ptr, code, rank, epoch, TMA: tl.constexpr = False, ready=0):
    """Wait for ``cnt_ptr[idx] >= target`` unless ``ready`` (the ticket's first polls,
    ``sync.poll2``, already saw every counter of the ticket there) or idx < 0 (no wait: the
    protocol's "none", ``_routed_waits``). Session 15: without the idx check a token-pull tile of
    this rank's rows (idx1 = -1) whose first polls missed its other counter spun on the word before
    the counters, another allocation's: right or a timed-out wait by the process's history."""
    if (ready == 0) & (idx >= 0):
        sync.wait_geq(cnt_ptr + idx, target, wait_budget, err_ptr, code, rank, idx, epoch, "gpu")
    tl.debug_barrier()  # the acquire of the polling thread orders the reads of every thread after it
    if TMA:  # ... and the TMA (async-proxy) reads of what the producer wrote with ordinary stores
        sync.fence_proxy_async()


@triton.jit
def _fill(i, part, cnt_ptr, row_src, x_ptrs, xs_ring, TK, k, wait_budget, err_ptr, rank, epoch,
          NS: tl.constexpr, G, H: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, FS: tl.constexpr,
          ABLATE: tl.constexpr = 0, TMA: tl.constexpr = False, SAVE: tl.constexpr = False, w_ptrs=None,
          row_w=None, rec=None, TRACE_EV: tl.constexpr = 0, INTERPRET: tl.constexpr = False,
          STAGES: tl.constexpr = 1, ready=0, SIGNAL: tl.constexpr = True, W=1, WP: tl.constexpr = 0,
          TR: tl.constexpr = False, tr_base=0, LOCAL_A: tl.constexpr = False):
    """Pull part ``part`` (BM // FS rows) of row tile i into its ring slot (SAVE: into row i*BM of
    the full xs buffer, with the rows' router weights into row_w); STAGES: the column loop's
    pipeline stages, W / WP: ranks and the address tables' padded length (``comm.pull_rows_tile``);
    TR: per-tile fill counters (``_routed_waits``; no wait). LOCAL_A: this rank's rows are not copied
    (the gate/up tiles read them from x; their router weights are still kept)."""
    s = i % NS
    if not TR:
        w1, t1, _, _ = _routed_waits(0, i, i, NS, FS, G, 0)
        _wait(cnt_ptr, w1, t1, wait_budget, err_ptr, _ERR_WAIT_RING_SLOT, rank, epoch, False, ready)
    _trace_ready(rec, TRACE_EV, INTERPRET)
    if TRACE_EV > 0:  # local or remote rows (measurement only: these loads exist only when tracing)
        rs = tl.load(row_src + (i * FS + part) * (BM // FS) + tl.arange(0, BM // FS))
        n_remote = tl.sum(((rs >= 0) & (rs // TK != rank)).to(tl.int32), axis=0)
        tl.store(rec, tl.where(n_remote > 0, TR_FILL_REMOTE, TR_FILL).to(tl.int64))
    if (ABLATE & 1) == 0:
        # rows i*BM + part*BM/FS .. : "tile" i*FS + part of height BM // FS. A part of padding rows
        # only (real rows are a prefix of the tile) is not written at all (SKIP_EMPTY): whatever its
        # rows hold reaches only padding rows of h, g | u and y, which nothing reads (the GEMMs are
        # row-wise, the pushes and the backward's weight gradients take real rows only).
        if SAVE:
            comm.pull_rows_tile(i * FS + part, row_src, x_ptrs, xs_ring, H, TK, k, w_ptrs, row_w, BM // FS, BH,
                                True, (H % 8) == 0, STAGES, W, WP, True, LOCAL_A, rank)
        else:
            dst = xs_ring + (s - i).to(tl.int64) * (BM * H)  # row i*BM of dst = row s*BM of the ring
            comm.pull_rows_tile(i * FS + part, row_src, x_ptrs, dst, H, TK, k, x_ptrs, xs_ring, BM // FS, BH,
                                False, (H % 8) == 0, STAGES, W, WP, True, LOCAL_A, rank)
    if TMA:  # the gate/up tiles read these rows through TMA (the async proxy)
        sync.fence_proxy_async()
    if SIGNAL:  # else the caller signals (sync.signal_take)
        sync.add_release(cnt_ptr + _routed_signal(0, i, i, NS, TR, tr_base), 1, "gpu")


@triton.jit
def _down_cols(blk, c0, e, hh, w_down, sd_e, sd_n, row_src, tile_expert, num_tiles, y_ptrs, TK,
               H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               NC: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr, h_desc, wd_desc, shift,
               TILE_M: tl.constexpr = 0, EARLY: tl.constexpr = False, cnt_ptr=None, NW: tl.constexpr = 4):
    """Down column tiles c0 .. c0+NC-1 of row block blk (BM rows; a half tile: blk = 2i, TILE_M = 2BM),
    pushed to their origins. With TMA one K loop runs over all NC columns (``gemm.push_col_tiles_tma``);
    pointer loads run the column tiles one after another. EARLY (with TMA): the next ticket is taken
    before the last column's push; returns what it gave (``sync.take_issue``)."""
    got = tl.zeros((32 * NW,), tl.int32)
    if TMA:
        got = gemm.push_col_tiles_tma(blk, c0, e, h_desc, wd_desc, row_src, y_ptrs, TK, H, H, I, BM, BN, BK, NC,
                                      tl.bfloat16, INTERPRET, shift, EARLY, cnt_ptr, C_TICKET, NW)
    else:
        pid_m = blk
        if TILE_M > 0:
            pid_m = blk // (TILE_M // BM)
        for c in range(0, NC):
            gemm.rows_gemm_tile(pid_m, c0 + c, h_desc, wd_desc, hh, hh, I, w_down, w_down, sd_e, sd_e, sd_n,
                                hh, 0, row_src, y_ptrs, TK, H, tile_expert, num_tiles,
                                H, I, 0, BM, BN, BK, True, False, I % BK == 0, True, tl.bfloat16,
                                False, INTERPRET, shift, TILE_M)
    return got


@triton.jit
def _local_a_rows(i, row_src, xs, x_rows, TK, k, rank, H: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
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
def _compute_task(kind, i, n, cnt_ptr, xs_ring, h_ring, w_gate, w_up, sg_e, sg_n, w_down, sd_e, sd_n,
                  row_src, tile_expert, num_tiles, y_ptrs, TK, wait_budget, err_ptr, rank, epoch,
                  NS: tl.constexpr, G, D, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                  BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_DN: tl.constexpr, BK_DN: tl.constexpr,
                  INTERPRET: tl.constexpr, FS: tl.constexpr, ABLATE: tl.constexpr = 0,
                  TMA: tl.constexpr = False, xs_desc=None, wg_desc=None, wu_desc=None, h_desc=None, wd_desc=None,
                  SAVE: tl.constexpr = False, gu_save=None, HALF: tl.constexpr = False, xs_half_desc=None,
                  h_half_desc=None, rec=None, TRACE_EV: tl.constexpr = 0, DN_COLS: tl.constexpr = 1, ready=0,
                  TR: tl.constexpr = False, tr_base=0, LOCAL_A: tl.constexpr = False, x_rows=None, k=1,
                  EARLY: tl.constexpr = False, NW: tl.constexpr = 4, p=0, TOKENS: tl.constexpr = False,
                  n_local=0, pull_idx=0):
    """A gate/up (kind 1) ticket of routed row tile i (at position p of the order: its ring slot is
    p % NS; p = i but with TOKENS, whose A rows come from x and the pulled tokens ``xs_ring``
    [W*T, H]), column tile n, or a down (kind 2) ticket of
    row tile i, column tiles n*DN_COLS .. n*DN_COLS+DN_COLS-1 (``rec``: its trace record when
    TRACE_EV > 0). G and D count tickets per row tile. The caller signals the ticket's end
    (``_routed_signal``, ``sync.signal_take``). EARLY (``MoEConfig.fwd_early_ticket``; TMA): the
    GEMM takes the program's next ticket between its K loop and its epilogue; returns (what
    ``sync.take_issue`` gave, whether it was taken: not when no GEMM ran).

    What the schedule says of the tile (its expert, whether it is a half tile) is read before the
    task's own waits (the schedule was written before the launch), so those loads overlap them. With
    the loop's ``sync.poll2`` (the default) the polls come earlier, and these loads after them; loading
    them before the loop's polls measured no faster (session 9, ``fwd_preload_tile``, since removed)."""
    s = p % NS
    got = tl.zeros((32 * NW,), tl.int32)
    taken = tl.zeros((), tl.int32)
    # < 0: a padding tile (the schedule pads experts to a multiple of its ``align`` tiles): no MMA,
    # only its waits and signals, which the ring protocol counts
    first_row = tl.load(row_src + i * BM)
    if HALF:
        half_row = tl.load(row_src + i * BM + BM // 2)  # < 0: the real rows fit in the first BM/2
    shift = (s - i) * BM  # row i*BM of a shifted ring base (or TMA coordinate) is row s*BM of the ring
    if SAVE or TOKENS:  # xs is the full routed-row buffer (row i*BM) or the tokens, not a ring
        xs_shift = shift * 0
    else:
        xs_shift = shift
    if kind == 1:  # gate/up column tile n of row tile i
        w1, t1, w2, t2 = _routed_waits(1, i, p, NS, FS, G, D, TR, tr_base, TOKENS, n_local, pull_idx)
        code1 = _ERR_WAIT_TILE
        if TOKENS:  # (the wait for the peers' tokens)
            code1 = _ERR_WAIT_PEER_READY
        _wait(cnt_ptr, w1, t1, wait_budget, err_ptr, code1, rank, epoch, TMA, ready)
        _wait(cnt_ptr, w2, t2, wait_budget, err_ptr, _ERR_WAIT_RING_SLOT, rank, epoch, False, ready)
        _trace_ready(rec, TRACE_EV, INTERPRET)
        xs = xs_ring + xs_shift.to(tl.int64) * H
        hh = h_ring + shift.to(tl.int64) * I
        if SAVE:  # g | u for the backward, at row i*BM of the full buffer
            gu_out = gu_save
        else:
            gu_out = hh  # unused
        if (ABLATE & 2) == 0:
            # HALF: a tile whose real rows (a prefix) fit in its first BM/2 computes only those.
            # (Two nested ifs, not a flag: without HALF the half-tile code is not compiled at all.)
            full = first_row >= 0
            if HALF:
                if (half_row < 0) & (first_row >= 0):
                    full = False
                    a_half = None
                    if LOCAL_A:
                        a_half = _local_a_rows(i, row_src, xs, x_rows, TK, k, rank, H, BM, BM // 2, TOKENS)
                    got = gemm.gate_up_swiglu_tile(i, n, xs, H, w_gate, w_up, sg_e, sg_n, hh, I, gu_out,
                                                   2 * I, tile_expert, num_tiles, H, I, BM // 2, BN_GU, BK_GU,
                                                   H % BK_GU == 0, SAVE, INTERPRET, 0, False, TMA, xs_half_desc,
                                                   wg_desc, wu_desc, xs_shift, BM, LOCAL_A, a_half,
                                                   EARLY, cnt_ptr, C_TICKET, NW)
                    taken = tl.zeros((), tl.int32) + EARLY
            if full:
                a_full = None
                if LOCAL_A:
                    a_full = _local_a_rows(i, row_src, xs, x_rows, TK, k, rank, H, BM, BM, TOKENS)
                got = gemm.gate_up_swiglu_tile(i, n, xs, H, w_gate, w_up, sg_e, sg_n, hh, I, gu_out,
                                               2 * I, tile_expert, num_tiles, H, I, BM, BN_GU, BK_GU, H % BK_GU == 0,
                                               SAVE, INTERPRET, 0, False, TMA, xs_desc, wg_desc, wu_desc, xs_shift,
                                               0, LOCAL_A, a_full, EARLY, cnt_ptr, C_TICKET, NW)
                taken = tl.zeros((), tl.int32) + EARLY
        if TMA:  # the down tiles read h through TMA (fenced before the caller's release)
            sync.fence_proxy_async()
    else:  # down column tiles of row tile i, rows pushed to their origins
        e = tl.load(tile_expert + i)  # -1 for a padding tile, which computes nothing below
        w1, t1, _, _ = _routed_waits(2, i, p, NS, FS, G, D)
        _wait(cnt_ptr, w1, t1, wait_budget, err_ptr, _ERR_WAIT_TILE, rank, epoch, TMA, ready)
        _trace_ready(rec, TRACE_EV, INTERPRET)
        hh = h_ring + shift.to(tl.int64) * I
        if (ABLATE & 2) == 0:
            full = first_row >= 0
            if HALF:
                if (half_row < 0) & (first_row >= 0):
                    full = False
                    got = _down_cols(i * 2, n * DN_COLS, e, hh, w_down, sd_e, sd_n, row_src, tile_expert, num_tiles,
                                     y_ptrs, TK, H, I, BM // 2, BN_DN, BK_DN, DN_COLS, TMA, INTERPRET, h_half_desc,
                                     wd_desc, shift, BM, EARLY, cnt_ptr, NW)
                    taken = tl.zeros((), tl.int32) + EARLY
            if full:
                got = _down_cols(i, n * DN_COLS, e, hh, w_down, sd_e, sd_n, row_src, tile_expert, num_tiles,
                                 y_ptrs, TK, H, I, BM, BN_DN, BK_DN, DN_COLS, TMA, INTERPRET, h_desc, wd_desc, shift,
                                 0, EARLY, cnt_ptr, NW)
                taken = tl.zeros((), tl.int32) + EARLY
    return got, taken


@triton.jit
def _shared_task(kind, j, n, cnt_ptr, x, T, s_gate, s_up, s_down, h_sh, extra, sh_tiles, sh_n,
                 wait_budget, err_ptr, rank, epoch, SH_IDX: tl.constexpr, GS,
                 H: tl.constexpr, IS: tl.constexpr, BM: tl.constexpr,
                 BN_GUS: tl.constexpr, BK_GUS: tl.constexpr, BN_DNS: tl.constexpr, BK_DNS: tl.constexpr,
                 INTERPRET: tl.constexpr, TMA: tl.constexpr = False, x_desc=None, sg_desc=None, su_desc=None,
                 hsh_desc=None, sd_desc=None, rec=None, TRACE_EV: tl.constexpr = 0, ready=0):
    """Shared expert over x row tile j: gate/up (kind 1) into h_sh, down (kind 2) into extra (local).
    The caller signals a gate/up tile's end (sh_gu[j], ``sync.signal_take``)."""
    if kind == 1:
        gemm.gate_up_swiglu_tile(j, n, x, H, s_gate, s_up, 0, H, h_sh, IS, h_sh, 0, sh_tiles, sh_n,
                                 H, IS, BM, BN_GUS, BK_GUS, H % BK_GUS == 0, False, INTERPRET,
                                 T, True, TMA, x_desc, sg_desc, su_desc)
        if TMA:  # the shared down tiles read h_sh through TMA (fenced before the caller's release)
            sync.fence_proxy_async()
    else:
        _wait(cnt_ptr, SH_IDX + j, GS, wait_budget, err_ptr, _ERR_WAIT_TILE, rank, epoch, TMA, ready)
        _trace_ready(rec, TRACE_EV, INTERPRET)
        gemm.rows_gemm_tile(j, n, hsh_desc, sd_desc, h_sh, h_sh, IS, s_down, s_down, 0, 0, IS,
                            extra, H, sh_tiles, sh_tiles, 1, 0, sh_tiles, sh_n,
                            H, IS, 0, BM, BN_DNS, BK_DNS, True, False, IS % BK_DNS == 0, False, tl.bfloat16,
                            TMA, INTERPRET)


@triton.jit
def moe_fwd_megakernel(cnt_ptr, err_ptr, epoch_ptr, rank, wait_budget,
                       row_src, tile_expert, num_tiles, x_ptrs, y_ptrs, TK, k,
                       xs_ring, h_ring, w_gate, w_up, wg_e, wg_n, w_down, wd_e, wd_n,
                       x, T, s_gate, s_up, s_down, h_sh, extra, sh_tiles, sh_n, n_sh,
                       pre, lag, xs_desc, wg_desc, wu_desc, h_desc, wd_desc, x_desc, sg_desc, su_desc, hsh_desc,
                       sd_desc, xs_half_desc, h_half_desc, w_ptrs, row_w, gu_save, NS: tl.constexpr, FS: tl.constexpr, GM: tl.constexpr, COMM: tl.constexpr,
                       HAS_SHARED: tl.constexpr,
                       H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr,
                       BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_DN: tl.constexpr, BK_DN: tl.constexpr,
                       BN_GUS: tl.constexpr, BK_GUS: tl.constexpr, BN_DNS: tl.constexpr, BK_DNS: tl.constexpr,
                       INTERPRET: tl.constexpr, ABLATE: tl.constexpr = 0, TMA: tl.constexpr = False,
                       SAVE: tl.constexpr = False, HALF: tl.constexpr = False, trace=None,
                       TRACE_EV: tl.constexpr = 0, DN_COLS: tl.constexpr = 1, FILL_STAGES: tl.constexpr = 1,
                       AHEAD: tl.constexpr = True, NW: tl.constexpr = 4, POLL2: tl.constexpr = True,
                       W=1, WP: tl.constexpr = 0, TILE_READY: tl.constexpr = False,
                       flag_ptrs=None, my_flags=None, done_idx=0, PEERS: tl.constexpr = False,
                       X_SLOT: tl.constexpr = 0, DONE_SLOT: tl.constexpr = 0, DONE_WAIT: tl.constexpr = False,
                       LOCAL_A: tl.constexpr = False, x_rows=None, EARLY: tl.constexpr = False,
                       TOKENS: tl.constexpr = False, tile_order=None, local_tiles=None, pull_idx=0,
                       X_PULL: tl.constexpr = 0):
    """One persistent launch of the routed forward (and the shared expert); see the module docstring.

    TMA: every GEMM operand is loaded through the tensor descriptors (``*_desc``; None otherwise)
    instead of pointer tensors: ring rows cross from ordinary stores to TMA loads with a proxy
    fence on each side (``sync.fence_proxy_async``).

    SAVE (a forward that a backward follows): the fills write the full routed-row buffer
    ``xs_ring`` [R, H] (row i*BM, not a ring slot) and the rows' router weights ``row_w`` [R] fp32
    (from every rank's ``w_ptrs`` table), the gate/up tiles also store g | u into ``gu_save``
    [R, 2I]: what the sync-free forward keeps, so the backward need not recompute them.

    HALF: a routed row tile whose real rows fit in its first BM/2 (``row_src[i*BM + BM/2] < 0``; an
    expert's last tile) is computed as a BM/2-row tile: its gate/up and down tickets do half the
    MMA work (through ``xs_half_desc`` / ``h_half_desc`` with TMA). The skipped rows (h, and g | u
    with SAVE) are padding rows, left as they are: nothing reads them (module docstring).

    ABLATE (measurement only; the output is then wrong): bit 1 skips the row copies of the fills,
    bit 2 the GEMM math of the routed tiles, bit 4 (host side: ``y_ptrs`` all this rank's) pushes
    every row into the local buffer; every wait and signal stays, so the time of a variant
    shows what the remaining stages cost under the same schedule.

    TRACE_EV > 0 (measurement only): each program records its first TRACE_EV tickets into
    ``trace`` (layout at ``TRACE_HEAD``): kind, and the cycle counter when taken, after its waits
    and at its end.

    POLL2: a compute ticket's first polls go out together (``sync.poll2``; NW: warps per program).
    W, WP: ranks and a power of two >= W: a fill loads the address tables whole, in the round trip of
    its row sources (``comm.pull_rows_tile``; WP = 0: each row's entry after its source).
    TILE_READY (with SAVE only): per-tile fill counters (``tile_ready`` in ``counter_layout``): the
    fills write rows of their own (row i*BM of the full buffer), so they wait for no ring slot.
    PEERS (``MoEConfig.fwd_peer_flags``): the pass's x-ready and DONE flags are set and waited for
    here instead of by launches around the kernel. Program 0 first sets this rank's X_SLOT flag on
    every rank (x_pub was copied before the launch), and every program waits for every rank's
    before its first ticket (fills read peers' x_pub). At the end each program counts itself done
    (``programs_done``, acq_rel at system scope after its pushes); the last one sets DONE_SLOT on
    every rank (all rows pushed, no more reads of peers' x_pub) and, with DONE_WAIT, waits for
    every rank's DONE, so the combine may follow in stream order. (DONE_WAIT off under the
    interpreter, where ranks' launches cannot run at once: the host polls instead.)
    LOCAL_A (``MoEConfig.fwd_local_rows``; with TMA): the fills copy only rows from other ranks, and
    the gate/up tiles gather their A rows through pointers (``_local_a_rows``): this rank's from
    ``x_rows`` (its input), the others from xs; the weights still come through TMA. With SAVE the
    kept xs then lacks this rank's rows (the backward copies them in from x).
    AHEAD: a compute program takes its next ticket in the shadow of the current one's release fence
    (``sync.signal_take``) rather than after it. (Taking it before starting the current ticket was
    measured, and is much slower: the ticket then waits a whole tile for its program, and the
    tickets behind it wait for it: qwen3.5-397b 4096 2.93 -> 3.62 ms.)
    EARLY (``MoEConfig.fwd_early_ticket``; TMA, no comm programs): the GEMM tickets take the next
    ticket between their K loop and their epilogue, and its polls go out before the current
    ticket's release (the loop's end), so the take's and the polls' round trips overlap the
    epilogue and the release's fence instead of following them.
    TOKENS (``MoEConfig.fwd_pull_tokens``; with LOCAL_A and PEERS, no comm programs): no fills. A copy
    engine copies every peer's x_pub whole into ``xs_ring`` [W*T, H] (row src*T + t) beside the
    kernel and sets counter ``pull_idx`` to 1 when done (the host queues it on a side stream:
    ``streamops``); gate/up gathers every A row from x or those tokens. The routed tiles go in the
    schedule's ``tile_order`` (tiles of this rank's rows only first, ``local_tiles`` of them), so the
    others, which wait for ``pulled``, come when the copy has had time; a ticket's position p
    (its ring slot) and its tile ``tile_order[p]`` then differ. The peers' copy streams wait for
    flag X_PULL, which the host's stream sets on every peer once x_pub is published, before this
    launch: nothing the copies wait for comes from a kernel, so a copy stream that shares the
    kernel stream's hardware queue only delays the launch. No program waits for the peers' x-ready
    flags: this rank reads no peer's x_pub, and pushes to a peer only from tiles that waited for
    ``pulled``, which follows the peer's flag. The last program waits for ``pulled`` before DONE
    (the copy reads the peers' x_pub until then).
    """
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    if PEERS:
        if pid == 0:
            comm._signal_peers(flag_ptrs, epoch, X_SLOT, rank, W)
        if not TOKENS:
            comm._wait_peers(my_flags, epoch, X_SLOT, rank, W, wait_budget, err_ptr, _ERR_WAIT_PEER_READY)
            tl.debug_barrier()  # the polling thread's acquire orders every thread's reads of peers' x_pub
    nt = tl.load(num_tiles)
    n_local = 0
    if TOKENS:
        n_local = tl.load(local_tiles)
    G: tl.constexpr = (I + BN_GU - 1) // BN_GU  # gate/up tickets per row tile
    D: tl.constexpr = (H + BN_DN - 1) // BN_DN // DN_COLS  # down tickets per row tile (DN_COLS divides)
    GS: tl.constexpr = (IS + BN_GUS - 1) // BN_GUS
    DS: tl.constexpr = (H + BN_DNS - 1) // BN_DNS
    F: tl.constexpr = 0 if (COMM > 0 or TOKENS) else FS  # fill sub-tickets per stage
    SH_IDX: tl.constexpr = C_READY + 3 * NS
    TR: tl.constexpr = SAVE and TILE_READY and not TOKENS
    tr_base = SH_IDX + tl.maximum(n_sh, 1)  # counter_layout's tile_ready
    if HAS_SHARED:
        sh_total = n_sh * (GS + DS)
    else:
        sh_total = 0
    if COMM > 0:
        pre = 0
    ng = (nt + GM - 1) // GM  # groups of GM row tiles
    total = sh_total + pre * GM * F + ng * GM * (F + G + D)
    ev = 0  # tickets taken (TRACE_EV)
    rec = trace
    if TRACE_EV > 0:
        head = trace + pid.to(tl.int64) * (TRACE_HEAD + 4 * TRACE_EV)
        tl.store(head + 1, _gtime(INTERPRET))
        tl.store(head + 3, _clock(INTERPRET))
    if pid < COMM:  # communication program: fills only, in tile order
        f = tl.atomic_add(cnt_ptr + C_FILL_TICKET, 1, sem="relaxed", scope="gpu")
        while f < nt * FS:
            if TRACE_EV > 0:
                rec = head + TRACE_HEAD + 4 * tl.minimum(ev, TRACE_EV - 1)
                tl.store(rec, TR_FILL)
                tl.store(rec + 1, _clock(INTERPRET))
            _fill(f // FS, f % FS, cnt_ptr, row_src, x_ptrs, xs_ring, TK, k, wait_budget, err_ptr, rank, epoch,
                  NS, G, H, BM, BH, FS, ABLATE, TMA, SAVE, w_ptrs, row_w, rec, TRACE_EV, INTERPRET, FILL_STAGES,
                  0, True, W, WP, TR, tr_base, LOCAL_A)
            if TRACE_EV > 0:
                tl.store(rec + 3, _clock(INTERPRET))
                ev += 1
            f = tl.atomic_add(cnt_ptr + C_FILL_TICKET, 1, sem="relaxed", scope="gpu")
    else:
        t = tl.atomic_add(cnt_ptr + C_TICKET, 1, sem="relaxed", scope="gpu")
        if EARLY:  # the first ticket's polls; later ones are polled at the end of the ticket before
            fsh, fks, fj, _, fk, fi, _ = _decode_ticket(t, sh_total, n_sh, nt, pre, lag, F, G, D, GM, GS, DS,
                                                        HAS_SHARED)
            fw1, ft1, fw2, ft2 = _ticket_waits(fsh, fks, fj, fk, fi, nt, G, D, GS, NS, FS, TR, tr_base, SH_IDX,
                                               TOKENS, n_local, pull_idx)
            ready = sync.poll2(cnt_ptr, fw1, ft1, fw2, ft2, NW).to(tl.int32)
        while t < total:
            if TRACE_EV > 0:  # kind TR_EMPTY unless a task overwrites it; "ready" = taken unless it waits
                rec = head + TRACE_HEAD + 4 * tl.minimum(ev, TRACE_EV - 1)
                c0 = _clock(INTERPRET)
                tl.store(rec, TR_EMPTY)
                tl.store(rec + 1, c0)
                tl.store(rec + 2, c0)
            # What the ticket is, the counters it waits for (index -1: none; polled together in one
            # round trip) and the counter it signals at its end
            is_sh, kind_s, j, n_s, kind, p, n = _decode_ticket(t, sh_total, n_sh, nt, pre, lag, F, G, D, GM, GS, DS,
                                                               HAS_SHARED)
            i = p  # the row tile at position p of the routed order
            if TOKENS:
                i = tl.load(tile_order + p, mask=(p < nt) & (~is_sh), other=0)
            if not EARLY:
                w1, t1, w2, t2 = _ticket_waits(is_sh, kind_s, j, kind, p, nt, G, D, GS, NS, FS, TR, tr_base, SH_IDX,
                                               TOKENS, n_local, pull_idx)
                if POLL2:
                    ready = sync.poll2(cnt_ptr, w1, t1, w2, t2, NW).to(tl.int32)
                else:  # each wait polls on its own (one round trip after the other)
                    ready = tl.zeros((), tl.int32)
            sig = tl.where(is_sh, tl.where(kind_s == 1, SH_IDX + j, -1),
                           tl.where(p < nt, _routed_signal(kind, i, p, NS, TR, tr_base), -1))
            # Release, except a down tile's: dn_done only frees the h slot (its reads are done), and the
            # rows it pushed need no ordering here (the DONE signal after the kernel publishes them), so
            # its signal does not wait for the NVLink stores (relaxed, as sync.add_reads_done)
            release = (is_sh | (kind != 2)).to(tl.int32)
            got = tl.zeros((32 * NW,), tl.int32)
            taken = tl.zeros((), tl.int32)
            if is_sh:
                if HAS_SHARED:
                    if TRACE_EV > 0:
                        tl.store(rec, TR_SH_GU + kind_s - 1)
                    _shared_task(kind_s, j, n_s, cnt_ptr, x, T, s_gate, s_up, s_down, h_sh, extra, sh_tiles, sh_n,
                                 wait_budget, err_ptr, rank, epoch, SH_IDX, GS, H, IS, BM,
                                 BN_GUS, BK_GUS, BN_DNS, BK_DNS, INTERPRET, TMA, x_desc, sg_desc, su_desc,
                                 hsh_desc, sd_desc, rec, TRACE_EV, ready)
            else:
                if p < nt:  # else past the last row tile: a partial last group, or fills beyond the end
                    if TRACE_EV > 0:
                        tl.store(rec, kind)  # TR_FILL, TR_GU, TR_DN
                    if kind == 0:
                        _fill(i, n, cnt_ptr, row_src, x_ptrs, xs_ring, TK, k, wait_budget, err_ptr, rank, epoch,
                              NS, G, H, BM, BH, FS, ABLATE, TMA, SAVE, w_ptrs, row_w, rec, TRACE_EV, INTERPRET,
                              FILL_STAGES, ready, False, W, WP, TR, tr_base, LOCAL_A)
                    else:
                        got, taken = _compute_task(
                            kind, i, n, cnt_ptr, xs_ring, h_ring, w_gate, w_up, wg_e, wg_n, w_down,
                            wd_e, wd_n, row_src, tile_expert, num_tiles, y_ptrs, TK, wait_budget,
                            err_ptr, rank, epoch, NS, G, D, H, I, BM, BN_GU, BK_GU, BN_DN, BK_DN,
                            INTERPRET, FS, ABLATE, TMA, xs_desc, wg_desc, wu_desc, h_desc, wd_desc,
                            SAVE, gu_save, HALF, xs_half_desc, h_half_desc, rec, TRACE_EV, DN_COLS,
                            ready, TR, tr_base, LOCAL_A, x_rows, k, EARLY, NW, p, TOKENS, n_local, pull_idx)
            if EARLY:
                # The next ticket was taken between the GEMM's K loop and its epilogue (else now), so
                # its round trip ran behind the epilogue; its polls go out before this ticket's
                # release, whose fence then overlaps their round trip. A poll that misses (e.g. a down
                # ticket of this very row tile) waits after the signal, in the task: deadlock-free.
                if taken == 0:
                    got = sync.take_issue(cnt_ptr, C_TICKET, NW)
                t = sync.take_resolve(got, NW)  # a CTA barrier: every thread's stores are issued
                psh, pks, pj, _, pk, pi, _ = _decode_ticket(t, sh_total, n_sh, nt, pre, lag, F, G, D, GM, GS, DS,
                                                            HAS_SHARED)
                pw1, pt1, pw2, pt2 = _ticket_waits(psh, pks, pj, pk, pi, nt, G, D, GS, NS, FS, TR, tr_base, SH_IDX,
                                                   TOKENS, n_local, pull_idx)
                pw1 = tl.where(t < total, pw1, -1)  # past the last ticket: nothing to poll
                pw2 = tl.where(t < total, pw2, -1)
                seen = sync.poll2_issue(cnt_ptr, pw1, pw2, NW)
                tl.debug_barrier()
                sync.signal(cnt_ptr, sig, release)
                ready = sync.poll2_resolve(seen, pw1, pt1, pw2, pt2, NW).to(tl.int32)
            else:
                t = sync.signal_take(cnt_ptr, sig, release, C_TICKET, AHEAD, NW)
            if TRACE_EV > 0:
                tl.store(rec + 3, _clock(INTERPRET))
                ev += 1
    if PEERS:
        tl.debug_barrier()  # every thread's pushes issued
        # system scope: the count orders this program's pushes (some over NVLink) before the last
        # program's release to the peers (cumulativity through the counter's read-modify-writes)
        done = tl.atomic_add(cnt_ptr + done_idx, 1, sem="acq_rel", scope="sys")
        if done == tl.num_programs(0) - 1:
            if TOKENS:  # the copy engine reads the peers' x_pub until it sets ``pulled``
                seen = sync.wait_geq(cnt_ptr + pull_idx, 1, wait_budget, err_ptr, _ERR_WAIT_PEER_READY, rank,
                                     pull_idx, epoch, "sys")
                if seen < 1:  # a peer never published (error recorded): release the copy stream's waits
                    for src in range(W):
                        sync.store_release(my_flags + X_PULL * W + src, 1, "sys")
            comm._signal_peers(flag_ptrs, epoch, DONE_SLOT, rank, W)
            if DONE_WAIT:
                comm._wait_peers(my_flags, epoch, DONE_SLOT, rank, W, wait_budget, err_ptr, _ERR_WAIT_PEER_DONE)
    if TRACE_EV > 0:
        tl.store(head, ev)
        tl.store(head + 2, _gtime(INTERPRET))
        tl.store(head + 4, _clock(INTERPRET))


# --------------------------------------------------------------------------------------------
# Host side: per-rank buffers (allocated once) and the launcher
# --------------------------------------------------------------------------------------------

@dataclass
class MegaBuffers:
    """Per-rank buffers of the forward megakernel (local, not symmetric), allocated once per shape."""

    n_slots: int
    n_sh: int
    n_tiles: int  # per-tile fill counters allocated (counter_layout's n_tiles)
    counters: torch.Tensor  # int32 [counter_layout(...)["total"]]
    xs_ring: torch.Tensor  # [n_slots * BM, H]
    h_ring: torch.Tensor  # [n_slots * BM, I]
    h_sh: torch.Tensor | None  # [n_sh * BM, I_s]
    extra: torch.Tensor | None  # [n_sh * BM, H]: shared expert output (rows >= T unused)
    sh_tiles: torch.Tensor  # int32 [max(n_sh, 1)] zeros: the shared expert is "expert 0" of every x row tile
    sh_n: torch.Tensor  # int32 [1] = n_sh

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counters, self.xs_ring, self.h_ring, self.h_sh,
                                                          self.extra, self.sh_tiles, self.sh_n) if t is not None)


def alloc_mega(T, H, I, I_s, BM, ring_rows, dtype, device, n_tiles: int = 0) -> MegaBuffers:
    """``n_tiles``: per-tile fill counters to allocate (the schedule's ``n_tiles_max``; 0: none)."""
    n_slots = ring_rows // BM
    if n_slots < 2:
        raise ValueError(f"the forward megakernel needs at least two ring slots: ring_rows={ring_rows} "
                         f"// tile_m={BM} = {n_slots}")
    n_sh = triton.cdiv(T, BM) if I_s else 0
    lay = counter_layout(n_slots, n_sh, n_tiles)
    i32 = dict(dtype=torch.int32, device=device)
    return MegaBuffers(
        n_slots=n_slots, n_sh=n_sh, n_tiles=n_tiles,
        # one guard word before the counters, always 0: a stray wait on index -1 then always times
        # out with an error record instead of reading a neighbour's memory (session 15)
        counters=torch.zeros(lay["total"] + 1, **i32)[1:],
        xs_ring=torch.empty(n_slots * BM, H, dtype=dtype, device=device),
        h_ring=torch.empty(n_slots * BM, I, dtype=dtype, device=device),
        h_sh=torch.empty(n_sh * BM, I_s, dtype=dtype, device=device) if I_s else None,
        extra=torch.empty(n_sh * BM, H, dtype=dtype, device=device) if I_s else None,
        sh_tiles=torch.zeros(max(n_sh, 1), **i32),
        sh_n=torch.full((1,), n_sh, **i32),
    )


def default_programs(device) -> int:
    if INTERPRET or device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_group_m(n_slots: int, max_group: int = 4) -> int:
    """Row tiles per ticket group when not configured: the largest of 4, 2, 1 up to ``max_group``
    that leaves two ring groups (4: measured best or near it on kimi-k2, qwen3.5-397b, glm-5 and
    gpt-oss-120b, EP2; ``MoEConfig.group_m`` asks for 2 for small experts)."""
    return next((g for g in (4, 2, 1) if g <= max_group and n_slots % g == 0 and n_slots // g >= 2), 1)


def down_col_tiles(n_cols: int, down_cols: int) -> int:
    """Column tiles per down ticket: the largest count <= ``down_cols`` that divides the ``n_cols``
    down column tiles of a row tile (so every ticket has the same, compile-time, number)."""
    if down_cols < 1:
        raise ValueError(f"fwd_down_cols={down_cols} must be >= 1")
    return max(c for c in range(1, min(down_cols, n_cols) + 1) if n_cols % c == 0)


def check_order(n_slots: int, BM: int, group_m: int, prefetch: int | None, lag: int | None,
                fill_split: int, pull_cols: int = 512) -> int:
    """Validate the ticket-order knobs (None: the default, always valid); returns the ring groups.

    Raises ValueError naming the MoEConfig field at fault.
    """
    if n_slots < 2:
        raise ValueError(f"the forward megakernel needs ring_rows >= 2 * tile_m (two ring slots); "
                         f"got {n_slots} slot(s) of {BM} rows")
    if group_m < 1 or n_slots % group_m or n_slots // group_m < 2:
        raise ValueError(f"fwd_group_m={group_m} must divide the {n_slots} ring slots into at least two groups")
    n_groups = n_slots // group_m
    if prefetch is not None and not 0 <= prefetch < n_groups:
        raise ValueError(f"fwd_prefetch={prefetch} must be in [0, ring groups={n_groups})")
    if lag is not None and not 1 <= lag < n_groups:
        raise ValueError(f"fwd_down_lag={lag} must be in [1, ring groups={n_groups}): gate/up of group q waits "
                         f"for the downs of group q - {n_groups}, which must come earlier in the ticket order")
    rows = BM // max(fill_split, 1)
    if fill_split < 1 or BM % fill_split or rows & (rows - 1):
        raise ValueError(f"fwd_fill_split={fill_split} must divide tile_m={BM} into a power-of-two number of rows")
    if pull_cols < 8 or pull_cols & (pull_cols - 1):
        raise ValueError(f"fwd_pull_cols={pull_cols} must be a power of two >= 8")
    return n_groups


def launch_fwd_megakernel(mb: MegaBuffers, sched, x_ptrs, y_ptrs, err, epoch, rank, wait_budget,
                          w_gate, w_up, w_down, x=None, shared=None, *, gu_cfg, dn_cfg, gus_cfg=None, dns_cfg=None,
                          programs: int, comm_programs: int = 0, prefetch: int | None = None, pull_cols: int = 512,
                          zero_counters: bool = True, ablate: int = 0, lag: int | None = None,
                          fill_split: int = 4, group_m: int | None = None, tma: bool = False, save=None,
                          w_ptrs=None, half_tiles: bool = False, trace=None, down_cols: int = 1,
                          fill_stages: int = 1, ticket_ahead: bool = True, poll_together: bool = True,
                          fill_table: bool = True, tile_ready: bool = True, peers=None, local_rows: bool = False,
                          early_ticket: bool = False, tokens=None):
    """Run the forward megakernel on one rank.

    sched: the schedule (row_src, tile_expert, num_tiles, k, T); x_ptrs / y_ptrs: address tables
    of every rank's x_pub [T, H] / y_in [T*k, H]; err: error record; epoch: int32 device tensor
    (the pass's epoch, for error records). shared: None or (w_gate_s, w_up_s, w_down_s) over the
    local x [T, H]; its output lands in ``mb.extra[:T]``. ``zero_counters=False`` (tests only)
    keeps whatever the counters hold; ``ablate`` (measurement only): see the kernel.
    ``group_m``: row tiles per group of the ticket order (divides n_slots). ``prefetch``: how many
    groups the fills run ahead of the gate/up tiles, in [0, n_slots // group_m) (default half);
    ``lag``: how many groups the down tiles run behind the gate/up tiles, in [1, n_slots // group_m)
    (default: the groups the grid works on at once, plus one). ``fill_split``: each row tile is
    pulled as this many tickets of tile_m // fill_split rows (more programs pull at once).
    ``tma``: load the GEMM operands through tensor descriptors (where every operand allows it:
    16-byte aligned bases and row strides; otherwise pointer loads).
    ``save``: None, or (xs [R, H], gu [R, 2I], row_w [R] fp32) with R = the schedule's rows, filled
    as the sync-free forward fills them (for the backward); ``w_ptrs``: every rank's router-weight
    table (w_pub), needed with ``save``. ``half_tiles``: compute tiles whose rows fit in tile_m/2 as
    half-height tiles (kernel HALF; needs tile_m >= 32 on the GPU, where a dot has at least 16 rows).
    ``trace``: None, or an int64 [programs, TRACE_HEAD + 4 * events] tensor the kernel records its
    tickets into (measurement only; ``tabby.profile.summarize_trace``).
    ``down_cols``: column tiles per down ticket (at most; the largest count up to it that divides the
    down column tiles). ``fill_stages``: pipeline stages of a fill's column loop (1: none).
    ``ticket_ahead``: take the next ticket in the shadow of the current one's release (kernel AHEAD).
    ``poll_together``: a ticket's polls in one round trip (kernel POLL2); False: one after the other.
    ``fill_table``: a fill loads the address tables whole with its row sources (kernel WP > 0).
    ``tile_ready``: with ``save``, per-tile fill counters (kernel TILE_READY; ``mb`` allocated with
    ``n_tiles`` >= the schedule's tiles), so that fills wait for no ring slot.
    ``peers``: None, or (flag_ptrs, my_flags, x_slot, done_slot, done_wait): the kernel sets and
    waits for the pass's x-ready and DONE flags itself (kernel PEERS); the counters must then be
    zeroed (here, or by the caller before the launch with ``zero_counters=False``).
    ``local_rows``: gate/up reads this rank's rows from ``x`` instead of filled copies (kernel LOCAL_A;
    with TMA, H % 8 == 0 and 16-byte aligned x / xs only, else off). Returns whether it was on: with
    ``save`` the kept xs then lacks this rank's rows.
    ``early_ticket``: take the next ticket before a GEMM's epilogue and poll it before the release
    (kernel EARLY; with TMA and no comm programs, else off).
    ``tokens``: None, or (xt [W*T, H], x_pull_slot) for the token pull (kernel TOKENS; needs
    ``peers``, ``local_rows`` possible, no comm programs, the schedule allocated with ``order=True``):
    xt receives every peer's x (rows src*T .. src*T + T; the caller queues the copies and the
    ``pulled`` counter's write, ``counter_layout``), ``save`` is then (None, gu, row_w) with row_w
    written by the schedule (``launch_schedule(row_w=...)``).
    """
    E, I, H = w_gate.shape
    BM = gu_cfg.BM
    assert dn_cfg.BM == BM == sched.BM
    assert w_gate.stride() == w_up.stride() and w_gate.stride(-1) == 1 and w_down.stride(-1) == 1
    assert mb.xs_ring.shape == (mb.n_slots * BM, H) and mb.h_ring.shape == (mb.n_slots * BM, I)
    if gu_cfg.num_warps < 3:  # sync.poll2 and sync.signal_take issue their atomics from warps 0, 1 and 2
        raise ValueError(f"the forward megakernel needs at least 3 warps per program, got {gu_cfg.num_warps}")
    if not 0 <= comm_programs < programs:
        raise ValueError(f"fwd_comm_programs={comm_programs} must be in [0, programs={programs})")
    if group_m is None:
        group_m = default_group_m(mb.n_slots)
    n_groups = check_order(mb.n_slots, BM, group_m, prefetch, lag, fill_split, pull_cols)
    if prefetch is None:
        prefetch = n_groups // 2
    dn_cols = down_col_tiles(triton.cdiv(H, dn_cfg.BN), down_cols)
    if lag is None:  # down tiles handed out after the groups in flight have had their gate/ups taken
        F = 0 if (comm_programs or tokens is not None) else fill_split
        G, D = triton.cdiv(I, gu_cfg.BN), triton.cdiv(H, dn_cfg.BN) // dn_cols
        lag = min(n_groups - 1, triton.cdiv(programs - comm_programs, group_m * (F + G + D)) + 1)
    # Split mode needs every program resident (compute programs wait on comm programs): ask for a
    # cooperative launch, which fails instead of hanging when the grid does not fit. The merged
    # ticket order needs no co-residency: a program waits only on tickets already taken.
    launch_kw = dict(launch_cooperative_grid=True) if comm_programs > 0 and not INTERPRET else {}
    if INTERPRET and comm_programs > 0 and int(sched.num_tiles) > mb.n_slots:  # CPU tensors: no device sync
        raise ValueError(f"under the interpreter, fwd_comm_programs > 0 needs a ring that holds every tile "
                         f"({int(sched.num_tiles)} tiles, {mb.n_slots} slots): programs run one after another, "
                         f"so the comm program would wait forever for a slot")
    if trace is not None:
        assert trace.dtype == torch.int64 and trace.shape[0] == programs and trace.shape[1] > TRACE_HEAD
    if zero_counters:
        mb.counters.zero_()
    if ablate & 4:  # measurement only: every pushed row lands in this rank's own buffer (no NVLink)
        y_ptrs = y_ptrs[rank].expand(y_ptrs.numel()).contiguous()
    T, k = sched.T, sched.k
    x_in = x  # the layer's input (LOCAL_A reads this rank's rows from it)
    has_sh = shared is not None
    if has_sh:
        sg, su, sd = shared
        I_s = sg.shape[0]
        assert x is not None and x.is_contiguous() and sg.is_contiguous() and su.is_contiguous()
        assert sd.is_contiguous() and mb.h_sh is not None and mb.h_sh.shape[1] == I_s
        assert gus_cfg.BM == dns_cfg.BM == BM
    else:
        sg = su = sd = x = w_gate
        I_s = 0
        gus_cfg = dns_cfg = gu_cfg
    h_sh = mb.h_sh if has_sh else mb.h_ring
    extra = mb.extra if has_sh else mb.h_ring
    BH = min(pull_cols, triton.next_power_of_2(H))
    xs_buf = mb.xs_ring
    if tokens is not None:
        xs_buf, x_pull_slot = tokens
        if peers is None or comm_programs or x is None or sched.tile_order is None:
            raise ValueError("the token pull needs the in-kernel peer flags (fwd_peer_flags), no comm programs, "
                             "x, and a schedule with a tile order (alloc_schedule(order=True))")
        assert xs_buf.shape == (x_ptrs.numel() * T, H) and xs_buf.is_contiguous()
    if save is not None:
        xs_save, gu_save, row_w = save
        R = sched.row_src.numel()
        assert w_ptrs is not None and gu_save.shape == (R, 2 * I) and row_w.shape == (R,)
        assert gu_save.is_contiguous() and row_w.dtype == torch.float32
        if tokens is None:
            xs_buf = xs_save
            assert xs_buf.shape == (R, H) and xs_buf.is_contiguous()
    else:
        gu_save = row_w = w_ptrs = None
    use_tma = tma and gemm._tma_ok(xs_buf, mb.h_ring, w_gate, w_up, w_down, *((x, sg, su, sd) if has_sh else ()))
    half = half_tiles and (BM >= 32 or INTERPRET) and BM % 2 == 0
    descs = [None] * 12
    if use_tma:
        D = gemm._desc
        descs[:5] = [D(xs_buf, [BM, gu_cfg.BK]), D(w_gate, [1, gu_cfg.BN, gu_cfg.BK]),
                     D(w_up, [1, gu_cfg.BN, gu_cfg.BK]), D(mb.h_ring, [BM, dn_cfg.BK]),
                     D(w_down, [1, dn_cfg.BN, dn_cfg.BK])]
        if has_sh:  # the shared expert is "expert 0" of [1, ...] weight views
            descs[5:10] = [D(x, [BM, gus_cfg.BK]), D(sg.unsqueeze(0), [1, gus_cfg.BN, gus_cfg.BK]),
                         D(su.unsqueeze(0), [1, gus_cfg.BN, gus_cfg.BK]), D(mb.h_sh, [BM, dns_cfg.BK]),
                         D(sd.unsqueeze(0), [1, dns_cfg.BN, dns_cfg.BK])]
        if half:
            descs[10:12] = [D(xs_buf, [BM // 2, gu_cfg.BK]), D(mb.h_ring, [BM // 2, dn_cfg.BK])]
    W = x_ptrs.numel()
    tile_ready = tile_ready and save is not None
    if tile_ready:
        need = sched.row_src.numel() // BM
        if mb.n_tiles < need:
            raise ValueError(f"tile_ready needs {need} per-tile counters (alloc_mega(..., n_tiles=schedule "
                             f"tiles)); the buffers have {mb.n_tiles}")
    lay = counter_layout(mb.n_slots, mb.n_sh, mb.n_tiles)
    assert mb.counters.numel() == lay["total"]
    x_rows = x_in if x_in is not None else mb.counters  # (unused without LOCAL_A)
    local_a = bool(local_rows and use_tma and x_in is not None and H % 8 == 0 and x_in.is_contiguous()
                   and x_in.data_ptr() % 16 == 0 and xs_buf.data_ptr() % 16 == 0)
    if tokens is not None and not local_a:
        raise ValueError("the token pull gathers A rows like fwd_local_rows: it needs TMA loads, H % 8 == 0 and "
                         "16-byte aligned, contiguous x and pulled tokens")
    if peers is not None:
        flag_ptrs, my_flags, x_slot, done_slot, done_wait = peers
    else:
        flag_ptrs = my_flags = mb.counters
        x_slot = done_slot = 0
        done_wait = False
    moe_fwd_megakernel[(programs,)](
        mb.counters, err, epoch, rank, wait_budget,
        sched.row_src, sched.tile_expert, sched.num_tiles, x_ptrs, y_ptrs, T * k, k,
        xs_buf, mb.h_ring, w_gate, w_up, w_gate.stride(0), w_gate.stride(1), w_down, w_down.stride(0),
        w_down.stride(1),
        x, T, sg, su, sd, h_sh, extra, mb.sh_tiles, mb.sh_n, mb.n_sh, prefetch, lag, *descs, w_ptrs, row_w, gu_save,
        NS=mb.n_slots, FS=fill_split, GM=group_m, COMM=comm_programs, HAS_SHARED=has_sh,
        H=H, I=I, IS=I_s, BM=BM, BH=BH,
        BN_GU=gu_cfg.BN, BK_GU=gu_cfg.BK, BN_DN=dn_cfg.BN, BK_DN=dn_cfg.BK,
        BN_GUS=gus_cfg.BN, BK_GUS=gus_cfg.BK, BN_DNS=dns_cfg.BN, BK_DNS=dns_cfg.BK,
        INTERPRET=INTERPRET, ABLATE=ablate, TMA=use_tma, SAVE=save is not None, HALF=half,
        trace=trace, TRACE_EV=0 if trace is None else (trace.shape[1] - TRACE_HEAD) // 4,
        DN_COLS=dn_cols, FILL_STAGES=fill_stages, AHEAD=ticket_ahead, NW=gu_cfg.num_warps,
        POLL2=poll_together, W=W, WP=triton.next_power_of_2(W) if fill_table else 0, TILE_READY=tile_ready,
        flag_ptrs=flag_ptrs, my_flags=my_flags, done_idx=lay["programs_done"], PEERS=peers is not None,
        X_SLOT=x_slot, DONE_SLOT=done_slot, DONE_WAIT=done_wait, LOCAL_A=local_a, x_rows=x_rows,
        EARLY=bool(early_ticket and use_tma and comm_programs == 0),
        TOKENS=tokens is not None, tile_order=sched.tile_order if tokens is not None else None,
        local_tiles=sched.local_tiles if tokens is not None else None, pull_idx=lay["pulled"],
        X_PULL=x_pull_slot if tokens is not None else 0,
        num_warps=gu_cfg.num_warps, num_stages=gu_cfg.num_stages, **launch_kw)
    return local_a

