"""The backward megakernel on the GPU: bitwise the backward of separate launches and within
tolerance of the reference on bench shapes (true H, I, k; few experts) and the odd cases; 20-run
bitwise determinism, no host sync and CUDA-graph replay of forward + backward. Skips without a GPU.
"""
import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import rel_err  # noqa: E402
from test_moe_gpu import NAMES, TOL, _fwd_bwd, _graph_check, _inputs, run_on_gpus  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CASES = ["kimi-k2", "gpt-oss-120b", "odd-T", "one-expert", "one-rank-empty-experts", "qwen3-30b-a3b"]


def _moe(mega_backward: bool, **kw):
    import tabby
    from tabby.functional.config import MoEConfig, Tuning

    return functools.partial(tabby.moe, config=MoEConfig(tuning=Tuning(mega_backward=mega_backward), **kw))


def check_backward_megakernel(rank, W, cases, reps=20):
    import tabby

    device = torch.device("cuda", torch.cuda.current_device())
    group = None
    if W > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    out = {}
    for case in cases:
        inp = _inputs(case, rank, W, device)
        sep = _fwd_bwd(_moe(False), *inp, group)
        got = _fwd_bwd(_moe(True), *inp, group)
        want = _fwd_bwd(tabby.moe_reference, *inp, group)
        tabby.check_errors()
        out[case] = {"bitwise_separate": all(torch.equal(a, b) for a, b in zip(got, sep)),
                     **{f"err_{n}": rel_err(a, b) for n, a, b in zip(NAMES, got, want)}}
    inp = _inputs(cases[-1], rank, W, device)
    first = _fwd_bwd(_moe(True), *inp, group)
    same = all(all(torch.equal(a, b) for a, b in zip(first, _fwd_bwd(_moe(True), *inp, group)))
               for _ in range(reps - 1))
    out["determinism"] = same
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(_moe(True, debug=False), *inp, group)
        out["no_host_sync"] = True
    except RuntimeError as e:
        out["no_host_sync"] = f"host sync: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out["graph"] = _graph_check(inp, group, device, fn=_moe(True))["matches_eager"]
    tabby.check_errors()
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_backward_megakernel_gpu(ep):
    res = run_on_gpus(check_backward_megakernel, CASES, ep)
    print(res)
    for case in CASES:
        r = res[case]
        assert r["bitwise_separate"], f"{case}: differs from the separate launches' backward"
        bad = {k: v for k, v in r.items() if k.startswith("err_") and not v < TOL}
        assert not bad, f"{case}: errors over {TOL}: {bad}"
    assert res["determinism"], "outputs or gradients differ between repeated runs"
    assert res["no_host_sync"] is True, res["no_host_sync"]
    assert res["graph"], "CUDA graph replay of forward + backward differs from eager"
