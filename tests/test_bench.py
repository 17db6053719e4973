"""The benchmark's pieces on the CPU: the correctness check, records and table, the Tabby rows'
registration and the command line's checks (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from tabby_bench import bench, cli, impls, records
from tabby_bench.anchors.torch_a2a import moe_torch_a2a
from tabby_bench.check import TOLERANCE
from tabby_bench.shapes import SHAPES, TINY, flops, make_inputs, rank_share, shape_named


# ----------------------------------------------------------------------------------------------
# The reference check must be able to fail
# ----------------------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.1


def _wrong_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    return moe_torch_a2a(x, topk_idx, topk_weights, w_gate, w_up, w_down * 1.05, shared, group)


def _wrong_backward(*args, group=None):
    return _ScaleGrad.apply(moe_torch_a2a(*args, group=group))


@pytest.mark.parametrize("fn,bad", [(moe_torch_a2a, set()), (_wrong_forward, {"y"}), (_wrong_backward, {"dx"})])
def test_layer_check_flags_wrong_values_and_gradients(fn, bad):
    inp = make_inputs(TINY, 64, 1, 0, torch.device("cpu"))
    errs = impls.LayerImpl("x", fn).prepare(inp, None).check(with_grads=True)
    tol = TOLERANCE["bf16"]
    assert {"y", "dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down"} <= set(errs)
    assert {n for n, v in errs.items() if v > tol} >= bad
    if not bad:
        assert all(v < tol for v in errs.values()), errs
    else:
        assert all(errs[n] > 0.03 for n in bad), errs


def test_a_device_error_record_fails_the_check():
    """A layer that recorded an error on the device (a bounded wait that gave up returns early, with
    a wrong output) is reported as an error, not only as a wrong value."""
    def timed_out():
        raise RuntimeError("rank 0: a bounded wait timed out (waited for a peer to publish its inputs)")

    inp = make_inputs(TINY, 32, 1, 0, torch.device("cpu"))
    cfg = bench.Config(shapes=[TINY], tokens=[32], eps=[1], impls=["x"], passes=["fwd", "fwd+bwd"])
    ok = bench.measure(impls.LayerImpl("x", moe_torch_a2a), inp, None, cfg, timed=False)
    assert all(r["correct"] and r["error"] is None for r in ok)
    bad = bench.measure(impls.LayerImpl("x", moe_torch_a2a, device_errors=timed_out), inp, None, cfg, timed=False)
    assert all(not r["correct"] and "bounded wait timed out" in r["error"] for r in bad)


def test_floor_check():
    inp = make_inputs(TINY, 64, 1, 0, torch.device("cpu"))
    errs = impls.FloorImpl().prepare(inp, None).check(with_grads=True)
    assert {"y", "dx", "dw_gate", "dw_up", "dw_down"} <= set(errs)
    assert all(v < 2e-2 for v in errs.values()), errs


# ----------------------------------------------------------------------------------------------
# FLOPs, ratios, table
# ----------------------------------------------------------------------------------------------

def test_flops_follow_the_design():
    q = SHAPES["qwen3-30b-a3b"]
    assert flops(q, 16384, "fwd") == 6 * 16384 * 8 * 2048 * 768
    assert flops(q, 16384, "fwd+bwd") == 3 * 6 * 16384 * 8 * 2048 * 768
    assert flops(TINY, 10, "fwd") == 6 * 10 * 2 * 64 * 32 + 6 * 10 * 64 * 32  # shared expert counted


def _rec(impl, ms, correct=True, pass_="fwd", shape="qwen3-30b-a3b"):
    r = records.base_record(impl, SHAPES[shape], 16384, 2, pass_, "bf16")
    r.update(ms=ms, correct=correct, tflops=r["flops"] / (ms * 1e-3) / 1e12 if ms else None)
    return r


def test_finalize_ratios_and_speedups():
    recs = [_rec("floor", 2.0), _rec("torch-a2a", 10.0), _rec("torch-symm", 8.0),
            _rec("tabby", 2.5), _rec("torch-a2a", 1.0, correct=False, shape="glm-5"),
            _rec("torch-symm", 4.0, shape="glm-5"), _rec("tabby", None, correct=False, shape="glm-5")]
    records.finalize(recs)
    by = {(r["impl"], r["shape"]): r for r in recs}
    assert by["tabby", "qwen3-30b-a3b"]["ratio_to_floor"] == pytest.approx(1.25)
    assert by["tabby", "qwen3-30b-a3b"]["speedup_vs_best_anchor"] == pytest.approx(8.0 / 2.5)
    assert by["torch-a2a", "qwen3-30b-a3b"]["speedup_vs_best_anchor"] == pytest.approx(0.8)
    # A wrong anchor is never the one to beat; no floor measured for glm-5.
    assert by["torch-symm", "glm-5"]["speedup_vs_best_anchor"] == pytest.approx(1.0)
    assert by["torch-symm", "glm-5"]["ratio_to_floor"] is None
    assert by["tabby", "glm-5"]["speedup_vs_best_anchor"] is None


def test_fp8_rows_are_checked_and_compared_as_fp8():
    """An FP8 row gets the FP8 tolerance and is compared with the FP8 anchor, not the bf16 ones."""
    shape = SHAPES["qwen3-30b-a3b"]
    fp8 = records.base_record(impls.IMPLS["tabby-fp8"], shape, 4096, 1, "fwd", "bf16")
    bf16 = records.base_record(impls.IMPLS["tabby"], shape, 4096, 1, "fwd", "bf16")
    assert (fp8["precision"], fp8["tolerance"]) == ("fp8", TOLERANCE["fp8"])
    assert (bf16["precision"], bf16["tolerance"]) == ("bf16", TOLERANCE["bf16"]) and TOLERANCE["bf16"] < TOLERANCE["fp8"]
    recs = [_rec("floor", 2.0), _rec("torch-a2a", 4.0), dict(_rec("torch-fp8", 3.0), precision="fp8"),
            dict(_rec("tabby-fp8", 1.5), precision="fp8"), _rec("tabby", 2.0)]
    records.finalize(recs)
    by = {r["impl"]: r for r in recs}
    assert by["tabby-fp8"]["speedup_vs_best_anchor"] == pytest.approx(3.0 / 1.5)
    assert by["tabby"]["speedup_vs_best_anchor"] == pytest.approx(4.0 / 2.0)
    assert by["tabby-fp8"]["ratio_to_floor"] == pytest.approx(0.75)


def test_bracket_floor_averages_first_and_last():
    def rec(ms, peak, p="fwd"):
        r = records.base_record("floor", SHAPES["qwen3-30b-a3b"], 16384, 2, p, "bf16")
        r.update(ms=ms, ms_min=None if ms is None else ms - 0.1, peak_mem_gb=peak, tflops=1.0,
                 ms_iters=None if ms is None else [ms - 0.1, ms, ms + 0.1])
        return r

    first = [rec(2.0, 3.0), rec(6.0, 5.0, "fwd+bwd")]
    last = [rec(2.4, 4.0), rec(None, None, "fwd+bwd")]
    out = records.bracket_floor(first, last)
    assert out[0]["ms"] == pytest.approx(2.2) and out[0]["ms_first"] == 2.0 and out[0]["ms_last"] == 2.4
    assert out[0]["ms_min"] == pytest.approx(1.9) and out[0]["peak_mem_gb"] == 4.0
    assert out[0]["ms_iters"] == [1.9, 2.0, 2.1] and out[0]["ms_iters_last"] == [2.3, 2.4, 2.5]
    assert out[0]["tflops"] == pytest.approx(out[0]["flops"] / 2.2e-3 / 1e12)
    # a failed second timing leaves the first one as it was, and says so
    assert out[1]["ms"] == 6.0 and out[1]["ms_last"] is None


def test_host_time_is_the_host_time_per_call():
    # timing.host_timed (the bench's and tune's "host ms"): the timed calls' own wall time per call
    # (here a 2 ms sleep), results passed through
    import time

    from tabby_bench.timing import host_timed

    calls = []
    run = host_timed(lambda: time.sleep(2e-3) or 7, calls)
    assert [run() for _ in range(5)] == [7] * 5
    ms = sum(calls) * 1e3 / len(calls)
    assert len(calls) == 5 and 1.9 <= ms < 20


def test_format_table():
    recs = [dict(_rec("floor", 2.0), host_ms=0.25), _rec("torch-a2a", 10.0, correct=False)]
    recs.append(dict(_rec("tabby", None), correct=False, error="RuntimeError: no"))
    records.finalize(recs)
    lines = records.format_table(recs).splitlines()
    assert len(lines) == 2 + len(recs)
    assert len({len(line) for line in lines}) == 1  # aligned
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["shape", "T/GPU", "EP", "pass", "impl", "ms", "host ms", "TFLOP/s", "x floor", "vs anchor",
                    "correct"]
    floor, a2a, tabby = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    assert floor[5:] == ["2.000", "0.250", f"{recs[0]['tflops']:.1f}", "1.00", "-", "yes"]
    assert a2a[5] == "10.000" and a2a[6] == "-" and a2a[8] == "5.00" and a2a[10] == "NO"
    assert tabby[5] == "-" and tabby[10] == "error"


def test_machine_header_and_file_name():
    info = records.machine_info()
    for key in ("machine", "gpu_count", "torch", "triton", "git_commit", "date", "argv"):
        assert key in info
    assert records.file_stem(dict(info, gpu_count=2, gpu_name="NVIDIA H200"), "ep2").startswith("bench-2xh200-ep2-")


def test_results_go_outside_the_tree_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert records.default_out_dir() == str(tmp_path / "tabby" / "bench")


def test_history_appends_a_result_file(tmp_path):
    import json

    res = dict(schema="tabby-bench/1", gpu_name="NVIDIA H200", gpu_count=1, git_commit="abcdef0123",
               date="2026-12-01T10:00:00+00:00", records=[dict(_rec("tabby", 2.0), ratio_to_floor=1.1)])
    path = tmp_path / "bench-1xh200-x.json"
    path.write_text(json.dumps(res))
    hist = tmp_path / "history.jsonl"
    assert records.append_history(str(path), str(hist)) == 1
    line = json.loads(hist.read_text())
    assert line["impl"] == "tabby" and line["commit"] == "abcdef0" and line["x_floor"] == 1.1
    assert records.append_history(str(path), str(hist)) == 0  # a source already there is skipped


# ----------------------------------------------------------------------------------------------
# The Tabby rows and the command line
# ----------------------------------------------------------------------------------------------

def test_tabby_rows_take_a_tuning(monkeypatch):
    from tabby.functional.config import Tuning

    monkeypatch.setattr(impls, "IMPLS", dict(impls.IMPLS))  # restored afterwards
    impls.register_tabby(Tuning.parse("group_m=2,tma=0"))
    mega, free = impls.IMPLS["tabby"], impls.IMPLS["tabby-sync-free"]
    assert mega.fn.keywords["config"].megakernel and not free.fn.keywords["config"].megakernel
    assert mega.fn.keywords["config"].tuning == Tuning(group_m=2, tma=False) and mega.tuning == "group_m=2,tma=0"
    impls.register_tabby()
    assert impls.IMPLS["tabby"].fn.keywords["config"].tuning == Tuning() and impls.IMPLS["tabby"].tuning == ""


def test_tabby_sync_free_row_checks_on_cpu():
    inp = make_inputs(TINY, 16, 1, 0, torch.device("cpu"))
    errs = impls.IMPLS["tabby-sync-free"].prepare(inp, None).check(with_grads=False)
    assert errs["y"] < 2e-2


@pytest.mark.parametrize("argv,message", [
    (["bench", "--tuning", "group_m=x"], "group_m"),
    (["bench", "--tuning", "no_such_field=1"], "no_such_field"),
    (["bench", "--shapes", "nope"], "unknown shape"),
    (["bench", "--shapes", "tiny@ep3"], "do not split over 3 ranks"),
    (["bench", "--shapes", "tiny@epx"], "NAME@epN"),
    (["bench", "--impls", "nope"], "unknown implementation"),
    (["bench", "--passes", "bwd"], "--passes"),
])
def test_cli_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


def test_cli_builds_the_cpu_config():
    args = cli.build_parser().parse_args(["bench", "--tuning", "group_m=2"])
    cfg = cli.bench_config(args, cli.build_parser(), gpus=0)
    assert [s.name for s in cfg.shapes] == ["tiny", "tiny-top4"] and cfg.eps is None and cfg.tokens == [32]
    assert cfg.tuning == "group_m=2" and cfg.out is None
    args = cli.build_parser().parse_args(["bench", "--ep", "2", "--shapes", "qwen3-30b-a3b", "--tokens", "4096"])
    cfg = cli.bench_config(args, cli.build_parser(), gpus=2)
    assert cfg.eps == [2] and cfg.shapes == [SHAPES["qwen3-30b-a3b"]] and "tabby" in cfg.impls


def test_a_rank_share_is_a_shape_of_its_experts():
    """NAME@epN: the experts one rank holds at EP N as a shape of their own, the rest unchanged."""
    half = shape_named("deepseek-v4-pro@ep2")
    full = SHAPES["deepseek-v4-pro"]
    assert half == rank_share(full, 2) and half.name == "deepseek-v4-pro@ep2"
    assert (half.E, half.H, half.I, half.k, half.I_shared) == (full.E // 2, full.H, full.I, full.k, full.I_shared)
    assert shape_named("deepseek-v4-pro") is full
    # its FLOPs at T tokens are a rank's at EP N (the layer's work scales with tokens, not experts)
    assert flops(half, 4096, "fwd+bwd") == flops(full, 4096, "fwd+bwd")
    args = cli.build_parser().parse_args(["bench", "--shapes", "kimi-k2@ep4,glm-5", "--tokens", "4096"])
    cfg = cli.bench_config(args, cli.build_parser(), gpus=1)
    assert [(s.name, s.E) for s in cfg.shapes] == [("kimi-k2@ep4", 96), ("glm-5", 256)]
    with pytest.raises(KeyError):
        shape_named("nope@ep2")


def test_tabby_fp8_one_copy_row_never_holds_the_transposes(monkeypatch):
    seen = []
    monkeypatch.setattr(impls.tabby, "moe", lambda *a, config, **kw: seen.append((config.precision,
                                                                                   config.cache_fp8_transposes)))
    w = torch.empty(2, 8, 16)
    impls.IMPLS["tabby-fp8-one-copy"].fn(torch.empty(4, 16), None, None, w, w, w.transpose(1, 2))
    assert seen == [("fp8", False)]
    assert impls.IMPLS["tabby-fp8-one-copy"].precision == "fp8"


def test_script_table_writes_json_and_markdown(tmp_path):
    """records.write_script_table: the measuring scripts' (activation_cost.py, quant_bandwidth.py) one writer."""
    import json

    from tabby_bench.records import write_script_table

    rows = [dict(shape="a@ep8", ms=1.5), dict(shape="b", ms=2.25)]
    head = write_script_table(str(tmp_path), "t", "a title", rows, [("shape", lambda r: r["shape"]),
                                                                   ("ms", lambda r: f"{r['ms']:.2f}")], {"x": 1})
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["rows"] == rows and data["argv"] == {"x": 1} and data["commit"] == head["commit"]
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0].startswith("# a title: ") and md[2] == "| shape | ms |" and md[4:] == ["| a@ep8 | 1.50 |",
                                                                                         "| b | 2.25 |"]
