"""The soak's logic (scripts/soak.py) on the CPU with a few calls: it runs every configuration on
every input set, repeats bitwise, reads the error records, and reports a call whose result differs
from its first (here made to differ on purpose). The long run is the GPU stage's."""
import importlib.util
import json
import os
import sys

import torch

import tabby

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "soak.py")
_spec = importlib.util.spec_from_file_location("tabby_soak", _PATH)
soak = sys.modules["tabby_soak"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

SMALL = ["--device", "cpu", "--T", "6", "--H", "32", "--I", "16", "--E", "4", "--k", "2", "--check-every", "4"]


def test_soak_of_tabby_on_the_cpu_passes(tmp_path):
    args = soak.parse_args(["--calls", "6", "--inputs", "1", "--out", str(tmp_path)] + SMALL)
    summary = soak.run(args)
    assert summary["ok"] and summary["mismatch_count"] == 0 and not summary["device_errors"]
    assert summary["configs"] == list(soak.CONFIGS) and summary["memory"]["checked"] is False
    saved = json.loads((tmp_path / "soak-summary.json").read_text())
    assert saved["calls"] == 6 and saved["ok"]
    log = (tmp_path / "soak.log").read_text()
    assert "call 6/6: 0 mismatches, 0 device errors" in log


def test_soak_reports_a_result_that_differs_from_the_first(tmp_path):
    calls = []

    # the reference, off by a little on call 12 (after the warm-up's 9 calls)
    def layer(x, idx, wts, wg, wu, wd, group=None, config=None):
        y = tabby.moe_reference(x, idx, wts, wg, wu, wd)
        calls.append(config)
        return y * (1 + 2 ** -6) if len(calls) == 13 else y

    args = soak.parse_args(["--calls", "30", "--inputs", "3", "--out", str(tmp_path)] + SMALL)
    summary = soak.run(args, layer=layer)
    assert len(calls) == 30 and not summary["ok"] and summary["mismatch_count"] == 1
    bad = summary["mismatches"][0]
    assert bad["call"] == 12 and "y" in bad["differs"] and "dx" in bad["differs"]
    assert soak.main(["--calls", "2", "--inputs", "1", "--configs", "separate"] + SMALL) == 0


def test_every_routing_of_the_soak_is_valid():
    for n, route in enumerate(soak.ROUTES):
        for W in (1, 2):
            _, idx, wts, _ = soak.make_inputs(n, route, 16, 8, 6, 3, W, 0, torch.device("cpu"))
            assert idx.shape == (16, 3) and idx.min() >= 0 and idx.max() < 6 and wts.shape == (16, 3)
            if route == "empty_rank" and W == 2:
                assert not ((idx // 3) == n % 2).any()


def test_soak_stops_at_the_next_checkpoint_after_an_exception(tmp_path):
    calls = []

    def layer(x, idx, wts, wg, wu, wd, group=None, config=None):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("lost the device")
        return tabby.moe_reference(x, idx, wts, wg, wu, wd)

    args = soak.parse_args(["--calls", "40", "--inputs", "1", "--out", str(tmp_path)] + SMALL)  # checks every 4
    summary = soak.run(args, layer=layer)
    first = summary["raised"][0]
    assert not summary["ok"] and first["call"] == 5 and "lost the device" in first["error"]
    assert summary["calls"] == 8 and len(calls) == 6  # no call after it; stopped at the checkpoint after call 8


def test_memory_growth_tells_a_leak_from_a_cache_that_flips():
    MiB = 2 ** 20
    flips = [100 * MiB, 110 * MiB] * 6  # one configuration's buffers held, then the other's
    assert soak.memory_growth(flips, flips, 100 * MiB) == (0, 0)
    leak = [100 * MiB + i * MiB for i in range(12)]
    growth, peak_growth = soak.memory_growth(leak, leak, 100 * MiB)
    assert growth == 8 * MiB and peak_growth == 8 * MiB and growth > soak.MEMORY_SLACK
    assert soak.memory_growth([100 * MiB, 103 * MiB], [5, 5], 100 * MiB) == (3 * MiB, 0)
