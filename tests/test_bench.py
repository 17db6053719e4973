"""CPU tests of the benchmark, the launcher and the anchors (gloo; no GPU needed)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tabby import bench
from tabby.anchors.torch_a2a import moe_torch_a2a
from tabby.anchors.torch_symm import move_rows, num_chunks, receiver_plan, sender_splits
from tabby.launch import LaunchError, launch
from tabby.reference import moe_reference
from tabby.shapes import SHAPES, TINY, Shape, make_routing, make_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

def _sum_ranks(rank, world, offset):
    t = torch.tensor([rank + offset], dtype=torch.int64)
    dist.all_reduce(t)
    return rank, world, int(t)


def _raise_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # rank 0 waits in a collective: the launcher must still terminate it


def test_launch_runs_every_rank_and_returns_rank0_result():
    assert launch(_sum_ranks, 10, nprocs=3, cpu=True) == (0, 3, 10 + 11 + 12)


def test_launch_propagates_a_child_exception():
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank1, nprocs=2, cpu=True)
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError" in msg and "boom from the second rank" in msg


def test_launch_keeps_multicast_off():
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        assert os.environ.get(k) == v


# ----------------------------------------------------------------------------------------------
# torch-a2a on CPU over gloo vs the reference
# ----------------------------------------------------------------------------------------------

def _inputs(shape, T, E_local, rank, dtype, skew=False):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, shape.H, generator=g).to(dtype)
    idx, tw = make_routing(T, shape.E, shape.k, generator=g)
    if skew:  # every token of every rank to rank 0's first k experts: uneven splits, empty experts
        idx = torch.arange(shape.k).repeat(T, 1)
    (wg, wu, wd), sh = make_weights(shape, E_local, dtype=dtype, generator=g)
    dy = torch.randn(T, shape.H, generator=g).to(dtype)
    leaves = [x, tw, wg, wu, wd, *sh]
    for t in leaves:
        t.requires_grad_(True)
    return (x, idx, tw, wg, wu, wd, sh), leaves, dy


def _a2a_vs_reference(rank, world, dtype, skew):
    shape = Shape("t", 8, 64, 32, 2, I_shared=32)
    args, leaves, dy = _inputs(shape, 48, shape.E // world, rank, dtype, skew)
    group = dist.group.WORLD
    y = moe_torch_a2a(*args, group=group)
    g = torch.autograd.grad(y, leaves, dy, allow_unused=True, materialize_grads=True)
    y_ref = moe_reference(*args, group=group, compute_dtype=torch.float64)
    # Skewed routing leaves rank 1's experts without rows: the reference never touches them.
    g_ref = torch.autograd.grad(y_ref, leaves, dy, allow_unused=True, materialize_grads=True)
    names = ["y", "dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down", "dsg", "dsu", "dsd"]
    errs = [rel(y, y_ref)] + [rel(a, b) if b.norm() > 0 else a.norm().item() for a, b in zip(g, g_ref)]
    return dict(zip(names, errs))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("skew", [False, True])
def test_torch_a2a_ep2_matches_reference(dtype, tol, skew):
    errs = launch(_a2a_vs_reference, dtype, skew, nprocs=2, cpu=True)
    assert all(v < tol for v in errs.values()), errs


def test_torch_a2a_single_process_matches_reference():
    args, leaves, dy = _inputs(TINY, 40, TINY.E, 0, torch.float32)
    y = moe_torch_a2a(*args)
    y_ref = moe_reference(*args, compute_dtype=torch.float64)
    assert rel(y, y_ref) < 1e-5
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        assert rel(a, b) < 1e-5


# ----------------------------------------------------------------------------------------------
# torch-symm's index plans, with the NVSHMEM exchange emulated
# ----------------------------------------------------------------------------------------------

def _emulate_dispatch(inputs, in_splits, W, G):
    """all_to_all_vdev_2d with major_align=1, as nvshmem_extension.cu does it (empty chunk: 1 pad row)."""
    outs, sos = [], []
    src_off = [torch.cat([torch.zeros(1, dtype=torch.int64), s.cumsum(0)[:-1]]) for s in in_splits]
    for d in range(W):
        rows, splits, offsets, pos = [], [], [], 0
        for g in range(G):
            start = pos
            for s in range(W):
                c = d * G + g
                n = int(in_splits[s][c])
                splits.append(n)
                offsets.append(pos)
                rows.append(inputs[s][int(src_off[s][c]):int(src_off[s][c]) + n])
                pos += n
            if pos == start:  # the op gives an empty chunk one (garbage) row
                rows.append(torch.full((1, inputs[0].shape[1]), float("nan")))
                pos += 1
        outs.append(torch.cat(rows))
        sos.append(torch.tensor([splits, offsets]))
    return outs, sos


def _emulate_combine(bufs, sos, W, G):
    """all_to_all_vdev_2d_offset: chunk (g, s) of every rank d goes back to s, packed in (d, g) order."""
    outs = []
    for s in range(W):
        parts = []
        for d in range(W):
            for g in range(G):
                n, off = int(sos[d][0][g * W + s]), int(sos[d][1][g * W + s])
                parts.append(bufs[d][off:off + n])
        outs.append(torch.cat(parts))
    return outs


@pytest.mark.parametrize("E_local", [6, 32, 40])
@pytest.mark.parametrize("skew", [False, True])
def test_symm_plan_regroups_like_the_reference_order(E_local, skew):
    W, T, k, H = 2, 37, 3, 8
    G = num_chunks(E_local)
    assert E_local % G == 0 and G <= 16
    gen = torch.Generator().manual_seed(E_local)
    xs, idxs, sorted_rows, counts, in_splits = [], [], [], [], []
    for r in range(W):
        x = torch.randn(T, H, generator=gen)
        idx, _ = make_routing(T, E_local * W, k, generator=gen)
        if skew:
            idx = torch.arange(k).repeat(T, 1)  # rank 0's first experts only: empty experts and chunks
        perm = torch.argsort(idx.reshape(-1), stable=True)
        c, s = sender_splits(idx.reshape(-1)[perm], W, E_local, G)
        xs.append(x), idxs.append(idx), sorted_rows.append(x[perm // k]), counts.append(c), in_splits.append(s)
    landed, sos = _emulate_dispatch(sorted_rows, in_splits, W, G)
    R = W * T * k + G
    grouped, plans = [], []
    for d in range(W):
        counts_recv = torch.stack([counts[s].view(W, E_local)[d] for s in range(W)])
        buf = torch.cat([landed[d], torch.zeros(R - landed[d].shape[0], H)])
        grp_to_recv, n, offs = receiver_plan(counts_recv, sos[d][1], G, R)
        xg = torch.full((R, H), float("nan"))
        move_rows(buf, xg, grp_to_recv, n, scatter=False)
        # Expected: for each local expert, each source rank's rows for it, in that rank's sorted order.
        want = []
        for e in range(E_local):
            for s in range(W):
                sel = idxs[s].reshape(-1) == d * E_local + e
                want.append(xs[s][torch.nonzero(sel).flatten() // k])
        want = torch.cat(want)
        assert int(n) == want.shape[0]
        assert torch.equal(xg[:int(n)], want)
        assert offs.tolist() == counts_recv.sum(0).cumsum(0).tolist()
        grouped.append(xg)
        plans.append((grp_to_recv, n))
    # Combine: expert outputs (here 2 * rows) scattered back and exchanged return to their origin.
    back = []
    for d in range(W):
        buf = torch.full((R, H), float("nan"))
        move_rows(2 * grouped[d], buf, *plans[d], scatter=True)
        back.append(buf)
    returned = _emulate_combine(back, sos, W, G)
    for s in range(W):
        assert torch.equal(returned[s], 2 * sorted_rows[s])


def test_num_chunks():
    assert [num_chunks(e) for e in (1, 6, 16, 32, 40, 64, 96, 192, 17)] == [1, 6, 16, 16, 10, 16, 16, 16, 1]


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
    inp = bench.make_inputs(TINY, 64, 1, 0, torch.device("cpu"))
    errs = bench.LayerImpl("x", fn).prepare(inp, None).check(with_grads=True)
    tol = bench.TOLERANCE["bf16"]
    assert {"y", "dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down"} <= set(errs)
    assert {n for n, v in errs.items() if v > tol} >= bad
    if not bad:
        assert all(v < tol for v in errs.values()), errs
    else:
        assert all(errs[n] > 0.03 for n in bad), errs


def test_a_device_error_record_fails_the_check():
    """A layer that recorded an error on the device (a bounded wait that gave up returns early, with
    a wrong output) is reported as an error, not only as a wrong value: session 14's token pull
    gave up on its copy in the bench and the table showed only "NO"."""
    def timed_out():
        raise RuntimeError("rank 0: a bounded wait timed out (waited for a peer to publish its inputs)")

    inp = bench.make_inputs(TINY, 32, 1, 0, torch.device("cpu"))
    cfg = bench.Config(shapes=[TINY], tokens=[32], eps=[1], impls=["x"], passes=["fwd", "fwd+bwd"])
    ok = bench.measure(bench.LayerImpl("x", moe_torch_a2a), inp, None, cfg, timed=False)
    assert all(r["correct"] and r["error"] is None for r in ok)
    bad = bench.measure(bench.LayerImpl("x", moe_torch_a2a, device_errors=timed_out), inp, None, cfg, timed=False)
    assert all(not r["correct"] and "bounded wait timed out" in r["error"] for r in bad)


def test_floor_check():
    inp = bench.make_inputs(TINY, 64, 1, 0, torch.device("cpu"))
    errs = bench.FloorImpl().prepare(inp, None).check(with_grads=True)
    assert {"y", "dx", "dw_gate", "dw_up", "dw_down"} <= set(errs)
    assert all(v < 2e-2 for v in errs.values()), errs


# ----------------------------------------------------------------------------------------------
# FLOPs, ratios, table
# ----------------------------------------------------------------------------------------------

def test_flops_follow_design_measuring():
    q = SHAPES["qwen3-30b-a3b"]
    assert bench.flops(q, 16384, "fwd") == 6 * 16384 * 8 * 2048 * 768
    assert bench.flops(q, 16384, "fwd+bwd") == 3 * 6 * 16384 * 8 * 2048 * 768
    assert bench.flops(TINY, 10, "fwd") == 6 * 10 * 2 * 64 * 32 + 6 * 10 * 64 * 32  # shared expert counted


def _rec(impl, ms, correct=True, pass_="fwd", shape="qwen3-30b-a3b"):
    r = bench.base_record(impl, SHAPES[shape], 16384, 2, pass_, "bf16")
    r.update(ms=ms, correct=correct, tflops=r["flops"] / (ms * 1e-3) / 1e12 if ms else None)
    return r


def test_finalize_ratios_and_speedups():
    recs = [_rec("floor", 2.0), _rec("torch-a2a", 10.0), _rec("torch-symm", 8.0),
            _rec("tabby", 2.5), _rec("torch-a2a", 1.0, correct=False, shape="glm-5"),
            _rec("torch-symm", 4.0, shape="glm-5"), _rec("tabby", None, correct=False, shape="glm-5")]
    bench.finalize(recs)
    by = {(r["impl"], r["shape"]): r for r in recs}
    assert by["tabby", "qwen3-30b-a3b"]["ratio_to_floor"] == pytest.approx(1.25)
    assert by["tabby", "qwen3-30b-a3b"]["speedup_vs_best_anchor"] == pytest.approx(8.0 / 2.5)
    assert by["torch-a2a", "qwen3-30b-a3b"]["speedup_vs_best_anchor"] == pytest.approx(0.8)
    # A wrong anchor is never the one to beat; no floor measured for glm-5.
    assert by["torch-symm", "glm-5"]["speedup_vs_best_anchor"] == pytest.approx(1.0)
    assert by["torch-symm", "glm-5"]["ratio_to_floor"] is None
    assert by["tabby", "glm-5"]["speedup_vs_best_anchor"] is None


def test_host_time_is_the_host_time_per_call():
    # bench.host_timed (the bench's and tune's "host ms"): the timed calls' own wall time per call
    # (here a 2 ms sleep), results passed through
    import time

    calls = []
    run = bench.host_timed(lambda: time.sleep(2e-3) or 7, calls)
    assert [run() for _ in range(5)] == [7] * 5
    ms = sum(calls) * 1e3 / len(calls)
    assert len(calls) == 5 and 1.9 <= ms < 20


def test_format_table():
    recs = [dict(_rec("floor", 2.0), host_ms=0.25), _rec("torch-a2a", 10.0, correct=False)]
    recs.append(dict(_rec("tabby", None), correct=False, error="RuntimeError: no"))
    bench.finalize(recs)
    lines = bench.format_table(recs).splitlines()
    assert len(lines) == 2 + len(recs)
    assert len({len(line) for line in lines}) == 1  # aligned
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["shape", "T/GPU", "EP", "pass", "impl", "ms", "host ms", "TFLOP/s", "x floor", "vs anchor",
                    "correct"]
    floor, a2a, tabby = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    assert floor[5:] == ["2.000", "0.250", f"{recs[0]['tflops']:.1f}", "1.00", "-", "yes"]
    assert a2a[5] == "10.000" and a2a[6] == "-" and a2a[8] == "5.00" and a2a[10] == "NO"
    assert tabby[5] == "-" and tabby[10] == "error"


# ----------------------------------------------------------------------------------------------
# The whole CPU mode, through the command line
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode runs only without a GPU")
def test_cpu_bench_end_to_end(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "tabby", "bench", "--out", str(out), "--tag", "ci",
                           "--impls", "floor,torch-a2a,torch-symm"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Timings need a GPU" in proc.stdout
    files = glob.glob(str(out / "bench-cpu-ci-*.json"))
    assert len(files) == 1 and os.path.exists(files[0][:-5] + ".md")
    res = json.load(open(files[0]))
    for key in ("machine", "gpu_count", "torch", "triton", "git_commit", "date", "argv", "dense_matmul_tflops",
                "records"):
        assert key in res
    assert res["mode"] == "cpu" and res["gpu_count"] == 0
    recs = res["records"]
    for r in recs:
        for key in ("impl", "shape", "ep", "tokens_per_gpu", "dtype", "pass", "ms", "tflops", "correct", "errors",
                    "ratio_to_floor", "speedup_vs_best_anchor", "peak_mem_gb", "error"):
            assert key in r
        assert r["ms"] is None
    got = {(r["impl"], r["ep"], r["pass"]): r for r in recs}
    for key in [("reference", 2, "fwd"), ("reference", 2, "fwd+bwd")] + [
            (impl, ep, p) for impl in ("torch-a2a", "floor") for ep in (1, 2) for p in ("fwd", "fwd+bwd")]:
        assert got[key]["correct"] is True, got[key]
    assert got["torch-a2a", 2, "fwd+bwd"]["errors"]["dw_down"] < 2e-2
    assert got["torch-symm", 2, "fwd"]["error"].startswith("skipped")


def test_tabby_layer_is_registered_when_present(monkeypatch):
    import tabby

    def fake_moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None, config=None):
        return moe_torch_a2a(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)

    monkeypatch.setattr(tabby, "moe", fake_moe, raising=False)
    monkeypatch.setitem(bench.IMPLS, "tabby", None)  # restored afterwards
    bench.register_tabby()
    impl = bench.IMPLS["tabby"]
    assert impl.fn is fake_moe and impl.supports_cpu and not impl.anchor
    inp = bench.make_inputs(TINY, 32, 1, 0, torch.device("cpu"))
    errs = impl.prepare(inp, None).check(with_grads=False)
    assert errs["y"] < 2e-2


def test_bracket_floor_averages_first_and_last():
    from tabby import bench

    def rec(ms, peak, p="fwd"):
        from tabby.shapes import SHAPES

        r = bench.base_record("floor", SHAPES["qwen3-30b-a3b"], 16384, 2, p, "bf16")
        r.update(ms=ms, ms_min=None if ms is None else ms - 0.1, peak_mem_gb=peak, tflops=1.0)
        return r

    first = [rec(2.0, 3.0), rec(6.0, 5.0, "fwd+bwd")]
    last = [rec(2.4, 4.0), rec(None, None, "fwd+bwd")]
    out = bench.bracket_floor(first, last)
    assert out[0]["ms"] == pytest.approx(2.2) and out[0]["ms_first"] == 2.0 and out[0]["ms_last"] == 2.4
    assert out[0]["ms_min"] == pytest.approx(1.9) and out[0]["peak_mem_gb"] == 4.0
    assert out[0]["tflops"] == pytest.approx(out[0]["flops"] / 2.2e-3 / 1e12)
    # a failed second timing leaves the first one as it was, and says so
    assert out[1]["ms"] == 6.0 and out[1]["ms_last"] is None
