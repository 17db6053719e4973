"""``precision="fp8"`` on the bf16 GPU tests' cases (harness.GPU_CASES), one rank on a GPU. The
helpers are in test_fp8_layer.py."""
import pytest
import test_fp8_layer as helpers
from harness import GPU_CASES, make_problem, rel_err


@pytest.mark.skipif(not helpers.CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp8_layer_gpu_cases(case):
    """precision="fp8" on the bf16 GPU tests' cases (harness.GPU_CASES: the bench shapes with few
    experts, the odd ones): y and every gradient against the FP8 recipe (plain PyTorch) and
    against the fp32 layer. One rank: "one_rank" becomes rows to odd-numbered experts only (the
    even ones empty)."""
    T, H, I, E, k, shared, route = GPU_CASES[case]
    prob = make_problem(1, T, H, I, E, k, shared=shared, seed=T + H, route="random" if route == "one_rank" else route)
    if route == "one_rank":
        prob = (prob[0], prob[1] % (E // 2) * 2 + 1, *prob[2:])
    got = helpers._run(prob, helpers.GPU_CFG_BWD, device="cuda")
    helpers._compare(got, helpers._reference_fp8_backward(prob, device="cuda"), 2e-2)
    exact = helpers._reference(prob, fp8=False, device="cuda")
    e_exact = {helpers.NAMES[i]: rel_err(g, w) for i, (g, w) in enumerate(zip(got, exact))}
    assert all(v < 1e-1 for v in e_exact.values()), e_exact
