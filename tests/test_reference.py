"""The reference layer: against a float64 hand computation, EP over gloo, and input validation."""
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tabby import MoEInputError, moe_reference
from tabby_bench.shapes import TINY, make_routing, make_weights


def _inputs(T, E_local, W=1, H=24, I=40, k=3, dtype=torch.float64, shared=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T * W, H, generator=g).to(dtype)
    idx, wts = make_routing(T * W, E_local * W, k, generator=g)
    s = lambda *sz: (torch.randn(*sz, generator=g) / sz[-1] ** 0.5).to(dtype)
    ws = (s(E_local * W, I, H), s(E_local * W, I, H), s(E_local * W, H, I))
    sh = (s(16, H), s(16, H), s(H, 16)) if shared else None
    return x, idx, wts, ws, sh


def _hand(x, idx, wts, ws, sh):
    """Token by token, k by k, in float64."""
    wg, wu, wd = (w.double() for w in ws)
    rows = []
    for t in range(x.shape[0]):
        xt = x[t].double()
        yt = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.silu(wg[e] @ xt) * (wu[e] @ xt)
            yt = yt + wts[t, j].double() * (wd[e] @ h)
        if sh is not None:
            g, u, d = (w.double() for w in sh)
            yt = yt + d @ (F.silu(g @ xt) * (u @ xt))
        rows.append(yt)
    return torch.stack(rows)


@pytest.mark.parametrize("shared", [False, True])
def test_reference_matches_hand_computation(shared):
    x, idx, wts, ws, sh = _inputs(T=13, E_local=5, shared=shared)
    y = moe_reference(x, idx, wts, *ws, shared=sh, compute_dtype=torch.float64)
    ref = _hand(x, idx, wts, ws, sh)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)


def test_reference_gradients_match_float64_autograd_of_hand_computation():
    x, idx, wts, ws, sh = _inputs(T=7, E_local=3, k=2)
    leaves = [x, wts, *ws, *sh]
    for t in leaves:
        t.requires_grad_(True)
    dy = torch.randn(x.shape, dtype=torch.float64)
    y = moe_reference(x, idx, wts, *ws, shared=sh, compute_dtype=torch.float64)
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(_hand(x, idx, wts, ws, sh), leaves, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_reference_bf16_close_to_float64():
    x, idx, wts, ws, sh = _inputs(T=64, E_local=4, H=64, I=32, dtype=torch.bfloat16)
    y = moe_reference(x, idx, wts, *ws, shared=sh).double()
    ref = _hand(x, idx, wts, ws, sh)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


def test_reference_empty_experts_and_all_to_one():
    x, idx, wts, ws, sh = _inputs(T=9, E_local=6)
    idx = torch.zeros_like(idx)  # every (token, k) to expert 0: experts 1..5 receive nothing
    y = moe_reference(x, idx, wts, *ws, shared=sh, compute_dtype=torch.float64)
    assert torch.allclose(y, _hand(x, idx, wts, ws, sh), rtol=1e-12, atol=1e-12)


def test_reference_is_bitwise_deterministic():
    x, idx, wts, ws, sh = _inputs(T=33, E_local=4, dtype=torch.float32)
    ys = [moe_reference(x, idx, wts, *ws, shared=sh) for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])


# ---------------------------------------------------------------- expert parallel over gloo

def _ep_worker(rank, W, init_file, T, E_local, result_dir, shared):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    try:
        x, idx, wts, ws, sh = _inputs(T, E_local, W=W, dtype=torch.float32, seed=1)
        rows = slice(rank * T, (rank + 1) * T)
        mine = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        local_w = [w[rank * E_local:(rank + 1) * E_local].clone().requires_grad_(True) for w in ws]
        sh_l = [w.clone().requires_grad_(True) for w in sh] if shared else []
        dy = torch.randn(T * W, x.shape[1], generator=torch.Generator().manual_seed(2))
        y = moe_reference(mine[0], idx[rows], mine[1], *local_w, shared=sh_l or None, group=dist.group.WORLD)
        y.backward(dy[rows])
        torch.save({"y": y.detach(), "dx": mine[0].grad, "dw": mine[1].grad,
                    "dws": [w.grad for w in local_w], "dsh": [w.grad for w in sh_l]},
                   os.path.join(result_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("W", [2, 4])
def test_ep_reference_equals_single_process(W, shared):
    """Routed path: bitwise equal (same rows in the same order per expert segment).

    The shared expert is one dense matmul over a rank's tokens; CPU BLAS results depend on the
    row count, so with it y and dx match the single process to rounding, not bitwise.
    """
    T, E_local = 11, 3
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ep_worker, args=(W, os.path.join(d, "init"), T, E_local, d, shared), nprocs=W, join=True)
        res = [torch.load(os.path.join(d, f"r{r}.pt")) for r in range(W)]
    x, idx, wts, ws, sh = _inputs(T, E_local, W=W, dtype=torch.float32, seed=1)
    sh = sh if shared else ()
    leaves = [t.clone().requires_grad_(True) for t in (x, wts, *ws, *sh)]
    y = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], shared=leaves[5:] or None)
    dy = torch.randn(T * W, x.shape[1], generator=torch.Generator().manual_seed(2))
    y.backward(dy)
    same = torch.equal if not shared else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert same(torch.cat([r["y"] for r in res]), y.detach())
    assert same(torch.cat([r["dx"] for r in res]), leaves[0].grad)
    assert torch.equal(torch.cat([r["dw"] for r in res]), leaves[1].grad)
    for i in range(3):
        assert torch.equal(torch.cat([r["dws"][i] for r in res]), leaves[2 + i].grad)
    # The shared expert is replicated: each rank's gradient covers its own tokens only.
    for i in range(len(sh)):
        assert torch.allclose(sum(r["dsh"][i] for r in res), leaves[5 + i].grad, rtol=1e-4, atol=1e-5)


def _mismatch_worker(rank, W, init_file, q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    try:
        x, idx, wts, ws, _ = _inputs(T=5 + rank, E_local=4, k=2, W=1, dtype=torch.float32)  # T differs by rank
        try:
            moe_reference(x, idx, wts, *[w[:2] for w in ws], group=dist.group.WORLD)
            q.put((rank, "no error"))
        except MoEInputError as e:
            q.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def test_ep_ranks_disagreeing_on_shapes_raise_on_every_rank():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_mismatch_worker, args=(2, os.path.join(d, "init"), q), nprocs=2, join=True)
    msgs = dict(q.get() for _ in range(2))
    for r in range(2):
        assert "disagree" in msgs[r] and "rank 1: T=6" in msgs[r]


# ---------------------------------------------------------------- validation

def _ok():
    x, idx, wts, ws, sh = _inputs(T=4, E_local=3, dtype=torch.float32)
    return dict(x=x, topk_idx=idx, topk_weights=wts, w_gate=ws[0], w_up=ws[1], w_down=ws[2], shared=sh)


def _call(**kw):
    return moe_reference(**kw)


BAD_CASES = {
    "x not 2d": (lambda a: a.update(x=a["x"][None]), "x must be [T, H]"),
    "x int": (lambda a: a.update(x=a["x"].long()), "x has dtype"),
    "idx rows": (lambda a: a.update(topk_idx=a["topk_idx"][:3]), "topk_idx must be [T=4, k]"),
    "idx float": (lambda a: a.update(topk_idx=a["topk_idx"].float()), "int32 or int64"),
    "weights shape": (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), "topk_weights must be [T=4, k=3]"),
    "weights int": (lambda a: a.update(topk_weights=a["topk_weights"].long()), "floating point"),
    "id too large": (lambda a: a["topk_idx"].__setitem__((1, 2), 3), "outside [0, E=3)"),
    "id negative": (lambda a: a["topk_idx"].__setitem__((0, 0), -1), "outside [0, E=3)"),
    "w_gate hidden": (lambda a: a.update(w_gate=a["w_gate"][:, :, :5]), "w_gate is [E_local, I, H] with H=5"),
    "w_up shape": (lambda a: a.update(w_up=a["w_up"][:2]), "w_up must be [E_local=3"),
    "w_down shape": (lambda a: a.update(w_down=a["w_down"].transpose(1, 2)), "w_down must be [E_local=3, H=24, I=40]"),
    "weight dtype": (lambda a: a.update(w_down=a["w_down"].double()), "w_down has dtype torch.float64"),
    "shared arity": (lambda a: a.update(shared=a["shared"][:2]), "shared must be None or a tuple"),
    "shared shape": (lambda a: a.update(shared=(a["shared"][0], a["shared"][1][:3], a["shared"][2])),
                     "shared w_up_s must be [I_s=16, H=24]"),
    "device": (lambda a: a.update(topk_weights=a["topk_weights"].to("meta")), "one device"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validation_errors(case):
    args = _ok()
    mutate, msg = BAD_CASES[case]
    mutate(args)
    with pytest.raises(MoEInputError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _call(**args)


def test_tiny_shape_runs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, TINY.H, generator=g).bfloat16()
    idx, wts = make_routing(6, TINY.E, TINY.k, generator=g)
    ws, sh = make_weights(TINY, TINY.E, generator=g)
    assert moe_reference(x, idx, wts, *ws, shared=sh).shape == (6, TINY.H)
