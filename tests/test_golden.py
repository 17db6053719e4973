"""Behaviour is pinned: the layer's outputs and every gradient on the cases of golden/cases.py are
bitwise the ones saved in golden/golden.pt (made by the layer as it was before its code was last
reorganised). Paths covered: the megakernel (ring, shared expert, TMA with local rows, the token
pull, recomputation in the backward, split comm programs, 4-warp programs with pipelined fills and
two-column down tickets, EP1/2/4, extreme routings) and the sync-free path.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))

from cases import BASE_TUNING, CASES, run_case  # noqa: E402

from tabby.functional import heuristics  # noqa: E402
from tabby.functional.config import MoEConfig, Tuning  # noqa: E402
from tabby.functional.moe import moe  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "golden.pt")


@pytest.fixture(scope="module")
def saved():
    return torch.load(GOLDEN)


def _small_tiles(monkeypatch):
    orig = heuristics.gemm_config
    monkeypatch.setattr(heuristics, "gemm_config", lambda kind, N, K, tile_m: orig(kind, N, K, tile_m).with_(BN=16, BK=16))


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_are_bitwise_the_saved_ones(case, saved, monkeypatch):
    c = CASES[case]
    if c["small"]:
        _small_tiles(monkeypatch)
    cfg = MoEConfig(megakernel=c["path"] == "megakernel", save_for_backward=c.get("save_for_backward", True),
                    debug=True, tuning=Tuning(**BASE_TUNING, **c["tuning"]))
    got = run_case(case, moe, None, cfg)
    want = saved[case]
    assert sorted(got) == sorted(want)
    diff = [name for name in want if not torch.equal(got[name], want[name])]
    assert not diff, f"{case}: not bitwise the saved outputs: {diff}"
