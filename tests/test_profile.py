"""`tabby profile`: every stage of both passes is timed (CPU: wall clock under the interpreter), and
the megakernel's ticket trace is read (tabby_bench.trace)."""
import json


from tabby_bench.cli import main


def test_profile_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "stages.json"
    assert main(["profile", "--shapes", "tiny", "--tokens", "8", "--iters", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    stages = rows[0]["stages_ms"]
    want = {"fwd:publish+wait", "fwd:schedule", "fwd:wait_x", "fwd:dispatch", "fwd:gate_up", "fwd:down+push",
            "fwd:signal+wait", "fwd:combine", "bwd:publish+wait", "bwd:dispatch_dy", "bwd:down_dgrad+swiglu",
            "bwd:gate_up_dgrad+push", "bwd:router_grad", "bwd:wgrad", "bwd:signal+wait", "bwd:combine"}
    assert set(stages) == want
    assert all(v > 0 for v in stages.values())
    assert rows[0]["stages_ms_per_rank"] == [stages]  # one rank: its own medians are the maximum
    gemms = rows[0]["gemms"]  # the GEMM stages, in the passes' order; floor and dense not measured on the CPU
    assert [g["stage"] for g in gemms] == ["fwd:gate_up", "fwd:down+push", "bwd:down_dgrad+swiglu",
                                           "bwd:gate_up_dgrad+push", "bwd:wgrad"]
    assert gemms[-1]["gemms"] == ["wgrad_down", "wgrad_gate_up"] and gemms[-1]["flop"] == 65536 + 131072
    assert all(g["tflops"] > 0 and g["ms"] == stages[g["stage"]] for g in gemms)
    assert all(g[f] is None for g in gemms for f in ("floor_ms", "floor_tflops", "x_floor", "dense_tflops",
                                                      "of_dense"))
    printed = capsys.readouterr().out
    assert "tiny T=8 EP1" in printed and "GEMM stages (R = T k = 16 routed rows a rank)" in printed
    assert "floor TFLOP/s" in printed and "bwd:wgrad" in printed.split("GEMM stages")[1]


def test_gemm_flops_and_rows_by_hand():
    """tiny at T=8 (R = 16 rows, H=64, I=32, a shared expert of 32): each GEMM's FLOPs, and a
    megakernel stage's row against a given floor and dense matmul."""
    from tabby_bench.profile import gemm_flops, gemm_rows

    flops = gemm_flops(16, 8, 64, 32, 32)
    assert flops == {"gate_up": 131072, "down": 65536, "down_dgrad": 65536, "gate_up_dgrad": 131072,
                     "wgrad_down": 65536, "wgrad_gate_up": 131072, "shared": 98304}
    assert "shared" not in gemm_flops(16, 8, 64, 32)
    dense = {"m": 8192, "tflops": 100.0, "fp8_tflops": 200.0}
    floor = {"gate_up": 0.5e-3, "down": 0.25e-3, "shared": 0.25e-3}
    (row,) = gemm_rows({"fwd:megakernel": 2e-3, "fwd:combine": 1e-3}, flops, floor, dense, "bf16")
    assert row["gemms"] == ["gate_up", "down", "shared"] and row["flop"] == 294912
    assert abs(row["tflops"] - 294912 / 2e-6 / 1e12) < 1e-12 and abs(row["floor_ms"] - 1e-3) < 1e-15
    assert abs(row["x_floor"] - 2.0) < 1e-12 and abs(row["floor_tflops"] - 2 * row["tflops"]) < 1e-12
    assert row["dense_tflops"] == 100.0 and abs(row["of_dense"] - row["tflops"] / 100.0) < 1e-15
    # FP8 stages against the FP8 dense matmul: every stage with "fp8", the forward's with "fp8-forward"
    fwd, bwd = gemm_rows({"fwd:gate_up": 1.0, "bwd:wgrad": 1.0}, flops, None, dense, "fp8-forward")
    assert (fwd["dense_tflops"], bwd["dense_tflops"], fwd["floor_ms"]) == (200.0, 100.0, None)


def test_floor_gemms_cover_the_flop_model():
    """The floor times every GEMM kind of the FLOP model; each call runs on the floor's rows (CPU)."""
    import torch

    from tabby_bench.anchors.floor import prepare_floor
    from tabby_bench.profile import floor_gemms, gemm_flops
    from tabby_bench.shapes import TINY, make_inputs

    inp = make_inputs(TINY, 8, 1, 0, "cpu")
    p = prepare_floor(inp.x, inp.topk_idx, inp.w_gate, inp.w_up, inp.w_down, inp.shared, None)
    calls = floor_gemms(p)
    assert set(calls) == set(gemm_flops(16, 8, TINY.H, TINY.I, TINY.I_shared))
    with torch.no_grad():
        for call in calls.values():
            call()


def test_profile_mega_tiny_cpu(tmp_path):
    # --mega: the default layer, whose forward is the megakernel between publish/schedule and combine;
    # --fwd-only: no backward stages (the backward is the one test_profile_tiny_cpu times)
    out = tmp_path / "stages.json"
    assert main(["profile", "--mega", "--fwd-only", "--shapes", "tiny", "--tokens", "8", "--iters", "1",
                 "--warmup", "0", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["megakernel"] is True and row["fwd_only"] is True
    assert set(row["stages_ms"]) == {"fwd:publish+wait", "fwd:schedule", "fwd:wait_x", "fwd:megakernel",
                                     "fwd:signal+wait", "fwd:combine"}
    assert all(v > 0 for v in row["stages_ms"].values())
    # one GEMM stage: the megakernel's routed gate/up and down and the shared expert (6 T H I_shared)
    (gemm,) = row["gemms"]
    assert gemm["stage"] == "fwd:megakernel" and gemm["flop"] == 131072 + 65536 + 98304


def _synthetic_trace():
    """Two programs: program 0 at 2 GHz with a gate/up (wait 200 cycles, work 800) and a down;
    program 1 at 1 GHz, starting 500 ns later, with one fill."""
    import torch

    from tabby_bench.trace import HEAD as H0

    tr = torch.zeros(2, H0 + 4 * 3, dtype=torch.int64)
    tr[0, :5] = torch.tensor([2, 1000, 2000, 0, 2000])
    tr[0, H0:H0 + 8] = torch.tensor([1, 100, 300, 1100, 2, 1300, 1300, 1700])
    tr[1, :5] = torch.tensor([1, 1500, 2500, 5000, 6000])
    tr[1, H0:H0 + 4] = torch.tensor([0, 5000, 5100, 5500])
    return tr


def test_trace_events_convert_cycles_per_program():
    from tabby_bench.trace import trace_events

    (span0, ev0), (span1, ev1) = trace_events(_synthetic_trace())
    assert span0[:3] == (0.0, 1.0, 2.0) and span1[:3] == (0.5, 1.5, 1.0)
    assert [e[0] for e in ev0] == ["gate/up", "down"] and ev1[0][0] == "fill"
    assert all(abs(a - b) < 1e-9 for a, b in zip(ev0[0][1:], (0.05, 0.15, 0.55)))
    assert all(abs(a - b) < 1e-9 for a, b in zip(ev1[0][1:], (0.5, 0.6, 1.0)))  # its own clock, its own start


def test_summarize_trace_reads_times_per_kind():
    from tabby_bench.trace import format_trace, summarize_trace

    s = summarize_trace(_synthetic_trace())
    assert s["tickets"] == 3 and s["overflow"] == 0 and abs(s["span_us"] - 1.5) < 1e-9
    gu, dn, fill = s["kinds"]["gate/up"], s["kinds"]["down"], s["kinds"]["fill"]
    assert (gu["n"], dn["n"], fill["n"]) == (1, 1, 1)
    assert abs(gu["wait_us"] - 0.1) < 1e-9 and abs(gu["work_us"] - 0.4) < 1e-9
    assert abs(dn["wait_us"]) < 1e-9 and abs(dn["work_us"] - 0.2) < 1e-9
    assert abs(fill["wait_us"] - 0.1) < 1e-9 and abs(fill["work_us"] - 0.4) < 1e-9
    assert abs(s["between_us"] - 0.1) < 1e-9  # program 0: down taken 200 cycles after the gate/up ended
    assert (s["start_ns"], s["end_ns"]) == (1000, 2500)  # raw globaltimer: first start, last end
    assert abs(gu["share"] - 0.5 / 2.0) < 1e-9  # 0.5 us of 2 program-us
    assert "gate/up" in format_trace(s)


def test_plot_trace_draws_a_timeline(tmp_path):
    from tabby_bench.trace import plot_trace

    out = tmp_path / "trace.png"
    plot_trace(_synthetic_trace(), str(out), "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_profile_fp8_tiny_cpu(tmp_path):
    """--precision fp8: the FP8 layer's stages, its quantizations and weight gradients apart."""
    out = tmp_path / "stages.json"
    assert main(["profile", "--precision", "fp8", "--shapes", "tiny", "--tokens", "8", "--iters", "1",
                 "--warmup", "0", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["precision"] == "fp8"
    want = {"fwd:publish+wait", "fwd:schedule", "fwd:wait_x", "fwd:dispatch", "fwd:gate_up", "fwd:down+push",
            "fwd:signal+wait", "fwd:combine", "bwd:publish+wait", "bwd:dispatch_dy",
            "bwd:down_dgrad+swiglu", "bwd:quantize_dgu", "bwd:gate_up_dgrad+push", "bwd:router_grad",
            "bwd:quantize_cols_down", "bwd:wgrad_down", "bwd:quantize_cols_gate_up", "bwd:wgrad_gate_up",
            "bwd:signal+wait", "bwd:combine"}
    assert set(row["stages_ms"]) == want
    assert all(v > 0 for v in row["stages_ms"].values())
    assert [g["stage"] for g in row["gemms"]] == ["fwd:gate_up", "fwd:down+push", "bwd:down_dgrad+swiglu",
                                                  "bwd:gate_up_dgrad+push", "bwd:wgrad_down", "bwd:wgrad_gate_up"]
