"""Tabby on the GPU: values and gradients against the reference, determinism, no host sync,
CUDA-graph replay; EP1 in this process, EP2 across two GPUs (spawned). Skips without a GPU.

Shapes: the benchmark shapes (docs/design.md) with their true H, I and k and a small expert count per rank
(the full expert counts run in ``tabby bench``, which checks every implementation first).
"""
import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import GPU_CASES, rel_err  # noqa: E402


def sync_free_moe(*args, **kw):
    """tabby.moe on the sync-free path (the default is the megakernel, tested in test_megakernel_gpu.py)."""
    import tabby
    from tabby.functional.config import MoEConfig

    return tabby.moe(*args, config=MoEConfig(megakernel=False, debug=kw.pop("debug", None)), **kw)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

TOL = 2e-2


def _inputs(case, rank, W, device):
    T, H, I, E_local, k, shared, route = GPU_CASES[case]
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    E = E_local * W
    x = torch.randn(T, H, generator=g, device=device).bfloat16()
    if route == "random":
        vals, idx = torch.randn(T, E, generator=g, device=device).topk(k, dim=1)
    elif route == "one_expert":
        idx = torch.zeros(T, k, dtype=torch.int64, device=device)
        vals = torch.randn(T, k, generator=g, device=device)
    else:  # every token to the experts of the last rank; most experts of it get nothing with k small
        vals, idx = torch.randn(T, 2, generator=g, device=device).topk(k, dim=1)
        idx = idx + (W - 1) * E_local
    wts = torch.softmax(vals, dim=1)
    gw = torch.Generator(device=device).manual_seed(7)  # expert weights differ per rank by slicing
    s = lambda *sz: (torch.randn(*sz, generator=gw, device=device) / sz[-1] ** 0.5).bfloat16()
    ws = [s(E, I, H)[rank * E_local:(rank + 1) * E_local].contiguous(),
          s(E, I, H)[rank * E_local:(rank + 1) * E_local].contiguous(),
          s(E, H, I)[rank * E_local:(rank + 1) * E_local].contiguous()]
    sh = [s(256, H), s(256, H), s(H, 256)] if shared else None
    dy = torch.randn(T, H, generator=g, device=device).bfloat16()
    return x, idx, wts, ws, sh, dy


def _fwd_bwd(fn, x, idx, wts, ws, sh, dy, group):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wts, *ws, *(sh or ()))]
    y = fn(leaves[0], idx, leaves[1], *leaves[2:5], shared=leaves[5:] or None, group=group)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


NAMES = ["y", "dx", "dtopk", "dw_gate", "dw_up", "dw_down", "dsh_gate", "dsh_up", "dsh_down"]


def check_rank(rank, W, cases, reps=20):
    """Run every check on this rank; returns {case: {check: value}}."""
    import tabby

    device = torch.device("cuda", torch.cuda.current_device())
    group = None
    if W > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    out = {}
    for case in cases:
        inp = _inputs(case, rank, W, device)
        got = _fwd_bwd(sync_free_moe, *inp, group)
        want = _fwd_bwd(tabby.moe_reference, *inp, group)
        res = {f"err_{n}": rel_err(a, b) for n, a, b in zip(NAMES, got, want)}
        tabby.check_errors()
        out[case] = res
    # Determinism, no host sync and graph replay on the last case.
    case = cases[-1]
    inp = _inputs(case, rank, W, device)
    first = _fwd_bwd(sync_free_moe, *inp, group)
    same = True
    for _ in range(reps - 1):
        again = _fwd_bwd(sync_free_moe, *inp, group)
        same &= all(torch.equal(a, b) for a, b in zip(first, again))
    out["determinism"] = {"bitwise_equal": same, "reps": reps}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # (debug mode, TABBY_DEBUG=1, reads the error record after each pass: a host sync by design)
        _fwd_bwd(functools.partial(sync_free_moe, debug=False), *inp, group)
        no_sync = True
    except RuntimeError as e:
        no_sync = f"host sync: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out["no_host_sync"] = {"ok": no_sync}
    out["graph"] = _graph_check(inp, group, device)
    tabby.check_errors()
    return out


def _graph_check(inp, group, device, fn=sync_free_moe):
    x, idx, wts, ws, sh, dy = inp
    static = [t.clone() for t in (x, idx, wts, dy)]
    params = [w.detach().clone().requires_grad_(True) for w in ws]
    xs = static[0].requires_grad_(True)
    wl = static[2].requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as graph capture wants
        for _ in range(2):
            y = fn(xs, static[1], wl, *params, group=group)
            y.backward(static[3])
    torch.cuda.current_stream().wait_stream(s)
    for t in (xs, wl, *params):
        t.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn(xs, static[1], wl, *params, group=group)
        y.backward(static[3])
    # New inputs: copy into the static tensors and replay.
    gen = torch.Generator(device=device).manual_seed(99)
    with torch.no_grad():
        xs.copy_(torch.randn(x.shape, generator=gen, device=device).bfloat16())
        static[3].copy_(torch.randn(dy.shape, generator=gen, device=device).bfloat16())
    g.replay()
    eager = _fwd_bwd(fn, xs.detach(), static[1], wl.detach(), params, None, static[3], group)
    graph = [y.detach(), xs.grad, wl.grad] + [p.grad for p in params]
    return {"matches_eager": all(torch.equal(a, b) for a, b in zip(graph, [eager[0], eager[1], eager[2],
                                                                          *eager[3:6]]))}


def _assert_ok(res):
    for case, r in res.items():
        if case.startswith("err") or case in ("determinism", "no_host_sync", "graph"):
            continue
        bad = {k: v for k, v in r.items() if not v < TOL}
        assert not bad, f"{case}: errors over {TOL}: {bad}"
    assert res["determinism"]["bitwise_equal"], "outputs or gradients differ between repeated runs"
    assert res["no_host_sync"]["ok"] is True, res["no_host_sync"]["ok"]
    assert res["graph"]["matches_eager"], "CUDA graph replay with new inputs differs from eager"


def _check_worker(rank, world, check, cases):
    return check(rank, world, cases)


def run_on_gpus(check, cases, ep):
    """``check(rank, ep, cases)`` on ``ep`` GPUs: in this process for EP1, else one spawned
    process per GPU (rank 0's result). Skips when the machine has fewer GPUs."""
    if ep == 1:
        return check(0, 1, cases)
    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs")
    from tabby_bench.launch import launch

    return launch(_check_worker, check, cases, nprocs=ep)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_tabby_gpu(ep):
    res = run_on_gpus(check_rank, list(GPU_CASES), ep)
    print(res)
    _assert_ok(res)


def _mismatch_worker(rank, world):
    import tabby

    device = torch.device("cuda", torch.cuda.current_device())
    import torch.distributed as dist

    x, idx, wts, ws, _, _ = _inputs("qwen3-30b-a3b", rank, world, device)
    if rank == 1:  # one token more on rank 1
        x, idx, wts = torch.cat([x, x[:1]]), torch.cat([idx, idx[:1]]), torch.cat([wts, wts[:1]])
    try:
        sync_free_moe(x, idx, wts, *ws, group=dist.group.WORLD)
        return "no error"
    except tabby.MoEInputError as e:
        return str(e)


def check_default_layer(rank, W, cases):
    """The default (megakernel) layer, whose schedule runs on a high-priority side stream beside the
    copy of x: right values, bitwise the same on a repeat, no host sync, replayed from a CUDA graph."""
    import tabby

    device = torch.device("cuda", torch.cuda.current_device())
    group = None
    if W > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    inp = _inputs(cases[0], rank, W, device)
    first, again = _fwd_bwd(tabby.moe, *inp, group), _fwd_bwd(tabby.moe, *inp, group)
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    err = rel_err(first[0], _fwd_bwd(tabby.moe_reference, *inp, group)[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # (without debug mode's host sync)
        _fwd_bwd(functools.partial(tabby.moe, config=tabby.MoEConfig(debug=False)), *inp, group)
        no_sync = True
    except RuntimeError as e:
        no_sync = f"host sync: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = _graph_check(inp, group, device, fn=tabby.moe)["matches_eager"]
    tabby.check_errors()
    return dict(bitwise_repeat=same, err_y=err, no_host_sync=no_sync, graph_matches_eager=graph)


@pytest.mark.parametrize("ep", [1, 2])
def test_default_layer_is_deterministic_sync_free_and_graph_capturable(ep):
    res = run_on_gpus(check_default_layer, ["qwen3-30b-a3b"], ep)
    print(res)
    assert res["bitwise_repeat"] is True, res
    assert res["err_y"] < TOL and res["no_host_sync"] is True and res["graph_matches_eager"], res


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tabby_gpu_ranks_disagreeing_on_shapes_raise():
    from tabby_bench.launch import launch

    msg = launch(_mismatch_worker, nprocs=2)
    assert "disagree" in msg and "rank 1: T=513" in msg, msg
