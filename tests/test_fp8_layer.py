"""The FP8 layer, ``MoEConfig(precision="fp8", megakernel=False)``: values and every gradient
against ``tabby.moe_reference_fp8`` (the same quantizations in plain PyTorch, and the gradient of
the fp32 layer at the FP8 forward's activations), and against the fp32 reference; config checks,
the weight cache, determinism, simulated expert parallelism. CPU: ranks as threads, kernels
interpreted; on a GPU, one rank with realistic sizes."""
import pytest
import torch

import tabby
from tabby.functional import fp8 as fp8_layer
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.moe import moe

from harness import make_problem, rel_err, run_ranks

CUDA = torch.cuda.is_available()
SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
CFG = MoEConfig(megakernel=False, precision="fp8", tuning=Tuning(**SMALL))
GPU_CFG = MoEConfig(megakernel=False, precision="fp8")


def _leaves(prob, device="cpu"):
    x, idx, wts, ws, sh, dy = prob
    lv = [t.to(device).clone().requires_grad_(True) for t in (x, wts, *ws, *(sh or ()))]
    return lv, idx.to(device), dy.to(device)


def _grads(y, lv, dy):
    y.backward(dy)
    return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]


NAMES = ["y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dsg", "dsu", "dsd"]


def _run(prob, cfg, device="cpu", W=1):
    """Tabby on W simulated ranks (concatenated results) or one rank on ``device``."""
    x, idx, wts, ws, sh, dy = prob
    if W == 1:
        lv, idx_d, dy_d = _leaves(prob, device)
        y = moe(lv[0], idx_d, lv[1], *lv[2:5], shared=lv[5:] or None, config=cfg)
        return _grads(y, lv, dy_d)
    T = x.shape[0] // W
    E_local = ws[0].shape[0] // W

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        lv = [t[rows].clone().requires_grad_(True) for t in (x, wts)]
        lv += [w[r * E_local:(r + 1) * E_local].clone().requires_grad_(True) for w in ws]
        y = moe(lv[0], idx[rows], lv[1], *lv[2:5], group=group, config=cfg)
        return _grads(y, lv, dy[rows])

    res = run_ranks(W, rank_fn)
    return [torch.cat([r[i] for r in res]) for i in range(6)]


def _reference(prob, fp8=True):
    lv, idx, dy = _leaves(prob)
    fn = tabby.moe_reference_fp8 if fp8 else tabby.moe_reference
    y = fn(lv[0], idx, lv[1], *lv[2:5], shared=lv[5:] or None)
    return _grads(y, lv, dy)


def _compare(got, want, tol):
    errs = {NAMES[i]: rel_err(g, w) for i, (g, w) in enumerate(zip(got, want))}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return errs


@pytest.mark.parametrize("case", ["plain", "empty_experts_and_shared", "one_token"])
def test_fp8_layer_matches_reference(case):
    T, E, k, shared, route = {"plain": (40, 4, 2, False, "random"),
                              "empty_experts_and_shared": (24, 6, 2, True, "one_rank"),
                              "one_token": (1, 4, 3, False, "random")}[case]
    prob = make_problem(1, T, 256, 128, E, k, shared=shared, seed=T + E, route=route)
    if route == "one_rank":  # experts 0, 2, 4 get no rows
        prob = (prob[0], prob[1] % 2 * 2 + 1, *prob[2:])
    got = _run(prob, CFG)
    want = _reference(prob)
    # the same quantizations: bf16-level differences (bf16 g | u and pushed rows, fp32 sums in another order)
    errs = _compare(got, want, 2e-2)
    # against the unquantized fp32 layer: E4M3's rounding, a few per cent, and clearly more than the above
    exact = _reference(prob, fp8=False)
    e_exact = rel_err(got[0], exact[0])
    assert 5e-3 < e_exact < 8e-2
    assert errs["y"] < e_exact / 3


def test_fp8_layer_deterministic_and_cached_weights():
    prob = make_problem(1, 32, 128, 128, 3, 2, seed=11)
    x, idx, wts, ws, _, _ = prob
    w = [t.clone() for t in ws]
    fp8_layer.clear_weight_cache()
    with torch.no_grad():
        y1 = moe(x, idx, wts, *w, config=CFG)
        q1 = fp8_layer.fp8_weight(w[0])[0]
        y2 = moe(x, idx, wts, *w, config=CFG)
        assert fp8_layer.fp8_weight(w[0])[0] is q1  # cached: quantized once per weight version
        assert torch.equal(y1, y2)  # bitwise repeat
        w[2].mul_(2.0)  # an in-place update (as an optimizer step): a new version, re-quantized
        y3 = moe(x, idx, wts, *w, config=CFG)
    assert rel_err(y3, 2 * y1.float()) < 1e-2  # scales are powers of two: doubling is exact up to bf16 sums
    assert rel_err(y3, tabby.moe_reference_fp8(x, idx, wts, *w)) < 2e-2


def test_fp8_layer_expert_parallel_two_ranks():
    """EP2 on simulated ranks equals the one-process FP8 reference on the concatenated tokens."""
    prob = make_problem(2, 20, 128, 128, 2, 2, seed=5)
    got = _run(prob, CFG, W=2)
    want = _reference(prob)
    _compare(got, want[:6], 2e-2)


def test_fp8_config_checks():
    with pytest.raises(tabby.MoEInputError, match="precision"):
        MoEConfig(precision="fp16")
    with pytest.raises(tabby.MoEInputError, match="megakernel=False"):
        MoEConfig(precision="fp8")
    prob = make_problem(1, 8, 96, 128, 2, 1, seed=1)  # H = 96
    x, idx, wts, ws, _, _ = prob
    with pytest.raises(tabby.MoEInputError, match="multiples of 128"):
        moe(x, idx, wts, *ws, config=CFG)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,I,E,k,T", [(2048, 768, 16, 8, 1024), (1024, 512, 8, 2, 333)])
def test_fp8_layer_gpu(H, I, E, k, T):
    prob = make_problem(1, T, H, I, E, k, seed=H + T)
    got = _run(prob, GPU_CFG, device="cuda")
    want = _reference(prob)
    _compare(got, want[:6], 2e-2)
    exact = _reference(prob, fp8=False)
    assert rel_err(got[0], exact[0]) < 8e-2
    again = _run(prob, GPU_CFG, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # bitwise deterministic
