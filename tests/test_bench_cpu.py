"""`tabby bench` without a GPU: the CPU demonstration (simulated ranks, checks against fp64)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tabby.reference import moe_reference
from tabby_bench import cpu_demo
from tabby_bench.anchors.torch_a2a import moe_torch_a2a
from tabby_bench.shapes import Shape

SMALL = Shape("small", 4, 32, 16, 2, I_shared=16)


def test_a_problem_split_over_ranks_reassembles_to_the_reference():
    # the reference on each rank's part (one process per rank: group None sees only its experts when
    # ep == 1) reassembles to the whole problem's y and gradients
    p = cpu_demo.make_problem(SMALL, 8, 1)
    runs = p.rank_call(moe_reference, 0, None)
    ref = p.reference()
    got = cpu_demo.compare([p.assemble([r]) for r in runs], ref)
    assert got["repeat_changed"] == []
    assert set(got["errors"]) == {"y", *cpu_demo.GRAD_NAMES}
    assert all(v < 1e-2 for v in got["errors"].values()), got


def test_compare_flags_a_repeat_that_differs_and_a_wrong_value():
    p = cpu_demo.make_problem(SMALL, 8, 1)
    first, second = p.rank_call(moe_torch_a2a, 0, None)
    second = dict(second, dx=second["dx"] * (1 + 2 ** -6))
    got = cpu_demo.compare([first, second], dict(p.reference(), y=torch.zeros_like(first["y"]) + 1))
    assert got["repeat_changed"] == ["dx"] and got["errors"]["y"] > 0.5


def test_assemble_sums_the_shared_gradients_and_concatenates_the_rest():
    a = {"y": torch.ones(2, 3), "dw_gate": torch.ones(1, 2), "dshared_up": torch.ones(2)}
    b = {"y": torch.zeros(2, 3), "dw_gate": torch.zeros(1, 2), "dshared_up": torch.full((2,), 2.0)}
    out = cpu_demo.make_problem(SMALL, 8, 2).assemble([a, b])
    assert out["y"].shape == (4, 3) and out["dw_gate"].shape == (2, 2)
    assert out["dshared_up"].tolist() == [3.0, 3.0]


def test_cases_and_their_share_among_processes():
    shapes = list(cpu_demo.CPU_SHAPES.values())
    cases = cpu_demo.plan_cases(shapes, [32], None, cpu_demo.CPU_IMPLS)
    eps = {(c.shape.name, c.ep) for c in cases}
    assert eps == {("tiny", 1), ("tiny", 2), ("tiny", 4), ("tiny-top4", 1), ("tiny-top4", 2)}
    share = cpu_demo.assign(cases, 4)
    tabby_cases = [c for c in cases if c.impl.startswith("tabby")]
    assert sorted(map(str, sum(share, []))) == sorted(map(str, tabby_cases))
    loads = [sum(c.cost for c in w) for w in share]
    assert max(loads) <= max(c.cost for c in tabby_cases) + min(loads)  # longest first, to the least loaded


def test_table_has_only_what_the_cpu_measures():
    r = dict(shape="tiny", tokens_per_gpu=32, ep=2, impl="tabby", errors={"y": 1e-3, "dx": 2e-3, "dw_down": 5e-3},
             repeat_bitwise=True, repeat_changed=[], correct=True, error=None, wall_s=1.0)
    bad = dict(r, impl="tabby-sync-free", error="RuntimeError: no", correct=False)
    lines = cpu_demo.format_table([r, bad]).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["shape", "T/rank", "EP", "impl", "y err", "worst grad err", "repeat", "correct"]
    assert [c.strip() for c in lines[2].strip("|").split("|")][4:] == ["1.0e-03", "5.0e-03 (dw_down)", "bitwise",
                                                                      "yes"]
    assert lines[3].rstrip(" |").endswith("error")
    assert "dw_down 5.0e-03, repeats bitwise, correct" in cpu_demo.progress_line(r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demonstration runs only without a GPU")
def test_cpu_bench_end_to_end(tmp_path, capsys):
    # a small run through the command line: the reference and torch-a2a over gloo at EP1 and EP2,
    # Tabby's sync-free path with simulated ranks at EP2 (its megakernel: tests/test_megakernel_cpu.py)
    from tabby_bench import cli

    out = tmp_path / "res"
    assert cli.main(["bench", "--shapes", "tiny", "--tokens", "16", "--ep", "1,2", "--out", str(out), "--tag", "ci",
                     "--impls", "reference,torch-a2a,tabby-sync-free,torch-symm"]) == 0
    text = capsys.readouterr().out
    assert "torch-symm need a GPU" in text and "Timings need a GPU" in text and str(out) in text
    (path,) = [p for p in os.listdir(out) if p.endswith(".json")]
    assert path.startswith("bench-cpu-ci-") and os.path.exists(out / (path[:-5] + ".md"))
    res = json.loads((out / path).read_text())
    assert res["mode"] == "cpu" and res["gpu_count"] == 0 and res["git_commit"]
    got = {(r["impl"], r["ep"]): r for r in res["records"]}
    assert set(got) == {(i, ep) for i in ("reference", "torch-a2a", "tabby-sync-free") for ep in (1, 2)}
    for r in got.values():
        assert r["correct"] is True and r["repeat_bitwise"] is True and r["ms"] is None, r
        assert r["errors"]["y"] < 2e-2 and r["errors"]["dw_down"] < 2e-2
    assert "| tiny  |     16 |  2 | tabby-sync-free |" in text
