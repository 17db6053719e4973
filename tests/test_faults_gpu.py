"""A fault on the GPU (one rank): a backward whose publish never signals its peers (this rank is
its own peer at EP1) waits in a real kernel until the wait budget runs out, is reported as a
``TabbyDeviceError`` well inside the budget's order of time, and after ``tabby.free_workspaces()``
the next call is bitwise the call before the fault. The simulated-rank faults (a peer that dies,
skips a call, calls other shapes) are tests/test_faults.py. Skips without a GPU.
"""
import time

import pytest
import torch

import tabby
from tabby import MoEConfig, TabbyDeviceError
from tabby.functional import backward as backward_mod
from tabby.functional import steps
from tabby.functional.workspace import BWD_READY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

T, H, I, E, k = 64, 256, 128, 4, 2
WAIT_MS = 200.0


def _call(cfg, inp):
    x, idx, wts, ws, dy = inp
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wts, *ws)]
    y = tabby.moe(leaves[0], idx, leaves[1], *leaves[2:], config=cfg)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("mega", [True, False], ids=["megakernel", "separate"])
def test_a_backward_whose_peer_never_signals_is_reported_then_the_next_call_is_right(mega, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    vals, idx = torch.randn(T, E, generator=g, device="cuda").topk(k, dim=1)
    ws = [(torch.randn(*s, generator=g, device="cuda") / s[-1] ** 0.5).bfloat16() for s in ((E, I, H), (E, I, H),
                                                                                             (E, H, I))]
    inp = (x, idx, torch.softmax(vals, 1), ws, torch.randn(T, H, generator=g, device="cuda").bfloat16())
    cfg = MoEConfig(megakernel=mega, max_wait_ms=WAIT_MS)
    before = _call(cfg, inp)
    tabby.check_errors()

    real = steps.signal_and_wait

    def never_signals_bwd_ready(ws_, slot, epoch_idx, bump, code, plan):
        if slot == BWD_READY:  # the pass's epoch moves on, its flag is never set: the wait runs out
            ws_.epoch[epoch_idx:epoch_idx + 1].add_(1)
            steps._wait(ws_, slot, epoch_idx, code, plan)
            return
        real(ws_, slot, epoch_idx, bump, code, plan)

    monkeypatch.setattr(backward_mod, "signal_and_wait", never_signals_bwd_ready)
    t0 = time.monotonic()
    with pytest.raises(TabbyDeviceError, match="timed out"):
        _call(cfg, inp)
        tabby.check_errors()
    waited = time.monotonic() - t0
    assert waited < 30, f"reported after {waited:.1f} s with a {WAIT_MS} ms budget"
    monkeypatch.undo()
    tabby.free_workspaces()
    after = _call(cfg, inp)
    tabby.check_errors()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the call after recovery differs"
