"""The routed experts' biases (``tabby.moe(..., biases=(b_gate, b_up, b_down))``: g + b_gate and
u + b_up before the activation, b_down added to each expert's output before the router weight;
gpt-oss's experts): values and every gradient, the biases' included, against
``tabby.moe_reference(biases=)`` on the CPU (kernels interpreted, ranks as threads), EP1 and EP2,
with SwiGLU and gpt-oss's activation, an expert with no rows; bitwise repeat; no tokens; the
configurations that cannot take them yet refused by name. (bf16 on the path of separate launches
and bf16.py's kernels for now: the plan's choice where biases are given.)"""
import pytest
import torch
from harness import make_problem, rel_err, run_ranks

import tabby
from tabby.activation import Activation
from tabby.functional.config import MoEConfig, Tuning
from tabby.validate import MoEInputError

CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(CUDA, reason="CPU harness (interpreted kernels, simulated ranks)")
SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
NAMES = ["y", "dx", "d topk_weights", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down"]


def _problem(W, T, H, I, E_local, k, seed):
    x, idx, wts, ws, _, dy = make_problem(W, T, H, I, E_local, k, seed=seed)
    idx = torch.where(idx == 1, 2, idx)  # expert 1: no rows
    g = torch.Generator().manual_seed(seed + 1)
    E = W * E_local
    bs = tuple((torch.randn(E, n, generator=g) * 0.5).bfloat16() for n in (I, I, H))
    return x, idx, wts, ws, bs, dy


def _run(prob, cfg, W):
    x, idx, wts, ws, bs, dy = prob
    T, E_local = x.shape[0] // W, ws[0].shape[0] // W

    def rank_fn(r, group):
        rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
        lv = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        lv += [t[ex].clone().requires_grad_(True) for t in (*ws, *bs)]
        y = tabby.moe(lv[0], idx[rows], lv[1], *lv[2:5], group=group, config=cfg, biases=tuple(lv[5:]))
        y.backward(dy[rows])
        return [y.detach()] + [t.grad for t in lv]

    res = run_ranks(W, rank_fn)
    return [torch.cat([r[i] for r in res]).float() for i in range(len(NAMES))]


def _reference(prob, act=None):
    x, idx, wts, ws, bs, dy = prob
    lv = [t.clone().requires_grad_(True) for t in (x, wts, *ws, *bs)]
    y = tabby.moe_reference(lv[0], idx, lv[1], *lv[2:5], activation=act, biases=tuple(lv[5:]))
    y.backward(dy)
    return [y.detach().float()] + [t.grad.float() for t in lv]


def _compare(got, want, tol=2e-2):
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, want)}
    assert all(e < tol for e in errs.values()), errs
    return errs


@cpu_only
@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("act", [None, Activation("gpt-oss", limit=7.0, alpha=1.702)], ids=["swiglu", "gpt-oss"])
def test_biases_match_the_reference(W, act):
    prob = _problem(W, 9, 32, 24, 3 if W == 1 else 2, 2, seed=11 + W)
    cfg = MoEConfig(tuning=Tuning(**SMALL), **({} if act is None else dict(activation=act)))
    got = _run(prob, cfg, W)
    _compare(got, _reference(prob, act))
    x, idx, wts, ws, bs, dy = prob  # the biases took effect
    without = tabby.moe_reference(x, idx, wts, *ws, activation=act)
    assert rel_err(got[0], without.float()) > 5e-2


@cpu_only
def test_biases_bitwise_repeatable_and_the_plan():
    prob = _problem(1, 9, 32, 24, 3, 2, seed=5)
    cfg = MoEConfig(tuning=Tuning(**SMALL))
    a, b = _run(prob, cfg, 1), _run(prob, cfg, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_configurations_without_biases_refuse_them():
    x, idx, wts, ws, bs, dy = _problem(1, 9, 32, 24, 3, 2, seed=5)
    for cfg in (MoEConfig(megakernel=True), MoEConfig(precision="fp8")):
        with pytest.raises(MoEInputError, match="biases"):
            tabby.moe(x, idx, wts, *ws, config=cfg, biases=bs)
    with pytest.raises(MoEInputError, match="b_down must be"):
        tabby.moe(x, idx, wts, *ws, biases=(bs[0], bs[1], bs[1]))
    with pytest.raises(MoEInputError, match="biases must be"):
        tabby.moe(x, idx, wts, *ws, biases=bs[:2])


@cpu_only
def test_no_tokens_with_biases():
    x, idx, wts, ws, bs, dy = _problem(1, 9, 32, 24, 3, 2, seed=5)
    lv = [t.clone().requires_grad_(True) for t in (x[:0], wts[:0], *ws, *bs)]
    y = tabby.moe(lv[0], idx[:0], lv[1], *lv[2:5], biases=tuple(lv[5:]))
    y.backward(dy[:0])
    assert y.shape == (0, 32) and all(not t.grad.any() for t in lv[5:])


@cpu_only
@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_nn_experts_with_biases(layout):
    """``tabby.nn.Experts(bias=True)``: zero-initialized biases (the fused layout's a view of
    ``gate_up_proj_bias``, gate first), set here to random values; y and the biases' gradients
    against the reference."""
    ex = tabby.nn.Experts(3, 32, 24, layout=layout, bias=True, init_std=None,
                          config=MoEConfig(tuning=Tuning(**SMALL)))
    assert all(not b.any() for b in ex.biases())
    with torch.no_grad():
        for p in ex.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    x, idx, wts, _, _, dy = make_problem(1, 9, 32, 24, 3, 2, seed=4)
    y = ex(x, idx, wts)
    y.backward(dy)
    got = [y.detach().float()] + [b.grad.float() for b in (ex.gate_up_proj_bias, ex.down_proj_bias)] \
        if layout == "fused" else [y.detach().float()] + [b.grad.float() for b in (ex.b_gate, ex.b_up, ex.b_down)]
    lv = [t.detach().clone().requires_grad_(True) for t in ex.biases()]
    want_y = tabby.moe_reference(x, idx, wts, *(w.detach() for w in ex.weights()), biases=tuple(lv))
    want_y.backward(dy)
    grads = [g.grad.float() for g in lv]
    want = [want_y.detach().float()] + ([torch.cat(grads[:2], 1), grads[2]] if layout == "fused" else grads)
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(got, want)), [rel_err(a, b) for a, b in zip(got, want)]
