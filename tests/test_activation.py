"""The experts' activation (``MoEConfig(activation=tabby.Activation(...))``, tabby/activation.py):
the spec's checks; its torch form's gradients (the kernels' formulas, ``activation.grads``)
against autograd, clamps clipping; the layer in every kind, on both paths (the forward megakernel
and the separate launches), bf16 and FP8, values and every gradient against the reference with
the same activation, on the CPU (kernels interpreted, ranks as threads); bitwise repeat.
Plain SwiGLU's compiled code is pinned in test_activation_ptx_pinned.py."""
import pytest
import torch
from harness import make_problem, rel_err, run_ranks

import tabby
from tabby import reference_fp8
from tabby.activation import KINDS, Activation, apply, grads
from tabby.functional.config import MoEConfig, Tuning, config_string, parse_config
from tabby.functional.moe import moe
from tabby.validate import MoEInputError

CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(CUDA, reason="CPU harness (interpreted kernels, simulated ranks)")
# how the kernels' bf16 stores round: the interpreter truncates (test_fp8_layer.py)
ROUNDING = "nearest" if CUDA else "truncate"
SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
# g, u ~ N(0, 1) in make_problem's layers: a limit of 0.6 clips a good part of both
ACTS = {"swiglu": Activation(), "swiglu-clamp": Activation("swiglu-clamp", limit=0.6),
        "swiglu-clamp-out": Activation("swiglu-clamp-out", limit=0.25),
        "gpt-oss": Activation("gpt-oss", limit=0.6, alpha=1.702), "geglu": Activation("geglu"),
        "relu2": Activation("relu2")}  # (ungated: its layer tests are test_ungated.py's)
assert set(ACTS) == set(KINDS)


def test_the_spec_checks_its_fields():
    for bad in (dict(kind="gelu"), dict(kind="swiglu", limit=7.0), dict(kind="geglu", limit=7.0),
                dict(kind="swiglu-clamp"),
                dict(kind="swiglu-clamp", limit=-1.0), dict(kind="swiglu-clamp", limit=float("inf")),
                dict(kind="gpt-oss", limit=7.0), dict(kind="swiglu-clamp", limit=7.0, alpha=1.0),
                dict(kind="swiglu-clamp", limit=True)):
        with pytest.raises(MoEInputError):
            Activation(**bad)
    with pytest.raises(MoEInputError, match="activation"):
        MoEConfig(activation="swiglu")
    a = Activation("gpt-oss", limit=7, alpha=1.702)
    assert a.limit == 7.0 and isinstance(a.limit, float) and str(a) == "gpt-oss(limit=7.0, alpha=1.702)"
    c = MoEConfig(activation=a)
    assert parse_config(config_string(c)) == c and config_string(MoEConfig()) == ""


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernels_gradient_formulas_are_autograds(kind):
    """``activation.grads`` (the epilogues' formulas) equals autograd of ``activation.apply`` in fp64,
    with values on both sides of every clamp (zero gradient where one clips)."""
    act = ACTS[kind]
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(4000, generator=gen, dtype=torch.float64) * 1.5).requires_grad_(True)
    u = (torch.randn(4000, generator=gen, dtype=torch.float64) * 1.5).requires_grad_(True)
    dh = torch.randn(4000, generator=gen, dtype=torch.float64)
    h = apply(g if act.gated else None, u, act)
    want = torch.autograd.grad(h, (g, u), dh, allow_unused=not act.gated)
    got = grads(g.detach(), u.detach(), dh, act)
    for w, o in zip(want, got):
        if w is None:  # (ungated: no gate, no dg)
            assert o is None
            continue
        torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
    if act.limit is not None:  # the clamps clip here
        assert (u.abs() > act.limit).any() and (got[1][u.detach().abs() > act.limit] == 0).all()


def _run(prob, cfg, W, device="cpu"):
    """Tabby on W simulated ranks (or one rank on ``device``): [y, dx, d topk_weights, dW_gate,
    dW_up, dW_down] concatenated, on the CPU in fp32."""
    x, idx, wts, ws, _, dy = prob
    T, E_local = x.shape[0] // W, ws[0].shape[0] // W
    if device != "cpu":
        lv = [t.to(device).clone().requires_grad_(True) for t in (x, wts, *ws)]
        y = moe(lv[0], idx.to(device), lv[1], *lv[2:], config=cfg)
        y.backward(dy.to(device))
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        lv = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        lv += [w[r * E_local:(r + 1) * E_local].clone().requires_grad_(True) for w in ws]
        y = moe(lv[0], idx[rows], lv[1], *lv[2:], group=group, config=cfg)
        y.backward(dy[rows])
        return [y.detach()] + [t.grad for t in lv]

    res = run_ranks(W, rank_fn)
    return [torch.cat([r[i] for r in res]).float() for i in range(6)]


def _at_kept_points(g, u, act):
    """act(g, u) in fp32, differentiated at g, u rounded to bf16: what the layer does (its forward
    takes h from the fp32 g, u; its backward reads g | u as it keeps them, in bf16). Where a clamp's
    gradient jumps (at its bound), a value within bf16's rounding of the bound is on one side in the
    fp32 reference and on the other in the layer: at these sizes one such value moves the gradients
    of g and u by several per cent, which this reference does not."""
    kept = [t + (reference_fp8.to_bf16(t.detach(), ROUNDING).float() - t).detach() for t in (g, u)]
    value, graph = apply(g, u, act), apply(*kept, act)
    return graph + (value - graph).detach()


def _reference(prob, act, at_kept=True, monkeypatch=None, device="cpu"):
    x, idx, wts, ws, _, dy = prob
    lv = [t.to(device).clone().requires_grad_(True) for t in (x, wts, *ws)]
    if at_kept and act.limit is not None:
        monkeypatch.setattr(tabby.reference, "apply_activation", _at_kept_points)
    y = tabby.moe_reference(lv[0], idx.to(device), lv[1], *lv[2:], activation=act)
    y.backward(dy.to(device))
    if monkeypatch is not None:
        monkeypatch.undo()
    return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]


def _compare(got, want, tol):
    names = ["y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return errs


PATHS = {"separate": dict(megakernel=False),
         "megakernel": dict(megakernel=True, tuning=Tuning(**SMALL, ring_rows=32, programs=3))}
CASES = [(kind, path) for kind in KINDS for path in PATHS if kind != "swiglu" and ACTS[kind].gated]


@cpu_only
@pytest.mark.parametrize("kind,path", CASES)
def test_the_layer_matches_the_reference(kind, path, monkeypatch):
    """y and every gradient against ``moe_reference(activation=...)`` in fp32, its gradient taken at
    g, u as the layer keeps them (``_at_kept_points``); y also against the plain fp32 reference; an
    expert with no rows; EP2 on the megakernel (its fills across ranks), EP1 on the separate
    launches; the result differs from plain SwiGLU's (the activation took effect)."""
    act = ACTS[kind]
    W = 2 if path == "megakernel" else 1
    prob = make_problem(W, 9, 32, 24, 3, 2, seed=len(kind) + 7 * W)
    x, idx, *rest = prob
    prob = (x, torch.where(idx == 1, 2, idx), *rest)  # expert 1: no rows
    kw = dict(PATHS[path])
    kw.setdefault("tuning", Tuning(**SMALL))
    got = _run(prob, MoEConfig(activation=act, **kw), W)
    _compare(got, _reference(prob, act, monkeypatch=monkeypatch), 2e-2)
    assert rel_err(got[0], _reference(prob, act, at_kept=False)[0]) < 2e-2
    plain = _reference(prob, Activation())
    assert rel_err(got[0], plain[0]) > 5e-2


@cpu_only
@pytest.mark.parametrize("kind", ["swiglu-clamp", "gpt-oss"])
def test_fp8_matches_its_reference(kind):
    """precision="fp8": y against ``moe_reference_fp8(activation=...)`` and every gradient against
    ``moe_backward_reference_fp8(activation=...)`` (the same quantizations: tight), and y, the
    router weights' and W_down's gradients against the fp32 reference (E4M3's rounding: a few per
    cent; the gradients of g and u jump at the clamps' bounds, and E4M3's g, u sit on the other side
    of them often enough to move those by tens of per cent); H, I multiples of 16, not of 128."""
    act = ACTS[kind]
    prob = make_problem(1, 150, 272, 144, 3, 2, seed=11)
    x, idx, wts, ws, _, dy = prob
    cfg = MoEConfig(megakernel=False, precision="fp8", activation=act, tuning=Tuning(**dict(SMALL, tile_m=128)))
    got = _run(prob, cfg, 1)
    y = tabby.moe_reference_fp8(x, idx, wts, *ws, bf16_rounding=ROUNDING, activation=act).float()
    back = reference_fp8.moe_backward_reference_fp8(x, idx, wts, *ws, dy, bf16_rounding=ROUNDING, activation=act)
    _compare(got, [y] + [t.float() for t in back], 1e-2)
    want = _reference(prob, act, at_kept=False)
    assert all(rel_err(got[i], want[i]) < 1e-1 for i in (0, 2, 5))


@cpu_only
def test_bitwise_repeatable():
    act = ACTS["gpt-oss"]
    prob = make_problem(1, 9, 32, 24, 3, 2, seed=5)
    cfg = MoEConfig(megakernel=False, activation=act, tuning=Tuning(**SMALL))
    a, b = _run(prob, cfg, 1), _run(prob, cfg, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_the_plan_names_the_activation():
    from tabby.functional.plan import make_plan
    from tabby.validate import MoEDims

    dims = MoEDims(T=64, H=32, k=2, E_local=4, I=16, world_size=1, I_shared=0)
    for mega in (True, False):
        plan = make_plan(dims, MoEConfig(megakernel=mega, activation=ACTS["gpt-oss"]), torch.device("cpu"))
        assert plan.activation == ACTS["gpt-oss"] and "activation gpt-oss(limit=0.6, alpha=1.702)" in plan.describe()
        if mega:
            assert plan.mega.activation == ACTS["gpt-oss"]


@cpu_only
def test_nn_experts_takes_the_activation():
    """``tabby.nn.Experts(activation=...)``: the config's activation; y against the reference; a
    config with another activation beside it is refused."""
    act = ACTS["swiglu-clamp"]
    ex = tabby.nn.Experts(3, 32, 24, activation=act, config=MoEConfig(megakernel=False, tuning=Tuning(**SMALL)),
                          init_std=None)
    assert ex.config.activation == act and "swiglu-clamp(limit=0.6)" in repr(ex)
    x, idx, wts, _, _, _ = make_problem(1, 9, 32, 24, 3, 2, seed=2)
    with torch.no_grad():
        y = ex(x, idx, wts)
        want = tabby.moe_reference(x, idx, wts, *ex.weights(), activation=act)
    assert rel_err(y, want) < 2e-2
    with pytest.raises(MoEInputError, match="differ"):
        tabby.nn.Experts(3, 32, 24, activation=act, config=MoEConfig(activation=ACTS["gpt-oss"]))
