"""Faults of a peer on simulated ranks: a peer that dies in the middle of a call, one that skips a
call or a backward, one that calls with other shapes. Each is reported within the wait budget
(``MoEConfig(max_wait_polls=..., max_wait_ms=...)``), nothing hangs, and the process goes on: after
``tabby.free_workspaces()`` on every rank the next good call is right. (A peer that never publishes
x, by itself, is tests/test_moe_cpu.py's ``test_a_peer_that_never_publishes_x_is_reported``; waits
inside the megakernel that time out are tests/test_megakernel_cpu.py's.)
"""
import threading
import time

import pytest
import torch

import tabby
from tabby import MoEConfig, TabbyDeviceError, Tuning
from tabby.functional import steps
from tabby.functional.threads import run_ranks
from tabby.functional.workspace import FWD_X_READY

from harness import make_problem, rel_err

SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
W, T, H, I, E_local, k = 2, 5, 32, 16, 2, 2
POLLS = 30  # the bounded waits' budget under the interpreter
JOIN_MS = 3000.0  # how long a new workspace waits for its peers (simulated ranks: host time)


def _cfg(mega):
    return MoEConfig(megakernel=mega, debug=True, max_wait_polls=POLLS, max_wait_ms=JOIN_MS,
                     tuning=Tuning(**SMALL, **({"ring_rows": 32} if mega else {})))


PROB = make_problem(W, T, H, I, E_local, k, seed=21)


def _reference():
    x, idx, wts, ws, _, dy = PROB
    leaves = [t.clone().requires_grad_(True) for t in (x, wts, *ws)]
    y = tabby.moe_reference(leaves[0], idx, leaves[1], *leaves[2:])
    y.backward(dy)
    return y.detach(), leaves[0].grad, leaves[4].grad


REF = _reference()


def _good_call(r, group, cfg, backward=True):
    """Rank r's y, dx and w_down gradient of PROB."""
    x, idx, wts, ws, _, dy = PROB
    rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
    xr = x[rows].clone().requires_grad_(True)
    wd = ws[2][ex].clone().requires_grad_(True)
    y = tabby.moe(xr, idx[rows], wts[rows], ws[0][ex], ws[1][ex], wd, group=group, config=cfg)
    if backward:
        y.backward(dy[rows])
    return y.detach(), xr.grad, wd.grad


def _assert_right(per_rank):
    y, dx, dwd = (torch.cat([p[i] for p in per_rank]) for i in range(3))
    assert rel_err(y, REF[0]) < 2e-2 and rel_err(dx, REF[1]) < 2e-2 and rel_err(dwd, REF[2]) < 2e-2


def _recover(r, barrier):
    """Every rank frees its workspaces (here one process holds every rank's: one frees them) and
    waits for the others before its next call."""
    barrier.wait(60)
    if r == 0:
        tabby.free_workspaces()
    barrier.wait(60)


@pytest.mark.parametrize("mega", [True, False], ids=["megakernel", "separate"])
def test_a_peer_that_dies_mid_call_is_reported_then_a_call_after_recovery_is_right(mega, monkeypatch):
    cfg = _cfg(mega)
    died = threading.Event()
    real = steps._signal

    def signal(ws, slot, *a, **kw):  # rank 1 dies once, after publishing its routing, before its x
        if ws.rank == 1 and slot == FWD_X_READY and not died.is_set():
            died.set()
            raise RuntimeError("rank 1 died")
        return real(ws, slot, *a, **kw)

    monkeypatch.setattr(steps, "_signal", signal)
    barrier = threading.Barrier(W)

    def rank_fn(r, group):
        t0 = time.monotonic()
        try:
            _good_call(r, group, cfg, backward=False)
            err = None
        except (TabbyDeviceError, RuntimeError) as e:
            err = e
        waited = time.monotonic() - t0
        _recover(r, barrier)
        return err, waited, _good_call(r, group, cfg)

    res = run_ranks(W, rank_fn, timeout=300)
    (err0, waited0, good0), (err1, _, good1) = res
    assert str(err1) == "rank 1 died"
    assert isinstance(err0, TabbyDeviceError) and "timed out" in str(err0) and "free_workspaces" in str(err0)
    assert waited0 < 120  # the budget is POLLS polls, not the default's hours
    _assert_right([good0, good1])


@pytest.mark.parametrize("mega", [True, False], ids=["megakernel", "separate"])
def test_a_peer_that_skips_a_call_or_a_backward_is_reported_then_recovery_works(mega):
    cfg = _cfg(mega)
    barrier = threading.Barrier(W)

    def rank_fn(r, group):
        _good_call(r, group, cfg)  # the workspace exists: the skipped call is the protocol's to catch
        errs = {}
        barrier.wait(60)
        if r == 0:  # rank 1 skips this forward
            with pytest.raises(TabbyDeviceError) as info:
                _good_call(r, group, cfg, backward=False)
            errs["forward"] = str(info.value)
        _recover(r, barrier)
        x, idx, wts, ws, _, dy = PROB
        rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
        xr = x[rows].clone().requires_grad_(True)
        y = tabby.moe(xr, idx[rows], wts[rows], *(w[ex] for w in ws), group=group, config=cfg)
        if r == 0:  # both ran the forward; rank 1 skips the backward
            with pytest.raises(TabbyDeviceError) as info:
                y.backward(dy[rows])
            errs["backward"] = str(info.value)
        _recover(r, barrier)
        return errs, _good_call(r, group, cfg)

    (errs0, good0), (errs1, good1) = run_ranks(W, rank_fn, timeout=300)
    assert set(errs0) == {"forward", "backward"} and not errs1
    for what, msg in errs0.items():
        assert "rank 0: a bounded wait timed out (waited for a peer to publish its inputs)" in msg, (what, msg)
    _assert_right([good0, good1])


def test_a_peer_that_calls_with_other_shapes_is_reported_by_both_within_the_budget():
    """Rank 1 calls with another T once rank 0's workspace exists: rank 0's waits time out; rank 1's
    new workspace waits for rank 0 to join its shape agreement for ``max_wait_ms`` and gives up.
    A new group (a restarted job) then runs right."""
    cfg = _cfg(False)
    barrier = threading.Barrier(W)

    def rank_fn(r, group):
        _good_call(r, group, cfg, backward=False)
        barrier.wait(60)
        x, idx, wts, ws, _, _ = PROB
        n = T if r == 0 else T - 1
        rows, ex = slice(r * T, r * T + n), slice(r * E_local, (r + 1) * E_local)
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                tabby.moe(x[rows], idx[rows], wts[rows], *(w[ex] for w in ws), group=group, config=cfg)
            err = None
        except TabbyDeviceError as e:
            err = str(e)
        return err, time.monotonic() - t0

    (err0, t0), (err1, t1) = run_ranks(W, rank_fn, timeout=300)
    assert err0 is not None and "rank 0: a bounded wait timed out" in err0
    assert err1 is not None and "did not join the first call of this shape within 3.0 s" in err1
    assert JOIN_MS / 1e3 <= t1 < 60 and t0 < 120
    tabby.free_workspaces()
    _assert_right(run_ranks(W, lambda r, group: _good_call(r, group, cfg), timeout=300))


def test_without_debug_a_timeout_waits_for_check_errors():
    """Without ``debug`` nothing syncs: the call returns (its output invalid) and the next
    ``tabby.check_errors()`` raises, once; the record is then clear."""
    cfg = MoEConfig(megakernel=False, max_wait_polls=POLLS, tuning=Tuning(**SMALL))
    barrier = threading.Barrier(W)

    def rank_fn(r, group):
        _good_call(r, group, cfg, backward=False)
        barrier.wait(60)
        if r == 0:
            _good_call(r, group, cfg, backward=False)  # returns: rank 1 skipped it
        barrier.wait(60)

    run_ranks(W, rank_fn, timeout=300)
    with pytest.raises(TabbyDeviceError, match="rank 0: a bounded wait timed out"):
        tabby.check_errors()
    tabby.check_errors()
    tabby.free_workspaces()
