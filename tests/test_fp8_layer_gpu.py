"""The FP8 layer on a GPU, one rank: values and every gradient against the FP8 recipe (plain
PyTorch) and the fp32 layer at realistic sizes and partial tiles, both backward modes, 20-run
bitwise determinism; no host sync and CUDA-graph replay. The helpers and the CPU cases are in
test_fp8_layer.py; the bf16 GPU tests' cases in FP8 in test_fp8_cases_gpu.py (a file each, so that
their kernels compile in parallel processes)."""
import dataclasses

import pytest
import torch
from harness import make_problem, rel_err
from test_fp8_layer import (
    CUDA,
    GPU_CFG,
    GPU_CFG_BWD,
    NAMES,
    _compare,
    _leaves,
    _reference,
    _reference_fp8_backward,
    _run,
)

import tabby
from tabby.functional.moe import moe


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backward", ["fp8", "bf16"])
@pytest.mark.parametrize("H,I,E,k,T", [(2048, 768, 16, 8, 1024), (1024, 512, 8, 2, 333),
                                       # gpt-oss-120b's H = I = 2880 (22.5 blocks of 128), and partial
                                       # tiles of 16 (H) and 80 (I)
                                       (2880, 2880, 8, 4, 512), (1040, 720, 8, 2, 333)])
def test_fp8_layer_gpu(H, I, E, k, T, backward):
    prob = make_problem(1, T, H, I, E, k, seed=H + T)
    cfg = GPU_CFG_BWD if backward == "fp8" else GPU_CFG
    got = _run(prob, cfg, device="cuda")
    want = _reference_fp8_backward(prob, device="cuda") if backward == "fp8" else _reference(prob, device="cuda")
    # the same quantizations; fp32 sums in other orders, Hopper's FP8 MMA accumulation, and E4M3
    # roundings of values that differ in their last bits land on neighbouring E4M3 values
    errs = _compare(got, want[:6], 2e-2)
    exact = _reference(prob, fp8=False, device="cuda")
    e_exact = {NAMES[i]: rel_err(g, w) for i, (g, w) in enumerate(zip(got, exact[:6]))}
    print(f"GPU fp8 layer H={H} I={I} E={E} k={k} T={T} backward={backward}: vs recipe {errs}; vs fp32 {e_exact}")
    assert all(v < 1e-1 for v in e_exact.values()), e_exact
    for _ in range(19):  # bitwise deterministic: 20 runs, every output and gradient the first run's bits
        again = _run(prob, cfg, device="cuda")
        assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_fp8_layer_gpu_no_host_sync_and_graph_replay():
    """precision="fp8" forward + backward: no host sync (also when an updated weight is quantized
    again), and a CUDA graph replayed after an in-place weight update gives what an eager call
    with the updated weights gives, bit for bit (the graph quantizes the weights itself)."""
    x, idx, wts, ws, _, dy = make_problem(1, 512, 1024, 512, 8, 2, seed=3)
    x, idx, wts, dy = (t.cuda() for t in (x, idx, wts, dy))
    params = [w.cuda().requires_grad_(True) for w in ws]
    xs = x.clone().requires_grad_(True)
    # debug off whatever TABBY_DEBUG says: the debug mode reads the error record after each pass,
    # a host sync by design
    cfg = dataclasses.replace(GPU_CFG_BWD, debug=False)

    def step():
        y = moe(xs, idx, wts, *params, config=cfg)
        y.backward(dy)
        return y

    step()
    torch.cuda.synchronize()
    with torch.no_grad():
        params[0].mul_(0.5)  # a new version: quantized again inside the checked call
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as graph capture wants
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    for t in (xs, *params):
        t.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step()
    with torch.no_grad():
        params[2].mul_(2.0)
    g.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = moe(xs.detach(), idx, wts, *(p.detach() for p in params), config=cfg)
    assert torch.equal(y, eager)
    tabby.check_errors()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,I,E,k,T", [(2880, 2880, 8, 4, 512), (1040, 720, 8, 2, 333)])
def test_fp8_backward_reading_the_forward_copies_is_bitwise_the_cached_transposes(H, I, E, k, T):
    """cache_fp8_transposes=False: on an H200 the dgrads read the forward's E4M3 copies transposed
    in the kernel (the plan's ``fp8.dgrad`` "transpose_in_kernel"); every value and gradient is the
    cached transposes' bit for bit (the same wgmma over the same bytes), with a partial K block (H
    2880) and I not a multiple of 128 (the gate/up dgrad's padded halves), and without a host sync;
    so are transposes made per call (``Tuning(fp8_dgrad="transpose_per_call")``)."""
    from tabby.functional import fp8 as fp8_layer

    prob = make_problem(1, T, H, I, E, k, seed=H + 7 * T)
    want = _run(prob, GPU_CFG_BWD, device="cuda")
    fp8_layer.clear_weight_cache()
    uncached = dataclasses.replace(GPU_CFG_BWD, cache_fp8_transposes=False, debug=False)
    per_call = dataclasses.replace(uncached, tuning=dataclasses.replace(uncached.tuning,
                                                                        fp8_dgrad="transpose_per_call"))
    for cfg in (per_call, uncached):
        got = _run(prob, cfg, device="cuda")
        fp8_layer.clear_weight_cache()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), [NAMES[i] for i, (a, b) in
                                                                    enumerate(zip(got, want)) if not torch.equal(a, b)]
    lv, idx, dy = _leaves(prob, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(lv[0], idx, lv[1], *lv[2:5], config=uncached)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    again = [y.detach().float().cpu()] + [t.grad.float().cpu() for t in lv]
    assert all(torch.equal(a, b) for a, b in zip(again, want))
    fp8_layer.clear_weight_cache()
