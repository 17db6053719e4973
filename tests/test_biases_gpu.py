"""The routed experts' biases on a GPU, one rank, at the bench shapes' widths (the plan's path for
them: separate launches, bf16.py's kernels): values and every gradient against the fp32 reference,
SwiGLU and gpt-oss's activation; 20-run bitwise repeat. The CPU cases and helpers: test_biases.py."""
import pytest
import torch
from test_biases import NAMES, _compare, _problem

import tabby
from tabby.activation import Activation
from tabby.functional.config import MoEConfig

CUDA = torch.cuda.is_available()


def _on_gpu(fn, prob, **kw):
    """fn (tabby.moe or the reference) on the GPU: y and every gradient, on the CPU."""
    x, idx, wts, ws, bs, dy = prob
    lv = [t.cuda().clone().requires_grad_(True) for t in (x, wts, *ws, *bs)]
    y = fn(lv[0], idx.cuda(), lv[1], *lv[2:5], biases=tuple(lv[5:]), **kw)
    y.backward(dy.cuda())
    return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", [None, Activation("gpt-oss", limit=7.0, alpha=1.702)], ids=["swiglu", "gpt-oss"])
@pytest.mark.parametrize("H,I,E,k,T", [(2880, 2880, 8, 4, 512), (2048, 768, 16, 8, 1024)])
def test_biases_gpu(act, H, I, E, k, T):
    prob = _problem(1, T, H, I, E, k, seed=H + T)
    cfg = MoEConfig() if act is None else MoEConfig(activation=act)
    got = _on_gpu(tabby.moe, prob, config=cfg)
    errs = _compare(got, _on_gpu(tabby.moe_reference, prob, activation=act))
    print(f"GPU biases {act} H={H} I={I} E={E} k={k} T={T}: {errs}")
    for _ in range(19):
        again = _on_gpu(tabby.moe, prob, config=cfg)
        assert all(torch.equal(a, b) for a, b in zip(got, again)), [n for n, a, b in zip(NAMES, got, again)
                                                                    if not torch.equal(a, b)]
