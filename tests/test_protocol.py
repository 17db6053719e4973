"""The forward megakernel's protocol (tabby/ops/megakernel/protocol.py) on its own.

The device functions against their host mirrors; the counter layout; a wait on index -1; and a
model of the protocol run under random interleavings of programs: the interpreter only ever runs
a launch's programs one after another, so it cannot show a race or a deadlock of another
interleaving, while the model takes every ticket's waits and signal from the host mirrors (the
same counters and targets as the kernel) and checks, against its own account of which task reads
and writes what, that no task starts before what it reads is written or while it is overwritten.
"""
import random

import pytest
import torch
import triton
import triton.language as tl

from tabby.ops import sync
from tabby.ops.gemm.bf16 import GemmConfig
from tabby.ops.megakernel import MegaPlan, alloc, counter_layout, protocol as P


# ------------------------------------------------------------------------------------------------
# Device functions against their host mirrors
# ------------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(out, n, F, G, D, L, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    kind, tile, col = P.decode(t, n, F, G, D, L)
    tl.store(out + t * 3, kind)
    tl.store(out + t * 3 + 1, tile)
    tl.store(out + t * 3 + 2, col)


def test_decode_matches_its_mirror_and_hands_out_every_task_once():
    for n, F, G, D, L in [(5, 1, 2, 3, 1), (3, 0, 1, 1, 1), (1, 1, 3, 2, 1), (4, 0, 2, 5, 1), (5, 4, 2, 3, 2),
                          (2, 2, 1, 2, 4), (6, 3, 2, 1, 3), (0, 1, 1, 1, 2)]:
        total = n * (F + G + D)
        out = torch.zeros(128, 3, dtype=torch.int32)
        _decode_kernel[(1,)](out, n, F, G, D, L, BLOCK=128)
        want = [P.decode_host(t, n, F, G, D, L) for t in range(total)]
        assert [tuple(r) for r in out[:total].tolist()] == want
        assert sorted(want) == sorted([(0, i, p) for i in range(n) for p in range(F)]
                                      + [(1, i, c) for i in range(n) for c in range(G)]
                                      + [(2, i, c) for i in range(n) for c in range(D)])


@triton.jit
def _routed_task_kernel(out, nt, pre, L, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GM: tl.constexpr,
                        BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    kind, i, n = P.routed_task(t, nt, pre, L, F, G, D, GM)
    tl.store(out + t * 3, kind)
    tl.store(out + t * 3 + 1, i)
    tl.store(out + t * 3 + 2, n)


@pytest.mark.parametrize("GM", [1, 2, 3])
def test_routed_task_matches_its_mirror_and_covers_every_task(GM):
    for nt, pre, L, F, G, D in [(5, 1, 1, 1, 2, 3), (7, 2, 2, 2, 1, 2), (4, 0, 3, 0, 2, 2), (1, 1, 1, 4, 1, 1)]:
        ng = -(-nt // GM)
        total = pre * GM * F + ng * GM * (F + G + D)
        out = torch.zeros(256, 3, dtype=torch.int32)
        _routed_task_kernel[(1,)](out, nt, pre, L, F, G, D, GM, BLOCK=256)
        want = [P.routed_task_host(t, nt, pre, L, F, G, D, GM) for t in range(total)]
        assert [tuple(r) for r in out[:total].tolist()] == want
        real = sorted(w for w in want if w[1] < nt)  # every task of every row tile exactly once
        assert real == sorted([(0, i, p) for i in range(nt) for p in range(F)]
                              + [(1, i, c) for i in range(nt) for c in range(G)]
                              + [(2, i, c) for i in range(nt) for c in range(D)])


@triton.jit
def _waits_kernel(out, kind_ptr, i_ptr, p_ptr, tr_base, n_local, pull_idx, NS: tl.constexpr, FS: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, TR: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    kind, i, p = tl.load(kind_ptr + r), tl.load(i_ptr + r), tl.load(p_ptr + r)
    w1, t1, w2, t2 = P.routed_waits(kind, i, p, NS=NS, FS=FS, G=G, D=D, TR=TR, tr_base=tr_base, TOK=TOK,
                                    n_local=n_local, pull_idx=pull_idx)
    sig = P.routed_signal(kind, i, p, NS=NS, TR=TR, tr_base=tr_base)
    for c, v in enumerate((w1, t1, w2, t2, sig)):
        tl.store(out + r * 5 + c, v)


@pytest.mark.parametrize("TR,TOK", [(False, False), (True, False), (False, True)])
def test_waits_and_signals_match_their_mirrors(TR, TOK):
    NS, FS, G, D, tr_base, n_local, pull_idx = 3, 2, 4, 5, 40, 4, 99
    cases = [(kind, i, p) for kind in range(3) for p in range(9) for i in ((p + 5) % 9,) if not (TOK and kind == 0)]
    cases += [(kind, p, p) for kind in range(3) for p in range(9) if not (TOK and kind == 0)]
    BLOCK = triton.next_power_of_2(len(cases))
    cols = [torch.tensor([c[j] for c in cases] + [0] * (BLOCK - len(cases)), dtype=torch.int32) for j in range(3)]
    out = torch.zeros(BLOCK, 5, dtype=torch.int32)
    _waits_kernel[(1,)](out, *cols, tr_base, n_local, pull_idx, NS=NS, FS=FS, G=G, D=D, TR=TR, TOK=TOK, BLOCK=BLOCK)
    for r, (kind, i, p) in enumerate(cases):
        want = P.routed_waits_host(kind, i, p, NS, FS, G, D, tile_ready=TR, tr_base=tr_base, tokens=TOK,
                                   n_local=n_local, pull_idx=pull_idx)
        want += (P.routed_signal_host(kind, i, p, NS, tile_ready=TR, tr_base=tr_base),)
        assert tuple(out[r].tolist()) == want, (kind, i, p)


def test_counter_layout_has_one_counter_per_role():
    lay = counter_layout(n_slots=4, n_sh=3, n_tiles=7)
    ranges = [range(lay.ticket, lay.ticket + 1), range(lay.fill_ticket, lay.fill_ticket + 1),
              range(lay.ready, lay.ready + 4), range(lay.gu_done, lay.gu_done + 4), range(lay.dn_done, lay.dn_done + 4),
              range(lay.sh_gu, lay.sh_gu + 3), range(lay.tile_ready, lay.tile_ready + 7),
              range(lay.programs_done, lay.programs_done + 1), range(lay.pulled, lay.pulled + 1)]
    used = sorted(i for r in ranges for i in r)
    assert used == list(range(lay.total))  # disjoint and dense
    assert (lay.ticket, lay.fill_ticket, lay.ready) == (P.C_TICKET.value, P.C_FILL_TICKET.value, P.C_READY.value)
    assert counter_layout(4, 0, 0).tile_ready == lay.ready + 3 * 4 + 1  # sh_gu keeps one counter without a shared expert


@triton.jit
def _wait_kernel(cnt_ptr, err_ptr, idx, target, budget):
    P.wait_counter(cnt_ptr, idx, target, budget, err_ptr, sync.ERR_WAIT_TILE, 0, 1)


def test_wait_on_index_minus_one_is_no_wait():
    """Index -1 is the protocol's "no wait": ``wait_counter`` must not read the word before the
    counters. The counters start one always-zero guard word into their allocation, so a wait that
    did read it would time out here every time; a real unmet wait still is an error record."""
    cfg = GemmConfig(BM=16, BN=16, BK=16)
    plan = MegaPlan(H=16, I=16, I_s=0, tile_m=16, n_slots=2, group_m=1, prefetch=0, down_lag=1, fill_split=1,
                    fill_cols=16, fill_stages=1, programs=2, comm_programs=0, num_warps=4, num_stages=2, gate_up=cfg,
                    down=cfg, shared_gate_up=None, shared_down=None, down_cols=1, tma=False, half_tiles=False,
                    local_rows=False, token_pull=False)
    c = alloc(plan, T=8, n_tiles=2, dtype=torch.bfloat16, device=torch.device("cpu")).counters
    guard = torch.empty(0, dtype=torch.int32).set_(c.untyped_storage())
    assert c.storage_offset() == 1 and int(guard[0]) == 0
    err = torch.zeros(sync.ERR_WORDS, dtype=torch.int32)
    _wait_kernel[(1,)](c, err, -1, 1, 50)
    assert int(err[0]) == sync.ERR_NONE, err.tolist()
    _wait_kernel[(1,)](c, err, 3, 1, 50)
    assert int(err[0]) == sync.ERR_WAIT_TILE and int(err[2]) == 3


# ------------------------------------------------------------------------------------------------
# The protocol under concurrent interleavings (a model)
# ------------------------------------------------------------------------------------------------

def _simulate(nt, NS, G, D, pre, programs, comm, rng, L=1, FS=1, GM=1, TR=False):
    """Run the routed protocol with a random interleaving of ``programs`` programs (``comm`` of them
    comm programs). A task is: wait (its counters, ``routed_waits_host``), work (an interval other
    programs may overlap), signal (``routed_signal_host``). Checks that no task starts its work while
    the data it reads is not yet written or is being overwritten, and that the run never deadlocks.
    TR: a kept forward's per-tile fill counters (fills write rows of their own, not a ring slot)."""
    F = 0 if comm else FS
    pre = pre if F else 0
    total = pre * GM * F + -(-nt // GM) * GM * (F + G + D)
    lay = counter_layout(NS, 0, max(nt, 1))
    cnt = [0] * lay.total
    done = set()  # finished tasks
    working = set()  # tasks between their wait and their signal
    state = [None] * programs  # None: needs a ticket; ("wait"|"work", task); "exit"
    kinds = ("fill", "gu", "dn")

    def task_of(p):
        if p < comm:
            f = cnt[lay.fill_ticket]
            cnt[lay.fill_ticket] += 1
            return ("fill", f // FS, f % FS) if f < nt * FS else None
        t = cnt[lay.ticket]
        cnt[lay.ticket] += 1
        if t >= total:
            return None
        kind, i, c = P.routed_task_host(t, nt, pre, L, F, G, D, GM)
        return ("nop", 0, 0) if i >= nt else (kinds[kind], i, c)

    def ready(task):
        kind, i, _ = task
        if kind == "nop":
            return True
        w1, t1, w2, t2 = P.routed_waits_host(kinds.index(kind), i, i, NS, FS, G, D, tile_ready=TR,
                                             tr_base=lay.tile_ready)
        return (w1 < 0 or cnt[w1] >= t1) and (w2 < 0 or cnt[w2] >= t2)

    def check_start(task):
        kind, i, _ = task
        busy = done | working
        if kind == "fill":  # xs slot: every reader of the previous generation finished
            assert TR or i < NS or all(("gu", i - NS, c) in done for c in range(G)), task
        elif kind == "gu":  # its rows are there and stay; the h slot's previous readers finished
            assert all(("fill", i, p) in done for p in range(FS)), task
            assert TR or not any(("fill", i + NS, p) in busy for p in range(FS)), task
            assert i < NS or all(("dn", i - NS, c) in done for c in range(D)), task
        elif kind == "dn":  # every h column tile is there and stays
            assert all(("gu", i, c) in done for c in range(G)), task
            assert not any(("gu", i + NS, c) in busy for c in range(G)), task

    def signal(task):
        kind, i, _ = task
        if kind != "nop":
            cnt[P.routed_signal_host(kinds.index(kind), i, i, NS, tile_ready=TR, tr_base=lay.tile_ready)] += 1

    steps = 0
    while any(st != "exit" for st in state):
        movable = [p for p, st in enumerate(state)
                   if st is None or (st != "exit" and (st[0] == "work" or ready(st[1])))]
        assert movable, f"deadlock: {state} {cnt}"
        p = rng.choice(movable)
        st = state[p]
        if st is None:
            task = task_of(p)
            state[p] = "exit" if task is None else ("wait", task)
        elif st[0] == "wait":
            check_start(st[1])
            working.add(st[1])
            state[p] = ("work", st[1])
        else:
            working.discard(st[1])
            done.add(st[1])
            signal(st[1])
            state[p] = None
        steps += 1
    assert all(("dn", i, c) in done for i in range(nt) for c in range(D))
    return steps


@pytest.mark.parametrize("NS,pre,comm,L,FS,GM", [
    (2, 0, 0, 1, 1, 1), (2, 1, 0, 1, 1, 1), (3, 2, 0, 1, 1, 1), (4, 1, 0, 1, 1, 1), (2, 0, 1, 1, 1, 1),
    (3, 0, 2, 1, 1, 1), (4, 2, 0, 3, 2, 1), (5, 4, 0, 4, 4, 1), (3, 1, 0, 2, 2, 1), (4, 0, 2, 3, 4, 1),
    (4, 1, 0, 1, 2, 2), (6, 1, 0, 2, 1, 2), (6, 0, 0, 1, 2, 3), (8, 1, 0, 1, 2, 4), (6, 0, 2, 2, 1, 2)])
@pytest.mark.parametrize("TR", [False, True])
def test_protocol_model_random_interleavings(NS, pre, comm, L, FS, GM, TR):
    rng = random.Random(NS * 100 + pre * 10 + comm + 1000 * L + 10000 * FS + 100000 * GM + 7 * TR)
    for trial in range(60):
        nt = rng.randint(0, 12)
        G, D = rng.randint(1, 3), rng.randint(1, 3)
        programs = comm + rng.randint(1, 6)
        _simulate(nt, NS, G, D, pre, programs, comm, rng, L=L, FS=FS, GM=GM, TR=TR)


def test_protocol_model_catches_a_lag_as_long_as_the_ring():
    # down(i - L) must come before gate/up(i + 1) of the next generation of its slot: L = NS deadlocks
    with pytest.raises(AssertionError, match="deadlock"):
        for seed in range(20):
            _simulate(8, 2, 1, 1, 0, 1, 0, random.Random(seed), L=2)
    with pytest.raises(AssertionError, match="deadlock"):  # groups of 2 in 4 slots: 2 groups, L = 2 too long
        for seed in range(20):
            _simulate(8, 4, 1, 1, 0, 1, 0, random.Random(seed), L=2, GM=2)


def test_protocol_model_catches_a_one_slot_ring():
    # with one slot gate/up(i) waits on down(i-1), a later ticket: deadlock once every program holds a
    # gate/up ticket (here the one program; under the interpreter, program 0)
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(4, 1, 2, 2, 0, 1, 0, random.Random(0))
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(4, 1, 2, 2, 0, 2, 0, random.Random(0))  # two programs, both on gate/up(1, *)
