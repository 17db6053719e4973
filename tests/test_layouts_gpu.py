"""Expert weights read in place on a GPU, one rank, at the widths of gpt-oss-120b and qwen3-30b-a3b
(the plan's path for them: separate launches, the warp-specialized GEMMs on sm_90): transposed
("kn", "kn-paired") and Tabby's layout as halves of one fused gate_up [E, 2I, H] (transformers'
plain families: each expert's gate rows 2I rows after the last's); values and the gradients of the
fused parameters against the fp32 reference, with gpt-oss's activation and biases; 20-run bitwise
repeat; no host sync; FP8 on them bitwise as on Tabby's layout. Ungated experts (relu2) on the same
path. The CPU cases and helpers: test_layouts.py, test_ungated.py."""
import pytest
import torch
from harness import rel_err as rel
from test_layouts import GPT_OSS, NK_FUSED, compare, fused, problem, views

import tabby
from tabby.functional.config import MoEConfig

CUDA = torch.cuda.is_available()


def _on_gpu(prob, layout, fn, to_cpu=True, **kw):
    x, idx, wts, ws, bs, dy = prob
    ref = fn is tabby.moe_reference
    lv = [(t.cuda().float() if ref else t.cuda()).requires_grad_(True) for t in (x, wts, *fused(ws, bs, layout))]
    w3, b3 = views(*lv[2:], layout)
    y = fn(lv[0], idx.cuda(), lv[1], *w3, biases=b3, **kw)
    y.backward(dy.cuda().to(y.dtype))
    out = [y.detach()] + [t.grad for t in lv]
    return [t.float().cpu() for t in out] if to_cpu else out


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["kn", "kn-paired", NK_FUSED])
@pytest.mark.parametrize("H,I,E,k,T", [(2880, 2880, 8, 4, 512), (2048, 768, 16, 8, 1024), (2880, 2888, 8, 4, 512)])
def test_layouts_gpu(layout, H, I, E, k, T):
    prob = problem(1, T, H, I, E, k, seed=H + T)
    cfg = MoEConfig(activation=GPT_OSS, debug=False)
    got = _on_gpu(prob, layout, tabby.moe, config=cfg)
    errs = compare(got, _on_gpu(prob, layout, tabby.moe_reference, activation=GPT_OSS))
    print(f"GPU layout {layout} H={H} I={I} E={E} k={k} T={T}: {errs}")
    for _ in range(19):
        again = _on_gpu(prob, layout, tabby.moe, config=cfg)
        assert all(torch.equal(a, b) for a, b in zip(got, again))
    x, idx, wts, ws, bs, dy = prob
    args = [t.cuda() for t in (x, idx, wts, *fused(ws, bs, layout), dy)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # (the inputs on the device already: the call and its backward read nothing back)
        lv = [t.requires_grad_(True) if t.is_floating_point() else t for t in args[:-1]]
        w3, b3 = views(*lv[3:], layout)
        tabby.moe(lv[0], lv[1], lv[2], *w3, biases=b3, config=cfg).backward(args[-1])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["kn", "kn-paired"])
def test_fp8_layouts_gpu_equal_tabby_layout(layout):
    """FP8 on transposed weights: the same bits as the same experts in Tabby's layout (the weights'
    gradients laid out alike), gpt-oss-120b's widths."""
    prob = problem(1, 512, 2880, 2880, 8, 4, seed=7)
    x, idx, wts, ws, bs, dy = prob
    cfg = MoEConfig(activation=GPT_OSS, precision="fp8")
    lv = [t.cuda().requires_grad_(True) for t in (x, wts, *fused(ws, bs, layout)[:2])]
    w3, _ = views(*lv[2:], *fused(ws, bs, layout)[2:], layout)
    tabby.moe(lv[0], idx.cuda(), lv[1], *w3, config=cfg).backward(dy.cuda())
    ref = [t.cuda().requires_grad_(True) for t in (x, wts, *ws)]
    y = tabby.moe(ref[0], idx.cuda(), ref[1], *ref[2:], config=cfg)
    y.backward(dy.cuda())
    d_gate_up, d_down = fused(tuple(t.grad for t in ref[2:]), tuple(b.cuda() for b in bs), layout)[:2]
    got = [t.grad for t in lv]
    assert all(torch.equal(a, b) for a, b in zip(got, (ref[0].grad, ref[1].grad, d_gate_up, d_down)))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,I,E,k,T", [(2688, 1856, 16, 6, 1024), (2048, 768, 16, 8, 1024)])
def test_ungated_gpu(H, I, E, k, T):
    """relu2 experts (Nemotron-H's; 2688 / 1856: Nemotron-3-Nano's widths) against the fp32 reference,
    20-run bitwise repeat."""
    from test_ungated import RELU2, problem as ungated_problem

    x, idx, wts, w_up, w_down, dy = ungated_problem(1, T, H, I, E, k, seed=H)
    cfg = MoEConfig(activation=RELU2)

    def run(fn, **kw):
        ref = fn is tabby.moe_reference
        lv = [(t.cuda().float() if ref else t.cuda()).requires_grad_(True) for t in (x, wts, w_up, w_down)]
        y = fn(lv[0], idx.cuda(), lv[1], None, lv[2], lv[3], **kw)
        y.backward(dy.cuda().to(y.dtype))
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]

    got = run(tabby.moe, config=cfg)
    want = run(tabby.moe_reference, activation=RELU2)
    errs = {n: rel(a, b) for n, a, b in zip(["y", "dx", "dw", "dw_up", "dw_down"], got, want)}
    print(f"GPU ungated H={H} I={I} E={E} k={k} T={T}: {errs}")
    assert all(e < 2e-2 for e in errs.values()), errs
    for _ in range(19):
        assert all(torch.equal(a, b) for a, b in zip(got, run(tabby.moe, config=cfg)))
