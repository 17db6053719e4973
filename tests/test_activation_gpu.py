"""The experts' activations on a GPU, one rank, at the bench shapes' widths: every kind on the
plan's default path (EP1: the separate launches, sm_90's warp-specialized gate/up), on the
megakernel and in FP8 (the warp-specialized FP8 kernels), values and every gradient against the
reference with the same activation (bf16: fp32, differentiated where the layer keeps g and u;
FP8: the same quantizations); 20-run bitwise repeat. The CPU cases and helpers: test_activation.py."""
import pytest
import torch
from harness import make_problem, rel_err
from test_activation import ACTS, CUDA, _compare, _reference, _run

import tabby
from tabby import reference_fp8
from tabby.activation import KINDS, Activation
from tabby.functional.config import MoEConfig

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# g, u ~ N(0, 1) here too (make_problem): gpt-oss's and the clamped SwiGLU's limits of 7 and 10
# would clip nothing; the real limits are exercised by scale in test_the_real_limits_clip
SHAPES = [(2048, 768, 16, 8, 1024), (2880, 2880, 8, 4, 512), (7168, 2048, 8, 8, 256)]  # (H, I, E, k, T)


@gpu
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "swiglu"])
@pytest.mark.parametrize("path,H,I,E,k,T", [("default", *s) for s in SHAPES] + [("megakernel", *SHAPES[0])])
def test_activation_layer_gpu(kind, path, H, I, E, k, T, monkeypatch):
    act = ACTS[kind]
    prob = make_problem(1, T, H, I, E, k, seed=H + T + len(kind))
    cfg = MoEConfig(activation=act, megakernel=True if path == "megakernel" else None)
    got = _run(prob, cfg, 1, device="cuda")
    errs = _compare(got, _reference(prob, act, monkeypatch=monkeypatch, device="cuda"), 2e-2)
    print(f"GPU activation {act} {path} H={H} I={I} E={E} k={k} T={T}: {errs}")
    assert rel_err(got[0], _reference(prob, Activation(), device="cuda")[0]) > 5e-2  # it took effect
    for _ in range(19):
        again = _run(prob, cfg, 1, device="cuda")
        assert all(torch.equal(a, b) for a, b in zip(got, again))


@gpu
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "swiglu"])
@pytest.mark.parametrize("H,I,E,k,T", [(2048, 768, 16, 8, 1024), (1040, 720, 8, 2, 333)])
def test_activation_fp8_gpu(kind, H, I, E, k, T):
    act = ACTS[kind]
    prob = make_problem(1, T, H, I, E, k, seed=H + T + len(kind))
    x, idx, wts, ws, _, dy = prob
    got = _run(prob, MoEConfig(precision="fp8", activation=act), 1, device="cuda")
    dev = [t.cuda() for t in (x, idx, wts, *ws, dy)]
    y = tabby.moe_reference_fp8(*dev[:6], activation=act).float()
    back = reference_fp8.moe_backward_reference_fp8(*dev[:6], dev[6], activation=act)
    # (the same quantizations, fp32 sums in other orders: a g or u a bf16 ulp apart lands on the
    # other side of a clamp's bound now and then, a jump in its gradient: a few per cent at these sizes)
    errs = _compare(got, [y.cpu()] + [t.float().cpu() for t in back], 5e-2)
    print(f"GPU fp8 activation {act} H={H} I={I}: {errs}")


@gpu
def test_the_real_limits_clip():
    """gpt-oss (limit 7, alpha 1.702) and the clamped SwiGLU (limit 10) with inputs large enough for
    the clamps to clip, on the default path: against the reference."""
    for act in (Activation("gpt-oss", limit=7.0, alpha=1.702), Activation("swiglu-clamp", limit=10.0)):
        x, idx, wts, ws, sh, dy = make_problem(1, 512, 2048, 768, 8, 4, seed=1)
        prob = (x * 12, idx, wts, ws, sh, dy)
        got = _run(prob, MoEConfig(activation=act), 1, device="cuda")
        mp = pytest.MonkeyPatch()
        _compare(got, _reference(prob, act, monkeypatch=mp, device="cuda"), 2e-2)
