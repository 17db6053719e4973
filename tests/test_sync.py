"""tabby/ops/sync.py under the interpreter: bounded waits and the error record."""
import time

import pytest
import torch
import triton
import triton.language as tl

from tabby.ops import sync


@triton.jit
def _wait_kernel(flag, target, max_iters, err, out):
    seen = sync.wait_geq(flag, target, max_iters, err, sync.ERR_WAIT_TILE, 3, 7, 11, "gpu")
    tl.store(out, seen)


def _run(flag_value, target, max_iters, err_preset=0):
    flag = torch.tensor([flag_value], dtype=torch.int32)
    err = torch.zeros(sync.ERR_WORDS, dtype=torch.int32)
    err[0] = err_preset
    out = torch.zeros(1, dtype=torch.int32)
    _wait_kernel[(1,)](flag, target, max_iters, err, out)
    return int(out), err.tolist()


def test_satisfied_wait_leaves_no_record():
    seen, err = _run(5, 5, 10)
    assert seen == 5 and err == [0] * sync.ERR_WORDS


def test_timed_out_wait_records_what_it_waited_for():
    seen, err = _run(2, 9, 100)
    assert seen == 2
    assert err[:6] == [sync.ERR_WAIT_TILE, 3, 7, 9, 2, 11]


@pytest.mark.parametrize("budget", [1 << 30])
def test_earlier_error_aborts_a_wait_early(budget):
    # With an error already recorded, a wait that can never be met gives up after one check
    # interval instead of polling 2^30 times; the first error stays in the record.
    t0 = time.perf_counter()
    seen, err = _run(0, 1, budget, err_preset=sync.ERR_WAIT_PEER_DONE)
    assert time.perf_counter() - t0 < 60
    assert seen == 0 and err[0] == sync.ERR_WAIT_PEER_DONE


@triton.jit
def _poll2_kernel(cnt, i1, t1, i2, t2, out):
    ok = sync.poll2(cnt, i1, t1, i2, t2, 4)
    tl.store(out, ok.to(tl.int32))


@pytest.mark.parametrize("i1,t1,i2,t2,ok", [
    (1, 5, 2, 3, 1),     # both counters reached
    (1, 6, 2, 3, 0),     # the first short by one
    (1, 5, 2, 4, 0),     # the second short by one
    (1, 6, -1, 99, 0),   # second unused, first short
    (-1, 99, 2, 3, 1),   # first unused
    (-1, 99, -1, 99, 1),  # nothing to wait for
])
def test_poll2(i1, t1, i2, t2, ok):
    cnt = torch.tensor([7, 5, 3], dtype=torch.int32)
    out = torch.full((1,), -5, dtype=torch.int32)
    _poll2_kernel[(1,)](cnt, i1, t1, i2, t2, out)
    assert out[0] == ok
    assert cnt.tolist() == [7, 5, 3]  # polls add nothing


@triton.jit
def _signal_take_kernel(cnt, idx, release, out):
    tl.store(out, sync.signal_take(cnt, idx, release, 0, 4))


@pytest.mark.parametrize("idx,release", [(1, 1), (2, 0), (-1, 1)])
def test_signal_take(idx, release):
    cnt = torch.tensor([7, 5, 3], dtype=torch.int32)  # [0]: the ticket counter
    out = torch.full((1,), -5, dtype=torch.int32)
    _signal_take_kernel[(1,)](cnt, idx, release, out)
    want = [8, 5, 3]
    if idx >= 0:
        want[idx] += 1
    assert out[0] == 7 and cnt.tolist() == want  # the old ticket value; each counter added to once
