"""The warp-specialized FP8 rows GEMM (tabby/ops/gemm_fp8_ws.py) on a GPU: bitwise the Triton
rows GEMM (the same wgmma and promotion over the same operands), used tiles only, at odd K,
empty experts, unused tiles, every ring depth and a grid smaller than the tiles (persistent).
Its sm_90a code (no serialized wgmma, no spills) is checked on the CPU in
test_fp8_gemm_ws_compile.py."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from tabby.ops import gemm_fp8  # noqa: E402
from tabby.ops.fp8 import quantize_blocks, quantize_rows  # noqa: E402

from test_fp8_gemm import Sched, rand, rel  # noqa: E402


def _case(counts, K, N, seed):
    sch = Sched(counts, 128, seed=seed)
    a = rand(sch.R, K, seed=seed + 1).cuda()
    b = rand(len(counts), N, K, seed=seed + 2, scale=K ** -0.5).cuda()
    aq, as_ = quantize_rows(a)
    bq, bs = quantize_blocks(b)
    return sch, a, b, aq, as_, bq, bs


@pytest.mark.parametrize("counts,K,N", [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1040, 384),
                                        ([512] * 6, 2048, 1024), ([40, 0, 0, 900], 7168, 128)])
@pytest.mark.parametrize("stages,grid", [(4, None), (6, None), (3, 5)])
def test_ws_matches_triton_bitwise(counts, K, N, stages, grid):
    from tabby.ops.gemm_fp8_ws import rows_gemm_fp8_ws
    sch, a, b, aq, as_, bq, bs = _case(counts, K, N, seed=K + N)
    want = gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles)
    sentinel = torch.full((sch.R, N), -7.0, dtype=torch.bfloat16, device="cuda")
    got = rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, out=sentinel.clone(),
                           stages=stages, grid=grid)
    torch.cuda.synchronize()
    for e, st, c in sch.segments:
        if c:
            seg = slice(st, st + c)
            assert torch.equal(got[seg], want[seg]), (e, (got[seg].float() - want[seg].float()).abs().max())
            # and the recipe's value (a sanity bound: the Triton kernel is itself tested against it)
            assert rel(got[seg], a[seg].float() @ b[e].float().T) < 5e-2
    assert (got[sch.used:] == -7.0).all(), "an unused tile was written"


def test_ws_deterministic():
    from tabby.ops.gemm_fp8_ws import rows_gemm_fp8_ws
    sch, a, b, aq, as_, bq, bs = _case([1000, 3, 257, 0, 640], 2048, 512, seed=9)
    first = rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles)
    for _ in range(20):
        assert torch.equal(rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles), first)


def test_ws_rejects_bad_shapes():
    from tabby.ops.gemm_fp8_ws import rows_gemm_fp8_ws
    sch, a, b, aq, as_, bq, bs = _case([128], 256, 256, seed=3)
    with pytest.raises(ValueError, match="N"):
        rows_gemm_fp8_ws(aq, as_, bq[:, :200].contiguous(), bs, sch.tile_expert, sch.num_tiles)
