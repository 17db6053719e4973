"""The FP8 layer, ``MoEConfig(precision="fp8" | "fp8-forward", megakernel=False)``: values and
every gradient against the same quantizations in plain PyTorch (``tabby.moe_reference_fp8``;
``reference_fp8.moe_backward_reference_fp8`` for the FP8 backward; for "fp8-forward", the
gradient of the fp32 layer at the FP8 forward's activations) and against the fp32 reference;
config checks, the weight cache, determinism, simulated expert parallelism, on the CPU (ranks as
threads, kernels interpreted). The GPU cases, one rank at realistic sizes, use this file's helpers:
test_fp8_layer_gpu.py and test_fp8_cases_gpu.py."""
import pytest
import torch
from harness import make_problem, rel_err, run_ranks

import tabby
from tabby import reference_fp8
from tabby.functional import fp8 as fp8_layer
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.moe import moe

CUDA = torch.cuda.is_available()
# how the kernels' bf16 stores round: the interpreter truncates, so the CPU reference does too
# and its results equal the kernels' (the same operations in the same order)
ROUNDING = "nearest" if CUDA else "truncate"
SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
CFG = MoEConfig(megakernel=False, precision="fp8-forward", tuning=Tuning(**SMALL))
# the FP8 backward's weight gradients take 128-row tiles from each expert's first row
CFG_BWD = MoEConfig(megakernel=False, precision="fp8", tuning=Tuning(**dict(SMALL, tile_m=128)))
GPU_CFG = MoEConfig(megakernel=False, precision="fp8-forward")
# the CPU harness (simulated ranks, interpreted kernels on CPU tensors) runs where there is no GPU
cpu_only = pytest.mark.skipif(CUDA, reason="CPU harness: runs without a GPU (the GPU cases: test_fp8_layer_gpu.py, test_fp8_cases_gpu.py)")
GPU_CFG_BWD = MoEConfig(megakernel=False, precision="fp8")


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


def _reference(prob, fp8=True, device="cpu"):
    """The plain PyTorch layer's values and gradients (``device``: where it computes; the GPU tests
    compute it on the GPU, where sixteen test processes do not share the host's cores for it)."""
    lv, idx, dy = _leaves(prob, device)
    if fp8:
        y = tabby.moe_reference_fp8(lv[0], idx, lv[1], *lv[2:5], shared=lv[5:] or None, bf16_rounding=ROUNDING)
    else:
        y = tabby.moe_reference(lv[0], idx, lv[1], *lv[2:5], shared=lv[5:] or None)
    return _grads(y, lv, dy)


def _compare(got, want, tol):
    errs = {NAMES[i]: rel_err(g, w) for i, (g, w) in enumerate(zip(got, want))}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return errs


@cpu_only
@pytest.mark.parametrize("case", ["plain", "empty_experts_and_shared", "one_token", "partial_tiles"])
def test_fp8_layer_matches_reference(case):
    """"partial_tiles": H = 272, I = 144, not multiples of 128 (the last 1x128 tile and 128x128
    block along each is 16 wide, with its own scale)."""
    T, H, I, E, k, shared, route = {"plain": (40, 256, 128, 4, 2, False, "random"),
                                    "empty_experts_and_shared": (24, 256, 128, 6, 2, True, "one_rank"),
                                    "one_token": (1, 256, 128, 4, 3, False, "random"),
                                    "partial_tiles": (40, 272, 144, 4, 2, False, "random")}[case]
    prob = make_problem(1, T, H, I, E, k, shared=shared, seed=T + E, route=route)
    if route == "one_rank":  # experts 0, 2, 4 get no rows
        prob = (prob[0], prob[1] % 2 * 2 + 1, *prob[2:])
    got = _run(prob, CFG)
    want = _reference(prob)
    # the same quantizations; the gradients are the bf16 backward's (bf16 GEMMs) against fp32 math
    errs = _compare(got, want, 2e-2)
    assert errs["y"] < (2e-2 if CUDA else 1e-5)  # the forward: the same operations
    # against the unquantized fp32 layer: E4M3's rounding, a few per cent, and clearly more than the above
    exact = _reference(prob, fp8=False)
    e_exact = rel_err(got[0], exact[0])
    assert 5e-3 < e_exact < 8e-2
    assert errs["y"] < e_exact / 3


@cpu_only
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


@cpu_only
@pytest.mark.parametrize("precision", ["fp8", "fp8-forward"])
def test_fp8_dispatch_publishes_quantized_tokens(precision):
    """The FP8 forward publishes each token once, quantized per 1x128 (xq_pub, xs_pub: the bits of
    the definition), and pulls those rows; "fp8-forward" under autograd publishes bf16 x (its bf16
    backward reads bf16 rows)."""
    from tabby.functional.workspace import cached_workspaces

    tabby.free_workspaces()
    prob = make_problem(1, 24, 272, 144, 4, 2, seed=3)
    x, idx, wts, ws, _, _ = prob
    lv = [t.clone().requires_grad_(True) for t in (x, wts, *ws)]
    moe(lv[0], idx, lv[1], *lv[2:], config=CFG_BWD if precision == "fp8" else CFG)
    (w,) = cached_workspaces()
    rq, rs = reference_fp8.quantize_rows_ref(x)
    if precision == "fp8":
        assert torch.equal(w.xq_pub, rq.view(torch.uint8)) and torch.equal(w.xs_pub, rs)
        assert not w.x_pub.any()  # never written
    else:
        assert torch.equal(w.x_pub, x) and not w.xq_pub.any()
    tabby.free_workspaces()


@cpu_only
def test_fp8_weight_cache_follows_the_weight():
    """A cached copy is reused while the weight is unchanged, replaced after an in-place update, and
    dropped when the weight is freed."""
    import gc

    fp8_layer.clear_weight_cache()
    w = torch.randn(2, 256, 128).to(torch.bfloat16)
    q1, s1 = fp8_layer.fp8_weight(w)
    assert fp8_layer.fp8_weight(w)[0] is q1
    qt = fp8_layer.fp8_weight_t(w, hold=False)[0]
    assert torch.equal(qt.view(torch.uint8), q1.transpose(1, 2).contiguous().view(torch.uint8))
    assert len(fp8_layer._weight_cache) == 1  # not held: made for one backward and dropped
    assert fp8_layer.fp8_weight_t(w, hold=True)[0] is fp8_layer.fp8_weight_t(w, hold=False)[0]  # held
    w.mul_(4.0)  # a new version: scales x4, values unchanged
    qt2 = fp8_layer.fp8_weight_t(w, hold=True)[0]  # both stale entries replaced
    assert qt2 is not qt and len(fp8_layer._weight_cache) == 2
    q2, s2 = fp8_layer.fp8_weight(w)
    assert q2 is not q1 and torch.equal(q2.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s2, 4 * s1)
    del w, qt, qt2
    gc.collect()
    assert len(fp8_layer._weight_cache) == 0
    # views made afresh at each call (the halves of a fused weight) hit through their base
    fused = torch.randn(2, 512, 128).to(torch.bfloat16)
    up = fp8_layer.fp8_weight(fused[:, 256:])[0]
    assert fp8_layer.fp8_weight(fused[:, 256:])[0] is up
    assert fp8_layer.fp8_weight(fused[:, :256])[0] is not up
    fused[:, 256:].zero_()  # through a view: the base's version moves
    assert bool((fp8_layer.fp8_weight(fused[:, 256:])[0].view(torch.uint8) == 0).all())


@cpu_only
def test_stale_fp8_copy_is_freed_before_its_successor_is_made():
    """After an optimizer step the old FP8 copy is released before the new one is made: the cache
    never holds two copies of one weight (at kimi-k2, 16 GiB more at the peak of each step)."""
    import weakref

    fp8_layer.clear_weight_cache()
    w = torch.randn(2, 256, 128).to(torch.bfloat16)
    old = weakref.ref(fp8_layer.fp8_weight(w)[0])
    assert old() is not None
    w.mul_(2.0)
    alive_while_making = []

    def make():
        alive_while_making.append(old() is not None)
        return "new"

    assert fp8_layer._cached("blocks", (w,), make) == "new"
    assert alive_while_making == [False]
    fp8_layer.clear_weight_cache()


@cpu_only
def test_fp8_weight_cache_is_bypassed_while_a_cuda_graph_is_captured(monkeypatch):
    """Under capture the quantization must be recorded in the graph (replays see updated weights)."""
    fp8_layer.clear_weight_cache()
    w = torch.randn(1, 128, 128).to(torch.bfloat16)
    monkeypatch.setattr(fp8_layer, "_capturing", lambda: True)
    assert fp8_layer.fp8_weight(w)[0] is not fp8_layer.fp8_weight(w)[0]
    assert len(fp8_layer._weight_cache) == 0


@cpu_only
def test_fp8_layer_expert_parallel_two_ranks():
    """EP2 on simulated ranks equals the one-process FP8 reference on the concatenated tokens."""
    prob = make_problem(2, 20, 128, 128, 2, 2, seed=5)
    got = _run(prob, CFG, W=2)
    want = _reference(prob)
    _compare(got, want[:6], 2e-2)


def _reference_fp8_backward(prob, device="cpu"):
    """Values from moe_reference_fp8, gradients from moe_backward_reference_fp8; a shared expert's
    (bf16 PyTorch in the layer too) from autograd, its dx added to the routed dx (in fp32: the
    layer adds two bf16 tensors, hence the tolerance where there is one). Returned on the CPU."""
    x, idx, wts, ws, sh, dy = (None if t is None else [w.to(device) for w in t] if isinstance(t, (list, tuple))
                               else t.to(device) for t in prob)
    y = tabby.moe_reference_fp8(x, idx, wts, *ws, shared=sh, bf16_rounding=ROUNDING).float()
    dx, dtopk, dwg, dwu, dwd = reference_fp8.moe_backward_reference_fp8(x, idx, wts, *ws, dy, bf16_rounding=ROUNDING)
    out = [y, dx.float(), dtopk.float(), dwg.float(), dwu.float(), dwd.float()]
    if sh is not None:
        xs, sg, su, sd = (t.clone().requires_grad_(True) for t in (x, *sh))
        ys = (torch.nn.functional.silu(xs @ sg.t()) * (xs @ su.t())) @ sd.t()
        dxs, dsg, dsu, dsd = torch.autograd.grad(ys, (xs, sg, su, sd), dy)
        out[1] = out[1] + dxs.float()
        out += [dsg.float(), dsu.float(), dsd.float()]
    return [t.cpu() for t in out]


@cpu_only
@pytest.mark.parametrize("W,H,I,seed", [(1, 256, 256, 22), (2, 256, 256, 23), (1, 272, 144, 294), (2, 272, 144, 295)])
def test_fp8_backward_matches_reference(W, H, I, seed):
    """precision="fp8": every gradient from the FP8 backward against the recipe in plain PyTorch
    (tight), and against the fp32 layer (E4M3's rounding, a few per cent); experts with no rows.
    H = 272, I = 144: partial last tiles and blocks along both (16 of 128), and the gate/up dgrad's
    K = 2I with each half padded to 256."""
    E_local = 3 if W == 1 else 2
    prob = make_problem(W, 150 if W == 1 else 70, H, I, E_local, 2, shared=W == 1, seed=seed)
    if W == 1:  # expert 1 gets no rows
        x, idx, *rest = prob
        prob = (x, torch.where(idx == 1, 2, idx), *rest)
    got = _run(prob, CFG_BWD, W=W)
    want = _reference_fp8_backward(prob)
    errs = _compare(got, want, 1e-2)
    # the same operations: equal up to fp32 summation order; with a shared expert dx is the sum
    # of two bf16 tensors in the layer (compared above), the rest still equal
    # (fixed seeds: an fp32 sum in another order can land a dg | du value on the other side of a
    # bf16 rounding, moving its row's dx and dW_gate or dW_up by a bf16 ulp, ~5e-5; these seeds have none)
    exact_names = [n for n in errs if not (n == "dx" and W == 1)]
    assert all(errs[n] < 1e-5 for n in exact_names), errs
    exact = _reference(prob, fp8=False)
    e_exact = {NAMES[i]: rel_err(g, w) for i, (g, w) in enumerate(zip(got[:6], exact[:6]))}
    assert all(v < 1e-1 for v in e_exact.values()), e_exact
    assert min(e_exact.values()) > 1e-2  # FP8 throughout: clearly not the fp32 layer


@cpu_only
def test_fp8_backward_with_cached_transposes_is_bitwise_the_uncached():
    """cache_fp8_transposes (the default) holds W_down^T and [W_gate^T | W_up^T], made with the
    forward's copies; False makes them in each backward. The same values and gradients, bit for bit,
    at a new weight version and at a cached one; the cache holds two more entries (none stale)."""
    import dataclasses

    prob = make_problem(1, 64, 272, 144, 3, 2, seed=41)
    uncached = dataclasses.replace(CFG_BWD, cache_fp8_transposes=False)
    fp8_layer.clear_weight_cache()
    want = _run(prob, uncached)
    assert len(fp8_layer._weight_cache) == 0  # the leaves (and their copies) are gone
    x, idx, wts, ws, _, dy = prob
    lv = [t.clone().requires_grad_(True) for t in (x, wts, *ws)]
    for step in range(3):  # a new version, then cached, then a new version (an in-place step)
        if step == 2:
            with torch.no_grad():
                lv[4].mul_(0.5)
            want = _run((x, idx, wts, [lv[2].detach(), lv[3].detach(), lv[4].detach()], None, dy), uncached)
        for t in lv:
            t.grad = None
        got = _grads(moe(lv[0], idx, lv[1], *lv[2:], config=CFG_BWD), lv, dy)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), step
        assert len(fp8_layer._weight_cache) == 5
    fp8_layer.clear_weight_cache()


@cpu_only
def test_fp8_config_checks():
    with pytest.raises(tabby.MoEInputError, match="precision"):
        MoEConfig(precision="fp16")
    for p in ("fp8", "fp8-forward"):
        with pytest.raises(tabby.MoEInputError, match="megakernel=True"):
            MoEConfig(precision=p, megakernel=True)
        # the precision alone picks the path that has it (the plan's choice: tests/test_plan.py)
        assert MoEConfig(precision=p).megakernel is None
    assert MoEConfig().megakernel is None and MoEConfig(precision="bf16", megakernel=False).megakernel is False
    with pytest.raises(tabby.MoEInputError, match="megakernel"):
        MoEConfig(megakernel=1)
    for H, I in ((88, 128), (128, 200)):  # not multiples of 16
        x, idx, wts, ws, _, _ = make_problem(1, 8, H, I, 2, 1, seed=1)
        with pytest.raises(tabby.MoEInputError, match="multiples of 16"):
            moe(x, idx, wts, *ws, config=CFG)
    prob = make_problem(1, 8, 128, 128, 2, 1, seed=1)
    x, idx, wts, ws, _, _ = prob
    with pytest.raises(tabby.MoEInputError, match="tile_m"):
        moe(x, idx, wts, *ws, config=MoEConfig(megakernel=False, precision="fp8", tuning=Tuning(**SMALL)))
