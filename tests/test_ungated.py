"""Ungated experts (``Activation("relu2")``, Nemotron-H's down(relu(up x)^2)): ``tabby.moe(x, idx, w,
None, w_up, w_down)`` against ``tabby.moe_reference`` (w_gate None) on the CPU (kernels interpreted,
ranks as threads): values and every gradient, EP1 and EP2, odd widths, an expert without rows, every
row on one expert, transposed weights; bitwise repeat; the gate is never read (a NaN w_gate in its
place changes nothing); the plan's refusals and the argument checks. GPU: test_layouts_gpu.py."""
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
RELU2 = Activation("relu2")
CFG = MoEConfig(activation=RELU2, tuning=Tuning(**SMALL))


def problem(W, T, H, I, E_local, k, seed, route="random"):
    x, idx, wts, (_, w_up, w_down), _, dy = make_problem(W, T, H, I, E_local, k, seed=seed, route=route)
    if route == "random":
        idx = torch.where(idx == 1, 2, idx)  # expert 1: no rows
    return x, idx, wts, w_up, w_down, dy


def run_layer(prob, W, cfg=CFG, transposed=False):
    x, idx, wts, w_up, w_down, dy = prob
    T, E_local = x.shape[0] // W, w_up.shape[0] // W

    def rank_fn(r, group):
        rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
        lv = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        lv += [t[ex].clone().requires_grad_(True) for t in (w_up, w_down)]
        up, down = lv[2:]
        if transposed:  # views of up_proj [E, H, I] and down_proj [E, I, H]
            up, down = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in lv[2:])
            lv[2:] = [up, down]
        y = tabby.moe(lv[0], idx[rows], lv[1], None, up, down, group=group, config=cfg)
        y.backward(dy[rows])
        return [y.detach()] + [t.grad for t in lv]

    res = run_ranks(W, rank_fn)
    return [torch.cat([r[i] for r in res]).float() for i in range(5)]


def run_reference(prob):
    x, idx, wts, w_up, w_down, dy = prob
    lv = [t.float().requires_grad_(True) for t in (x, wts, w_up, w_down)]
    y = tabby.moe_reference(lv[0], idx, lv[1], None, lv[2], lv[3], activation=RELU2)
    y.backward(dy.float())
    return [y.detach()] + [t.grad for t in lv]


def compare(got, want, tol=2e-2):
    errs = {n: rel_err(a, b) for n, a, b in zip(["y", "dx", "d topk_weights", "dw_up", "dw_down"], got, want)}
    assert all(e < tol for e in errs.values()), errs
    return errs


@cpu_only
@pytest.mark.parametrize("W,transposed", [(1, False), (2, False), (1, True)], ids=["ep1", "ep2", "ep1-transposed"])
def test_ungated_matches_the_reference(W, transposed):
    prob = problem(W, 9, 40, 20, 3 if W == 1 else 2, 2, seed=4 + W)  # odd widths: H 40, I 20
    compare(run_layer(prob, W, transposed=transposed), run_reference(prob))


@cpu_only
def test_every_row_on_one_expert():
    prob = problem(1, 16, 32, 24, 3, 2, seed=9, route="one_expert")
    compare(run_layer(prob, 1), run_reference(prob))


@cpu_only
def test_bitwise_repeatable_and_the_gate_is_never_read(monkeypatch):
    prob = problem(1, 9, 32, 24, 3, 2, seed=5)
    a = run_layer(prob, 1)
    from tabby.functional import moe as layer_moe

    real = layer_moe.run_operator

    def nan_gate(x, idx, wts, w_gate, w_up, *rest):  # a NaN tensor in w_gate's place: never read
        return real(x, idx, wts, torch.full_like(w_up, float("nan")), w_up, *rest)

    monkeypatch.setattr(layer_moe, "run_operator", nan_gate)
    b = run_layer(prob, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@cpu_only
def test_arguments_and_plan_refusals():
    x, idx, wts, w_up, w_down, _ = problem(1, 4, 32, 16, 2, 1, seed=1)
    with pytest.raises(MoEInputError, match="w_gate must be None"):
        tabby.moe(x, idx, wts, w_up, w_up, w_down, config=CFG)
    with pytest.raises(MoEInputError, match="needs w_gate"):
        tabby.moe(x, idx, wts, None, w_up, w_down)
    with pytest.raises(MoEInputError, match="w_gate must be None"):
        tabby.moe_reference(x, idx, wts, w_up, w_up, w_down, activation=RELU2)
    for cfg in (MoEConfig(activation=RELU2, megakernel=True), MoEConfig(activation=RELU2, precision="fp8")):
        with pytest.raises(MoEInputError, match="ungated experts"):
            tabby.moe(x, idx, wts, None, w_up, w_down, config=cfg)
    assert not RELU2.gated and Activation().gated


@cpu_only
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_nn_experts_ungated(layout):
    """tabby.nn.Experts with relu2: an up projection only (fused: ``up_proj``, transformers' name), the
    same as tabby.moe on its weights."""
    from tabby.nn import Experts

    ex = Experts(3, 32, 24, layout=layout, config=CFG, dtype=torch.bfloat16)
    names = {n for n, _ in ex.named_parameters()}
    assert names == ({"up_proj", "down_proj"} if layout == "fused" else {"w_up", "w_down"})
    x, idx, wts, _, _, _ = problem(1, 9, 32, 24, 3, 2, seed=2)
    y = ex(x, idx, wts)
    w_gate, w_up, w_down = ex.weights()
    assert w_gate is None
    assert torch.equal(y, tabby.moe(x, idx, wts, None, w_up, w_down, config=CFG))
    with pytest.raises(MoEInputError, match="ungated"):
        Experts(3, 32, 24, config=CFG, bias=True)
