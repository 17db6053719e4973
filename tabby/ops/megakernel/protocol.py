"""The forward megakernel's protocol: its counters, its ticket order and the waits and signals
that order its tasks (the overview is ``kernel.py``'s docstring).

Everything here is a pure function of its arguments. The device functions (``@triton.jit``) are
inlined into the kernel; each has a host mirror (``*_host``) in plain Python, which the tests
check against it and which the protocol model of the tests (tests/test_protocol.py) runs under
random interleavings of programs.

Counters: int32, one array per rank, zeroed before each launch, at the indices of
``counter_layout``::

    ticket           next ticket of the compute order (every program but the comm programs)
    fill_ticket      next fill of the comm programs (``comm_programs`` > 0)
    ready[s]         +1 per fill part of ring slot s                  fill    -> gate/up
    gu_done[s]       +1 per gate/up column tile of slot s              gate/up -> down; xs slot free
    dn_done[s]       +1 per down ticket of slot s                      down    -> h slot free
    sh_gu[j]         +1 per shared gate/up column tile of x row tile j  -> shared down
    tile_ready[i]    +1 per fill part of row tile i, when the fills write the full xs buffer
    programs_done    programs that have finished (the last one signals DONE to the peers)
    pulled           1 once the token pull has copied every peer's x
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .. import sync
from ..sync import globaltimer

C_TICKET, C_FILL_TICKET, C_READY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@dataclass(frozen=True)
class CounterLayout:
    """Indices into one rank's counter array (see the module docstring); ``total`` counters."""

    ticket: int
    fill_ticket: int
    ready: int
    gu_done: int
    dn_done: int
    sh_gu: int
    tile_ready: int
    programs_done: int
    pulled: int
    total: int


def counter_layout(n_slots: int, n_sh: int, n_tiles: int = 0) -> CounterLayout:
    """The counters of a ring of ``n_slots`` slots, ``n_sh`` shared-expert x row tiles and
    ``n_tiles`` per-tile fill counters (the schedule's most row tiles; 0: none)."""
    NS, r = n_slots, C_READY.value
    tr = r + 3 * NS + max(n_sh, 1)
    return CounterLayout(ticket=C_TICKET.value, fill_ticket=C_FILL_TICKET.value, ready=r, gu_done=r + NS,
                         dn_done=r + 2 * NS, sh_gu=r + 3 * NS, tile_ready=tr, programs_done=tr + n_tiles,
                         pulled=tr + n_tiles + 1, total=tr + n_tiles + 2)


# Ticket trace (measurement only): int64 [programs, TRACE_HEAD + 4 * events]. Per program a header
# [tickets taken, globaltimer ns at start, at end, clock64 at start, at end], then per ticket
# [kind code, clock when taken, clock after its waits, clock at its end]. A fill part with a row
# from another rank is "fill remote" (its loads cross NVLink); "fill": every row local or padding.
TRACE_HEAD = tl.constexpr(8)
TR_FILL, TR_GU, TR_DN, TR_SH_GU, TR_SH_DN, TR_EMPTY, TR_FILL_REMOTE = (tl.constexpr(v) for v in range(7))
TRACE_KINDS = ("fill", "gate/up", "down", "shared gate/up", "shared down", "empty", "fill remote")


@triton.jit
def trace_clock(INTERPRET: tl.constexpr):
    """The SM's cycle counter (0 under the interpreter, which has no clock)."""
    if INTERPRET:
        return tl.zeros((), tl.int64)
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def trace_time(INTERPRET: tl.constexpr):
    """%globaltimer in ns (0 under the interpreter)."""
    if INTERPRET:
        return tl.zeros((), tl.int64)
    return globaltimer()


@triton.jit
def trace_ready(rec, TRACE_EV: tl.constexpr, INTERPRET: tl.constexpr):
    """Stamp the end of a ticket's waits into its trace record ``rec`` (when tracing)."""
    if TRACE_EV > 0:
        tl.store(rec + 2, trace_clock(INTERPRET))


# --------------------------------------------------------------------------------------------
# The ticket order
# --------------------------------------------------------------------------------------------

@triton.jit
def decode(t, n, F, G, D, L):
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
def routed_task(tr, nt, pre, L, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GM: tl.constexpr):
    """Routed ticket tr -> (kind, row tile, column or fill part); row tile >= nt: an empty ticket.

    A prologue of the fills of groups 0..pre-1, then ``decode``'s stages over groups of GM row
    tiles: [fills of group q+pre] [gate/up of group q] [down of group q-L], the last two
    column-major (column tile outer, row tile of the group inner).
    """
    F1: tl.constexpr = F if F > 0 else 1  # F = 0 (comm programs or the token pull): no fill tickets
    ng = (nt + GM - 1) // GM
    kind, q, c = decode(tl.maximum(tr - pre * GM * F, 0), ng, GM * F, GM * G, GM * D, L)
    i = tl.where(kind == 0, (q + pre) * GM + c // F1, q * GM + c % GM)
    n = tl.where(kind == 0, c % F1, c // GM)
    pro = tr < pre * GM * F  # prologue
    kind = tl.where(pro, 0, kind)
    i = tl.where(pro, tr // F1, i)
    n = tl.where(pro, tr % F1, n)
    return kind, i, n


@triton.jit
def decode_ticket(t, sh_total, n_sh, nt, pre, lag, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  GM: tl.constexpr, GS: tl.constexpr, DS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Ticket t of the compute order -> (is_sh, kind_s, j, n_s, kind, p, n): a shared-expert ticket
    (t < sh_total; kind_s 1 gate/up, 2 down of x row tile j, column n_s) or a routed one
    (``routed_task``: kind, position p in the routed order, column or fill part n)."""
    is_sh = t < sh_total
    if HAS_SHARED:
        kind_s, j, n_s = decode(t, n=n_sh, F=0, G=GS, D=DS, L=1)
    else:
        kind_s, j, n_s = 0, 0, 0
    kind, i, n = routed_task(t - sh_total, nt, pre, lag, F, G, D, GM)
    return is_sh, kind_s, j, n_s, kind, i, n


# --------------------------------------------------------------------------------------------
# Waits and signals
# --------------------------------------------------------------------------------------------

@triton.jit
def routed_waits(kind, i, p, NS: tl.constexpr, FS: tl.constexpr, G, D, TR: tl.constexpr = False, tr_base=0,
                 TOK: tl.constexpr = False, n_local=0, pull_idx=0):
    """The waits of routed ticket (kind, row tile i at position p of the routed order; p = i but
    with TOK) as (idx1, target1, idx2, target2): ``counters[idx] >= target``, idx < 0 for none.
    The ring slot s = p % NS and generation g = p // NS come from the position.

    fill:    gu_done[s] >= G * g           every gate/up of the tile NS earlier has read xs slot s
    gate/up: ready[s] >= FS * (g + 1)      its rows are filled
             dn_done[s] >= D * g           every down of the tile NS earlier has read h slot s
    down:    gu_done[s] >= G * (g + 1)     every h column of its tile is written
    TR (per-tile fill counters: the fills write the full xs buffer, rows of their own): a fill waits
    for nothing, gate/up waits for ``tile_ready[i] >= FS`` (index ``tr_base + i``) instead: a fill of
    tile i + NS could otherwise count towards tile i in its slot's counter.
    TOK (the token pull: no fills): gate/up waits for ``pulled >= 1`` (index ``pull_idx``) unless its
    position is among the first ``n_local``, whose tiles hold this rank's rows only.
    """
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
def routed_signal(kind, i, p, NS: tl.constexpr, TR: tl.constexpr = False, tr_base=0):
    """The counter routed ticket (kind, row tile i at position p) adds 1 to when done: fill ->
    ready[s] (TR: tile_ready[i]), gate/up -> gu_done[s] (both with release semantics), down ->
    dn_done[s] (relaxed: it only frees the h slot); s = p % NS."""
    s = p % NS
    fill_idx = C_READY + s
    if TR:
        fill_idx = tr_base + i
    return tl.where(kind == 0, fill_idx, tl.where(kind == 1, C_READY + NS + s, C_READY + 2 * NS + s))


@triton.jit
def ticket_waits(is_sh, kind_s, j, kind, p, nt, G: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                 NS: tl.constexpr, FS: tl.constexpr, TR: tl.constexpr, tr_base, SH_IDX,
                 TOK: tl.constexpr = False, n_local=0, pull_idx=0):
    """The waits of a decoded ticket (``decode_ticket``; p its position in the routed order, the row
    tile itself but with TOK, whose waits need no tile), as ``routed_waits`` gives them: a shared
    down tile waits for its x row tile's gate/up tiles (sh_gu[j] >= GS, index ``SH_IDX + j``), a
    shared gate/up tile and an empty ticket (past the last row tile) for nothing."""
    w1, t1, w2, t2 = routed_waits(kind, p, p, NS, FS, G, D, TR, tr_base, TOK, n_local, pull_idx)
    w1 = tl.where(is_sh, tl.where(kind_s == 2, SH_IDX + j, -1), tl.where(p < nt, w1, -1))
    t1 = tl.where(is_sh, GS, t1)
    w2 = tl.where(is_sh | (p >= nt), -1, w2)
    return w1, t1, w2, t2


@triton.jit
def wait_counter(cnt_ptr, idx, target, wait_budget, err_ptr, code, rank, epoch, TMA: tl.constexpr = False, ready=0):
    """Wait for ``cnt_ptr[idx] >= target`` unless ``ready`` (the ticket's first polls, ``sync.poll2``,
    already saw every counter of the ticket there) or idx < 0 (the protocol's "no wait"). The
    counters start one guard word into their allocation, so a wait that did read index -1 would
    time out with an error record rather than read another allocation's memory.

    Bounded (``sync.wait_geq``, scope gpu): a lost signal becomes an error record, never a hang.
    Ends with a CTA barrier, which orders every thread's reads after the polling thread's acquire,
    and, with TMA, a proxy fence for the async-proxy (TMA) reads of rows written with ordinary stores.
    """
    if (ready == 0) & (idx >= 0):
        sync.wait_geq(cnt_ptr + idx, target, budget=wait_budget, err_ptr=err_ptr, code=code, rank=rank, index=idx,
                      epoch=epoch, SCOPE="gpu")
    tl.debug_barrier()
    if TMA:
        sync.fence_proxy_async()


# --------------------------------------------------------------------------------------------
# Host mirrors
# --------------------------------------------------------------------------------------------

def decode_host(t: int, n: int, F: int, G: int, D: int, L: int = 1):
    """``decode`` in Python: the stages [F fills of s] [G gate/ups of s if s < n] [D downs of
    s - L if s >= L], empty ones skipped; ticket t of them."""
    seq = []
    for s in range(n + L):
        seq += [(0, s, p) for p in range(F)] if s < n else []
        seq += [(1, s, c) for c in range(G)] if s < n else []
        seq += [(2, s - L, c) for c in range(D)] if s >= L else []
    return seq[t]


def routed_task_host(tr: int, nt: int, pre: int, L: int, F: int, G: int, D: int, GM: int):
    """``routed_task`` in Python: (kind, row tile, column or part)."""
    if tr < pre * GM * F:
        return 0, tr // F, tr % F
    ng = -(-nt // GM)
    kind, q, c = decode_host(tr - pre * GM * F, ng, GM * F, GM * G, GM * D, L)
    if kind == 0:
        return 0, (q + pre) * GM + c // F, c % F
    return kind, q * GM + c % GM, c // GM


def routed_waits_host(kind: int, i: int, p: int, NS: int, FS: int, G: int, D: int, tile_ready: bool = False,
                      tr_base: int = 0, tokens: bool = False, n_local: int = 0, pull_idx: int = 0):
    """``routed_waits`` in Python: (idx1, target1, idx2, target2), idx < 0 for no wait."""
    r, s, g = C_READY.value, p % NS, p // NS
    idx1, target1 = [(r + NS + s, G * g), (r + s, FS * (g + 1)), (r + NS + s, G * (g + 1))][kind]
    if tile_ready and kind == 0:
        idx1 = -1
    if tile_ready and kind == 1:
        idx1, target1 = tr_base + i, FS
    if tokens and kind == 1:
        idx1, target1 = (pull_idx if p >= n_local else -1), 1
    idx2 = r + 2 * NS + s if kind == 1 else -1
    return idx1, target1, idx2, D * g


def routed_signal_host(kind: int, i: int, p: int, NS: int, tile_ready: bool = False, tr_base: int = 0) -> int:
    """``routed_signal`` in Python: the counter the ticket adds 1 to."""
    r, s = C_READY.value, p % NS
    if kind == 0:
        return tr_base + i if tile_ready else r + s
    return r + NS + s if kind == 1 else r + 2 * NS + s
