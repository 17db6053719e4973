"""The backward megakernel (``tabby/ops/megakernel/backward.py``) on the CPU: ranks as threads,
kernels interpreted.

Each case runs the layer's forward and backward twice, with the backward of separate launches
and with the backward megakernel: y and every gradient must be bitwise equal (the megakernel
runs the same tile functions in the same K order), and within bf16 tolerance of the reference.
The ticket order is checked on its host mirror: every ticket exactly once, producers before
consumers, and no deadlock under random interleavings of a few programs.
"""
import random

import pytest
import torch

from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.plan import make_plan
from tabby.ops.megakernel.backward import BwdPlan, bwd_order, ticket_order_host
from tabby.ops.gemm import GemmConfig
from tabby.validate import MoEDims, MoEInputError

from harness import make_problem
from test_moe_cpu import SMALL, _check, _run_reference, _run_tabby

CASES = {
    # name: (W, T, H, I, E_local, k, shared, route, forward megakernel, keep rows)
    "ep1-odd": (1, 9, 32, 24, 3, 2, False, "random", False, True),
    "ep1-t1": (1, 1, 32, 16, 4, 3, False, "random", False, True),
    "ep2-one-expert": (2, 6, 32, 16, 2, 2, False, "one_expert", False, True),
    "ep2-one-rank": (2, 5, 32, 16, 2, 2, False, "one_rank", False, True),
    "ep3-shared": (3, 4, 48, 40, 2, 3, True, "random", False, True),
    "ep2-mega-fwd-recompute": (2, 4, 32, 24, 2, 2, False, "random", True, False),
    "ep4": (4, 3, 32, 16, 2, 2, False, "random", False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_backward_megakernel_is_bitwise_the_separate_launches(case):
    W, T, H, I, E_local, k, shared, route, mega_fwd, keep = CASES[case]
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=len(case) * 7 + W, route=route)
    got = {}
    for mb in (False, True):
        cfg = MoEConfig(megakernel=mega_fwd, save_for_backward=keep, tuning=Tuning(**SMALL, mega_backward=mb))
        got[mb] = _run_tabby(W, T, prob, cfg=cfg)
    for name, want in got[False].items():
        assert torch.equal(got[True][name], want), f"{name} differs from the separate launches' backward"
    _check(got[True], _run_reference(prob))


def test_backward_megakernel_plan_and_refusals():
    dims = MoEDims(T=64, H=256, k=2, E_local=4, I=128, world_size=1, I_shared=0)
    plan = make_plan(dims, MoEConfig(megakernel=False, tuning=Tuning(mega_backward=True)), torch.device("cpu"))
    assert plan.mega_backward is not None and plan.mega_backward.dgrad.BM == plan.tile_m
    assert make_plan(dims, MoEConfig(megakernel=False), torch.device("cpu")).mega_backward is None
    with pytest.raises(MoEInputError, match="mega_backward"):
        make_plan(dims, MoEConfig(megakernel=False, precision="fp8", tuning=Tuning(mega_backward=True)),
                  torch.device("cpu"))
    with pytest.raises(ValueError, match="fill_split"):
        _plan(FS=3)


def _plan(BM=16, GM=2, FS=2, P=1, L=1, H=48, I=40):
    c = GemmConfig(BM=BM, BN=16, BK=16)
    w = GemmConfig(BM=32, BN=32, BK=16)
    return BwdPlan(H=H, I=I, tile_m=BM, group_m=GM, prefetch=P, xgrad_lag=L, fill_split=FS, fill_cols=32,
                   programs=3, num_warps=8, num_stages=2, dgrad=c, xgrad=c, wgrad_down=w, wgrad_gate_up=w)


def _deps(kind, a, b, plan, NI):
    """What a ticket waits for: (counter kind, index, target) as the kernel's waits."""
    if kind == "dgrad":
        return [("fill", a, plan.fill_split)]
    if kind == "xgrad":
        return [("dgrad", a, NI)]
    return []


@pytest.mark.parametrize("P,L,GM,n_tiles", [(0, 1, 1, 5), (1, 1, 2, 7), (2, 3, 4, 9), (1, 2, 3, 1)])
def test_ticket_order_has_each_task_once_and_producers_first(P, L, GM, n_tiles):
    plan = _plan(GM=GM, P=P, L=L)
    E_local = 3
    seq = ticket_order_host(plan, n_tiles, E_local)
    o = bwd_order(plan, n_tiles)
    NI, NX = -(-plan.I // plan.dgrad.BN), -(-plan.H // plan.xgrad.BN)
    assert len(seq) == o.routed + E_local * o.per_expert()
    real = [s for s in seq if s[0] != "empty"]
    want = ([("fill", i, p) for i in range(n_tiles) for p in range(plan.fill_split)]
            + [("dgrad", i, n) for i in range(n_tiles) for n in range(NI)]
            + [("xgrad", i, n) for i in range(n_tiles) for n in range(NX)]
            + [("wgrad", e, j) for e in range(E_local) for j in range(o.per_expert())])
    assert sorted(real) == sorted(want)  # each task exactly once
    pos = {s: p for p, s in enumerate(seq) if s[0] != "empty"}
    for i in range(n_tiles):
        last_fill = max(pos[("fill", i, p)] for p in range(plan.fill_split))
        first_dgrad = min(pos[("dgrad", i, n)] for n in range(NI))
        last_dgrad = max(pos[("dgrad", i, n)] for n in range(NI))
        assert last_fill < first_dgrad and last_dgrad < min(pos[("xgrad", i, n)] for n in range(NX))
        assert last_dgrad < min(p for s, p in pos.items() if s[0] == "wgrad")


@pytest.mark.parametrize("programs", [1, 2, 5])
def test_random_interleavings_never_deadlock(programs):
    """Programs take tickets in order and block on their waits; under random scheduling every
    ticket completes (a ticket waits only on tickets taken before it)."""
    plan = _plan(GM=2, P=1, L=1)
    n_tiles, E_local = 6, 2
    NI = -(-plan.I // plan.dgrad.BN)
    seq = ticket_order_host(plan, n_tiles, E_local)
    rng = random.Random(programs)
    for trial in range(20):
        count = {}
        next_ticket = 0
        held = [None] * programs  # the ticket each program works on
        done = 0
        steps = 0
        while done < len(seq):
            steps += 1
            assert steps < 100 * len(seq), "no progress: deadlock"
            p = rng.randrange(programs)
            if held[p] is None:
                if next_ticket < len(seq):
                    held[p] = seq[next_ticket]
                    next_ticket += 1
                continue
            kind, a, b = held[p]
            if kind == "wgrad":
                ok = all(count.get(("dgrad", i), 0) >= NI for i in range(n_tiles))
            else:
                ok = all(count.get((dk, di), 0) >= t for dk, di, t in _deps(kind, a, b, plan, NI))
            if ok:
                if kind in ("fill", "dgrad"):
                    count[(kind, a)] = count.get((kind, a), 0) + 1
                held[p] = None
                done += 1
