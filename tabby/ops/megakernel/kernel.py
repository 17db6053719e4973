"""The forward megakernel: dispatch (pull), gate/up + SwiGLU, down + push and the shared expert in
ONE persistent launch, its tasks ordered by counters in GPU memory at tile granularity.

It replaces the dispatch, gate/up and down + push launches of the sync-free forward; the
schedule's launches before it and the combine after it are the same. The pass's peer flags are
set and waited for inside it: program 0 tells every rank that this rank's x is published (the
host copied it into x_pub before the launch), every program waits for every rank's before its
first ticket (fills read the peers' x_pub), and the last program to finish tells every rank that
its rows are pushed (DONE) and waits for theirs, so the combine may follow in stream order.

Ring. Routed row tile i (schedule order, i < num_tiles, a device value) lives in slot s = i % NS
of two rings, generation g = i // NS:

    xs [NS*BM, H]   bf16   its pulled x rows (rows sched.row_src[i*BM:(i+1)*BM])
    h  [NS*BM, I]   bf16   silu(x Wg^T) * (x Wu^T)

A differentiated forward (SAVE) writes its rows to the full xs buffer (row i*BM) instead, and
g | u and the rows' router weights as the sync-free forward keeps them.

Tasks and the counters that order them (``protocol.py`` has the layout and the one place each
wait and signal is written):

    fill(i, part)   copies BM/FS rows of tile i          waits: its xs slot retired
    gate/up(i, n)   h[:, n-th column tile] of tile i     waits: its rows filled, its h slot retired
    down(i, n)      DN_COLS column tiles of y, pushed    waits: every h column tile of tile i
                    to the rows' origins
    shared gate/up, shared down over x row tile j (no dispatch: they cover the wait for the first
    pulled rows)

Ticket order: one global sequence in which every producer precedes its consumers. First the
shared expert, for x row tile j = 0..: [gate/up(j, *)] [down(j-1, *)]. Then the routed tiles in
groups of GM consecutive row tiles: a prologue of the fills of groups 0..P-1, then for group
q = 0..: [fills of group q+P] [gate/up(q, *)] [down(q-L, *)], the last two column-major (column
tile outer, the GM row tiles inner, so that the row tiles of one expert read a weight block at the
same time, once from HBM). Tiles past the last are empty tickets. With NSg = NS / GM ring groups,
P (``prefetch``) in [0, NSg): the fills of group q+P wait for the gate/ups of group q+P-NSg, which
come earlier; L (``down_lag``) in [1, NSg): gate/up of group q waits for the downs of group q-NSg,
handed out in stage q-NSg+L < q. Programs take tickets with an atomic counter, so a program only
ever waits on a ticket already taken by a running program: deadlock-free, even when not every
program of the grid is resident. A compute ticket starts with its polls in one round trip
(``sync.poll2``: up to two counters, from two warps) and ends with its signal, in whose fence's
shadow the program's next ticket is taken (``sync.signal_take``). Under the interpreter the
programs run one after another: program 0 takes every ticket, in order.

Comm programs (COMM > 0): programs pid < COMM take fill tickets from a counter of their own, in
tile order, and never compute; the others take the order above without fills. They need every
program resident (a cooperative launch). Under the interpreter the comm program 0 finishes only
if it never waits for a slot: num_tiles <= NS (the launcher checks).

Token pull (TOKENS): no fills. A copy engine copies every peer's x_pub whole into ``routed.xs``
[W*T, H] (row src*T + t) beside the kernel and sets counter ``pulled`` when done; gate/up gathers
every A row from x or those tokens. The routed tiles go in the schedule's ``tile_order`` (tiles of
this rank's rows first, ``local_tiles`` of them), so the others, which wait for ``pulled``, come
when the copy has had time; a ticket's position p (its ring slot) and its tile ``tile_order[p]``
then differ. No program waits for the peers' x-ready flags: this rank reads no peer's x_pub, and
pushes to a peer only from tiles that waited for ``pulled``, which follows the peer's flag. The
last program waits for ``pulled`` before DONE (the copy reads the peers' x_pub until then).

Local rows (LOCAL_A, with TMA): the fills copy only rows from other ranks, and the gate/up tiles
gather their A rows through pointers (``tasks.local_a_rows``): this rank's from ``x_rows`` (the
layer's input), the others from xs; the weights still come through TMA. A kept xs (SAVE) then
lacks this rank's rows.

Half tiles (HALF): a row tile whose real rows (a prefix) fit in BM/2 is computed as a BM/2-row
tile by its gate/up and down tickets (same columns and K order: bitwise the same outputs, half
the MMA work), and a fill part that holds only padding rows is not copied. Padding rows of the
ring (or the kept xs) then hold stale data, which reaches only padding rows of h, g | u and y:
the GEMMs are row-wise and nothing reads those rows. Padding tiles (the schedule pads each
expert to a multiple of ``align`` row tiles, so that an expert's row tiles stay inside one group
of the ticket order) take their tickets, waits and signals like any other and compute nothing.

Memory ordering on the GPU (read off the sm_90 SASS of tests/test_megakernel_compile.py): a wait
polls with an acquire read (LDG.E.STRONG.GPU for ``wait_geq``'s poll, ATOMG.E.ADD.STRONG.GPU of 0
for ``poll2``'s; then CCTL.IVALL, which invalidates the SM's L1, so ring rows left in L1 by an
earlier generation are not read stale), then a CTA barrier so every thread's ordinary loads come
after it. A signal is a CTA barrier after the tile's ordinary stores, then, on one thread,
MEMBAR.ALL.GPU and the release add (the pattern of cooperative groups' grid sync). Exception:
``dn_done`` only says that a down tile has finished reading its h slot, so it is a relaxed add
after the barrier and does not wait for the rows the tile pushed over NVLink (DONE publishes
those). With TMA the GEMM operands come through the async proxy while the ring is written with
ordinary stores: the writer fences (``fence.proxy.async``) before its release and the reader
after its acquire.

Instrumentation (``ProbeConsts``, measurement only): TRACE_EV > 0 records each program's first
TRACE_EV tickets into ``trace`` (layout: ``protocol.TRACE_HEAD``); ABLATE skips work (bit 1 the
fills' row copies, bit 2 the routed GEMM math; the output is then wrong) while every wait and
signal stays, so a variant's time shows what the remaining stages cost under the same schedule.
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .. import comm, sync
from .protocol import (C_FILL_TICKET, C_TICKET, TR_EMPTY, TR_FILL, TR_SH_GU, TRACE_HEAD, decode_ticket,
                       routed_signal, ticket_waits, trace_clock, trace_time)
from .tasks import fill, routed_compute, shared_compute

_ERR_WAIT_PEER_READY = tl.constexpr(sync.ERR_WAIT_PEER_READY)
_ERR_WAIT_PEER_DONE = tl.constexpr(sync.ERR_WAIT_PEER_DONE)


# --------------------------------------------------------------------------------------------
# The kernel's arguments: runtime tuples (tensors and integers) and two tuples of constants
# --------------------------------------------------------------------------------------------

class SyncArgs(NamedTuple):
    """What every wait and signal needs."""
    counters: object  # int32 [protocol.counter_layout(...).total]: this rank's counters, zeroed
    err: object  # int32 [sync.ERR_WORDS]: this rank's error record
    epoch: object  # int32 [1]: the pass's epoch (the peers' flags and the error records)
    rank: int
    wait_budget: int  # of every bounded wait: ns of GPU time, polls under the interpreter


class RouteArgs(NamedTuple):
    """Where the routed rows come from and go: the schedule and every rank's buffers."""
    row_src: object  # int32 [R]: src * TK + t * k + kk of each routed row, -1 for padding
    tile_expert: object  # int32 [R // BM]: local expert of each row tile, -1 for padding tiles
    num_tiles: object  # int32 [1]
    x_ptrs: object  # int64 [W]: every rank's x_pub [T, H]
    y_ptrs: object  # int64 [W]: every rank's y_in [T*k, H], where the down tiles push
    TK: int  # T * k
    k: int


class RoutedArgs(NamedTuple):
    """The routed experts' operands (strides in elements)."""
    xs: object  # the ring [NS*BM, H]; SAVE: the kept xs [R, H]; TOKENS: every rank's x [W*T, H]
    h_ring: object  # [NS*BM, I]
    w_gate: object  # [E, I, H]
    w_up: object  # [E, I, H], w_gate's strides
    wg_e: int
    wg_n: int
    w_down: object  # [E, H, I]
    wd_e: int
    wd_n: int


class SharedArgs(NamedTuple):
    """The shared expert over this rank's x (each x row tile is "expert 0" of a row tile)."""
    x: object  # [T, H]
    T: int
    w_gate: object  # [I_s, H]
    w_up: object  # [I_s, H]
    w_down: object  # [H, I_s]
    h: object  # [n_sh * BM, I_s]
    out: object  # [n_sh * BM, H]: the shared expert's output (rows >= T unused)
    tiles: object  # int32 [max(n_sh, 1)] zeros
    n_ptr: object  # int32 [1] = n_sh
    n: int  # n_sh: x row tiles


class OrderArgs(NamedTuple):
    """The ticket order's runtime knobs (``MegaPlan``)."""
    prefetch: int  # P: groups the fills run ahead of gate/up
    lag: int  # L: groups the down tiles run behind gate/up


class Descs(NamedTuple):
    """Tensor descriptors of the GEMM operands (TMA), all None without it."""
    xs: object  # routed A rows, block [BM, BK]
    w_gate: object
    w_up: object
    h: object  # down A rows
    w_down: object
    x: object  # the shared expert's
    s_gate: object
    s_up: object
    h_sh: object
    s_down: object
    xs_half: object  # half tiles' A rows, block [BM/2, BK] (None without HALF)
    h_half: object


class SavedArgs(NamedTuple):
    """What a differentiated forward keeps beside xs (SAVE; None otherwise)."""
    w_ptrs: object  # int64 [W]: every rank's w_pub [T, k] (router weights)
    row_w: object  # fp32 [R]: each row's router weight
    gu: object  # [R, 2I]: g | u


class PeerArgs(NamedTuple):
    """The pass's flags (``comm._signal_peers`` / ``_wait_peers``)."""
    W: int  # ranks
    flag_ptrs: object  # int64 [W]: every rank's flags
    my_flags: object  # int32 [slots, W]: this rank's
    done_idx: int  # counter ``programs_done``


class TokenArgs(NamedTuple):
    """The token pull (TOKENS; the tables None otherwise)."""
    tile_order: object  # int32 [R // BM]: the routed tile at each position of the order
    local_tiles: object  # int32 [1]: positions whose tiles hold this rank's rows only (first)
    pull_idx: int  # counter ``pulled``


class MegaConsts(NamedTuple):
    """The launch's compile-time constants (``host.kernel_consts`` makes them from the plan)."""
    NS: int  # ring slots
    FS: int  # fill parts per row tile
    GM: int  # row tiles per group of the ticket order
    COMM: int  # comm programs
    HAS_SHARED: bool
    H: int
    I: int
    IS: int  # the shared expert's width (0: none)
    BM: int  # rows per row tile
    BH: int  # columns per fill step
    BN_GU: int  # routed gate/up tiles
    BK_GU: int
    BN_DN: int  # routed down tiles
    BK_DN: int
    BN_GUS: int  # shared gate/up tiles
    BK_GUS: int
    BN_DNS: int  # shared down tiles
    BK_DNS: int
    TMA: bool  # GEMM operands through tensor descriptors
    SAVE: bool  # a differentiated forward: keep xs, g | u, row weights
    HALF: bool  # half tiles
    DN_COLS: int  # column tiles per down ticket
    FILL_STAGES: int  # pipeline stages of a fill's column loop
    NW: int  # warps per program
    WP: int  # the address tables' length padded to a power of two
    X_SLOT: int  # flag slots: x ready, DONE, the token pull's peer flag
    DONE_SLOT: int
    X_PULL: int
    DONE_WAIT: bool  # the last program waits for every rank's DONE (off under the interpreter)
    LOCAL_A: bool  # gate/up reads this rank's rows from x
    TOKENS: bool  # the token pull
    INTERPRET: bool
    G: int  # gate/up tickets per row tile
    D: int  # down tickets per row tile
    GS: int  # shared gate/up tickets per x row tile
    DS: int  # shared down tickets per x row tile
    F: int  # fill tickets per row tile in the compute order (0: comm programs or the token pull)
    TR: bool  # per-tile fill counters (SAVE without TOKENS: fills write rows of their own)
    SH_GU: int  # counter index of sh_gu[0]
    ACT: int = 0  # the routed experts' activation (ops/gemm/activation.py; the shared expert's is SwiGLU)
    LIMIT: float = 0.0
    ALPHA: float = 0.0


class ProbeConsts(NamedTuple):
    """Instrumentation (measurement only): ticket trace and ablations (module docstring)."""
    TRACE_EV: int
    ABLATE: int


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def moe_fwd_megakernel(sync_args, route, routed, shared, order,
                       xs_desc, wg_desc, wu_desc, h_desc, wd_desc, x_desc, sg_desc, su_desc, hsh_desc, sd_desc,
                       xs_half_desc, h_half_desc, saved, trace, peers, x_rows, tokens,
                       C: tl.constexpr, PROBE: tl.constexpr):
    """One persistent launch of the routed forward and the shared expert (module docstring).
    Arguments: ``SyncArgs``, ``RouteArgs``, ``RoutedArgs``, ``SharedArgs``, ``OrderArgs``, the
    twelve fields of ``Descs`` (or Nones), ``SavedArgs`` (or Nones), the trace (int64 or None),
    ``PeerArgs``, x_rows (the layer's input, read with LOCAL_A), ``TokenArgs``, ``MegaConsts``,
    ``ProbeConsts``. The tensor descriptors are parameters of their own, not a tuple: Triton's
    launcher expands a host descriptor into its TMA map only at the top level of the arguments."""
    descs = Descs(xs_desc, wg_desc, wu_desc, h_desc, wd_desc, x_desc, sg_desc, su_desc, hsh_desc, sd_desc,
                  xs_half_desc, h_half_desc)
    pid = tl.program_id(0)
    cnt_ptr = sync_args.counters
    epoch = tl.load(sync_args.epoch)
    if pid == 0:
        comm._signal_peers(peers.flag_ptrs, epoch, C.X_SLOT, sync_args.rank, peers.W)
    if not C.TOKENS:
        comm._wait_peers(peers.my_flags, epoch, C.X_SLOT, sync_args.rank, peers.W, sync_args.wait_budget,
                         sync_args.err, _ERR_WAIT_PEER_READY)
        tl.debug_barrier()  # the polling thread's acquire orders every thread's reads of peers' x_pub
    nt = tl.load(route.num_tiles)
    n_local = 0
    if C.TOKENS:
        n_local = tl.load(tokens.local_tiles)
    tr_base = C.SH_GU + tl.maximum(shared.n, 1)  # counter_layout's tile_ready
    if C.HAS_SHARED:
        sh_total = shared.n * (C.GS + C.DS)
    else:
        sh_total = 0
    pre = order.prefetch
    if C.COMM > 0:
        pre = 0
    ng = (nt + C.GM - 1) // C.GM  # groups of GM row tiles
    total = sh_total + pre * C.GM * C.F + ng * C.GM * (C.F + C.G + C.D)
    ev = 0  # tickets taken (traced)
    rec = trace
    if PROBE.TRACE_EV > 0:
        head = trace + pid.to(tl.int64) * (TRACE_HEAD + 4 * PROBE.TRACE_EV)
        tl.store(head + 1, trace_time(C.INTERPRET))
        tl.store(head + 3, trace_clock(C.INTERPRET))
    if pid < C.COMM:  # comm program: fills only, in tile order
        f = tl.atomic_add(cnt_ptr + C_FILL_TICKET, 1, sem="relaxed", scope="gpu")
        while f < nt * C.FS:
            if PROBE.TRACE_EV > 0:
                rec = head + TRACE_HEAD + 4 * tl.minimum(ev, PROBE.TRACE_EV - 1)
                tl.store(rec, TR_FILL)
                tl.store(rec + 1, trace_clock(C.INTERPRET))
            fill(f // C.FS, f % C.FS, sync_args, epoch, route, xs=routed.xs, saved=saved, W=peers.W, rec=rec, ready=0,
                 tr_base=tr_base, C=C, PROBE=PROBE, SIGNAL=True)
            if PROBE.TRACE_EV > 0:
                tl.store(rec + 3, trace_clock(C.INTERPRET))
                ev += 1
            f = tl.atomic_add(cnt_ptr + C_FILL_TICKET, 1, sem="relaxed", scope="gpu")
    else:
        t = tl.atomic_add(cnt_ptr + C_TICKET, 1, sem="relaxed", scope="gpu")
        while t < total:
            if PROBE.TRACE_EV > 0:  # kind TR_EMPTY unless a task overwrites it; "ready" = taken unless it waits
                rec = head + TRACE_HEAD + 4 * tl.minimum(ev, PROBE.TRACE_EV - 1)
                c0 = trace_clock(C.INTERPRET)
                tl.store(rec, TR_EMPTY)
                tl.store(rec + 1, c0)
                tl.store(rec + 2, c0)
            # What the ticket is, the counters it waits for (index -1: none; polled together in one
            # round trip) and the counter it signals at its end
            is_sh, kind_s, j, n_s, kind, p, n = decode_ticket(t, sh_total, shared.n, nt, pre, order.lag, F=C.F, G=C.G,
                                                              D=C.D, GM=C.GM, GS=C.GS, DS=C.DS,
                                                              HAS_SHARED=C.HAS_SHARED)
            i = p  # the row tile at position p of the routed order
            if C.TOKENS:
                i = tl.load(tokens.tile_order + p, mask=(p < nt) & (~is_sh), other=0)
            w1, t1, w2, t2 = ticket_waits(is_sh, kind_s, j, kind, p, nt, G=C.G, D=C.D, GS=C.GS, NS=C.NS, FS=C.FS,
                                          TR=C.TR, tr_base=tr_base, SH_IDX=C.SH_GU, TOK=C.TOKENS, n_local=n_local,
                                          pull_idx=tokens.pull_idx)
            ready = sync.poll2(cnt_ptr, w1, t1, w2, t2, C.NW).to(tl.int32)
            sig = tl.where(is_sh, tl.where(kind_s == 1, C.SH_GU + j, -1),
                           tl.where(p < nt, routed_signal(kind, i, p, NS=C.NS, TR=C.TR, tr_base=tr_base), -1))
            # Release, except a down tile's: dn_done only frees the h slot (its reads are done), and the
            # rows it pushed need no ordering here (DONE, at the end, publishes them), so its signal
            # does not wait for the NVLink stores (relaxed, as sync.add_reads_done)
            release = (is_sh | (kind != 2)).to(tl.int32)
            if is_sh:
                if C.HAS_SHARED:
                    if PROBE.TRACE_EV > 0:
                        tl.store(rec, TR_SH_GU + kind_s - 1)
                    shared_compute(kind_s, j, n_s, sync_args, epoch, shared, descs, rec=rec, ready=ready, C=C,
                                   PROBE=PROBE)
            else:
                if p < nt:  # else past the last row tile: a partial last group, or fills beyond the end
                    if PROBE.TRACE_EV > 0:
                        tl.store(rec, kind)  # TR_FILL, TR_GU, TR_DN
                    if kind == 0:
                        fill(i, n, sync_args, epoch, route, xs=routed.xs, saved=saved, W=peers.W, rec=rec,
                             ready=ready, tr_base=tr_base, C=C, PROBE=PROBE, SIGNAL=False)
                    else:
                        routed_compute(kind, i, n, p, sync_args, epoch, route, routed, descs, saved, x_rows, tokens,
                                       n_local=n_local, tr_base=tr_base, rec=rec, ready=ready, C=C, PROBE=PROBE)
            t = sync.signal_take(cnt_ptr, sig, release, C_TICKET, C.NW)
            if PROBE.TRACE_EV > 0:
                tl.store(rec + 3, trace_clock(C.INTERPRET))
                ev += 1
    tl.debug_barrier()  # every thread's pushes issued
    # system scope: the count orders this program's pushes (some over NVLink) before the last
    # program's release to the peers (cumulativity through the counter's read-modify-writes)
    done = tl.atomic_add(cnt_ptr + peers.done_idx, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        if C.TOKENS:  # the copy engine reads the peers' x_pub until it sets ``pulled``
            seen = sync.wait_geq(cnt_ptr + tokens.pull_idx, target=1, budget=sync_args.wait_budget,
                                 err_ptr=sync_args.err, code=_ERR_WAIT_PEER_READY, rank=sync_args.rank,
                                 index=tokens.pull_idx, epoch=epoch, SCOPE="sys")
            if seen < 1:  # a peer never published (error recorded): release the copy stream's waits
                for src in range(peers.W):
                    sync.store_release(peers.my_flags + C.X_PULL * peers.W + src, value=1, SCOPE="sys")
        comm._signal_peers(peers.flag_ptrs, epoch, C.DONE_SLOT, sync_args.rank, peers.W)
        if C.DONE_WAIT:
            comm._wait_peers(peers.my_flags, epoch, C.DONE_SLOT, sync_args.rank, peers.W, sync_args.wait_budget,
                             sync_args.err, _ERR_WAIT_PEER_DONE)
    if PROBE.TRACE_EV > 0:
        tl.store(head, ev)
        tl.store(head + 2, trace_time(C.INTERPRET))
        tl.store(head + 4, trace_clock(C.INTERPRET))
