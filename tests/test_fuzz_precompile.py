"""scripts/fuzz.py's precompile step (a GPU fuzz's kernels compiled first, in parallel processes):
one worker per kind of kernel among the planned cases, each the case of its kind's first seed,
and a worker still running at the end of the budget is stopped. Workers are faked here (no GPU)."""
import importlib.util
import os
import sys
from typing import ClassVar

import pytest

if "tabby_fuzz" not in sys.modules:  # (tests/test_fuzz.py loads it under the same name)
    _spec = importlib.util.spec_from_file_location(
        "tabby_fuzz", os.path.join(os.path.dirname(__file__), "..", "scripts", "fuzz.py"))
    sys.modules["tabby_fuzz"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["tabby_fuzz"])
fuzz = sys.modules["tabby_fuzz"]


class _FakeWorker:
    launched: ClassVar[list] = []

    def __init__(self, argv, **kw):
        self.seed = int(argv[argv.index("--seed") + 1])
        self.returncode = None
        _FakeWorker.launched.append(self)

    def poll(self):
        if self.seed % 7 == 3:  # stays running: the budget must stop it
            return None
        self.returncode = 0
        return 0

    def kill(self):
        self.returncode = -9

    def wait(self):
        return self.returncode


def test_one_worker_per_kernel_kind_and_over_budget_workers_stopped(monkeypatch):
    _FakeWorker.launched = []
    monkeypatch.setattr(fuzz.subprocess, "Popen", _FakeWorker)
    monkeypatch.setattr(fuzz.time, "sleep", lambda s: None)
    monkeypatch.setattr(fuzz.os, "cpu_count", lambda: 128)  # every worker at once
    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr(fuzz.time, "time", lambda: float(next(clock)))
    seeds = list(range(60))
    kinds = {}
    for s in seeds:
        kinds.setdefault(fuzz.kernel_kind(fuzz.draw_case(s, worlds=(1,), small=False)), s)
    assert 1 < len(kinds) < len(seeds)  # several kinds, and cases that share one
    lines = []
    fuzz.precompile(seeds, (1,), budget_s=500, say=lines.append)
    launched = [w.seed for w in _FakeWorker.launched]
    assert sorted(launched) == sorted(kinds.values())  # each kind once, by its first seed
    stuck = [w for w in _FakeWorker.launched if w.seed % 7 == 3]
    assert all(w.returncode == -9 for w in stuck)
    assert lines and f"of {len(kinds)} kernel kinds" in lines[0]


def test_no_precompile_without_budget(monkeypatch):
    monkeypatch.setattr(fuzz.subprocess, "Popen", lambda *a, **k: pytest.fail("no worker expected"))
    lines = []
    fuzz.precompile(list(range(5)), (1,), budget_s=0, say=lines.append)
    assert "0 of" in lines[0]
