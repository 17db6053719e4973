"""The warp-specialized FP8 rows GEMM (tabby/ops/gemm/fp8_ws.py) on a GPU, bitwise against the
Triton kernels of gemm_fp8.py (the same wgmma and promotion over the same operands; the entry
points run the core their ``Fp8Gemm`` names, the plan's on the layer) for each epilogue: the
stored rows, the rows pushed to their origins, the down dgrad's SwiGLU backward (its row sums dw
within 1e-6: another order). Odd K (a partial
last block), N not a multiple of 128, empty experts, unused tiles, schedule tiles of 256 rows,
several ring depths and a grid smaller than the tiles (persistent); 20 repeats bitwise. The
warp-specialized gate/up and weight gradient likewise against the Triton kernels, and gemm_fp8's
entry points at the plan's sm_90 kernels (``heuristics.fp8_*(ws=True)``) running them.
Its sm_90a code (no serialized wgmma, no spills): test_fp8_gemm_ws_compile.py."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from tabby.functional import heuristics as hx  # noqa: E402
from tabby.ops.gemm import fp8 as gemm_fp8, fp8_ws as gemm_fp8_ws  # noqa: E402
from tabby.ops.gemm.fp8 import CORE_TRITON, Fp8Gemm  # noqa: E402
from tabby.ops.quantize import quantize_blocks, quantize_cols, quantize_rows  # noqa: E402
from tabby.ops.gemm.bf16 import GemmConfig  # noqa: E402

from test_fp8_gemm import Sched, rand, rel  # noqa: E402

CASES = [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1040, 384), ([512] * 6, 2048, 1024),
         ([40, 0, 0, 900], 7168, 128), ([77, 500, 3], 2880, 320)]


def _triton(BM=128):
    """The Triton rows kernel (3 stages, not the plan's 4: stages do not change sums)."""
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=BM, BN=128, BK=128, num_warps=8, num_stages=3, GROUP_M=8))


def _triton_gate_up():
    """The Triton gate/up's TMA loop (64-row kernel tiles, 4 stages, not the plan's 5)."""
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=64, BN=128, BK=128, num_warps=8, num_stages=4, GROUP_M=16), tma=True)


def _triton_wgrad():
    """The Triton weight gradient (4 stages, not the plan's 3)."""
    return Fp8Gemm(CORE_TRITON, GemmConfig(BM=128, BN=64, BK=128, num_warps=4, num_stages=4, GROUP_M=8))


def _case(counts, K, N, seed, BM=128):
    sch = Sched(counts, BM, seed=seed)
    a = rand(sch.R, K, seed=seed + 1).cuda()
    b = rand(len(counts), N, K, seed=seed + 2, scale=K ** -0.5).cuda()
    aq, as_ = quantize_rows(a)
    bq, bs = quantize_blocks(b)
    return sch, a, b, aq, as_, bq, bs


@pytest.mark.parametrize("counts,K,N", CASES)
@pytest.mark.parametrize("stages,grid", [(3, None), (4, None), (3, 5)])
def test_ws_store_matches_triton_bitwise(counts, K, N, stages, grid):
    """The stored rows (128 x 256 tiles; N not a multiple of 256 leaves a half past N) bitwise the
    Triton kernel's."""
    sch, a, b, aq, as_, bq, bs = _case(counts, K, N, seed=K + N)
    want = gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, kernel=_triton(), tile_m=128)
    got = torch.full((sch.R, N), -7.0, dtype=torch.bfloat16, device="cuda")
    gemm_fp8_ws.rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, out=got, tile_n=256, stages=stages,
                                 grid=grid)
    for e, st, c in sch.segments:
        if c:
            seg = slice(st, st + c)
            assert torch.equal(got[seg], want[seg]), (e, (got[seg].float() - want[seg].float()).abs().max())
            # the recipe's value, loosely (the Triton kernel is tested against it closely)
            assert rel(got[seg], a[seg].float() @ b[e].float().T) < 5e-2
    assert (got[sch.used:] == -7.0).all(), "an unused tile was written"


def test_ws_schedule_tiles_of_256_rows():
    sch, a, b, aq, as_, bq, bs = _case([300, 0, 513, 40], 1024, 256, seed=4, BM=256)
    want = gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, kernel=_triton(256), tile_m=256)
    got = gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles,
                                 kernel=hx.fp8_rows(256, 1024, 256, ws=True, programs=None), tile_m=256)
    assert gemm_fp8_ws.fits(aq, bq, 256)
    assert torch.equal(got[:sch.used], want[:sch.used])


def _push(sch, aq, as_, bq, bs, N, kernel, W=3):
    """The rows pushed to W origins of TK rows each, N + 8 columns (the last 8 must stay -3)."""
    TK = -(-sch.TK // W)
    dst = [torch.full((TK, N + 8), -3.0, dtype=torch.bfloat16, device="cuda") for _ in range(W)]
    ptrs = torch.tensor([d.data_ptr() for d in dst], dtype=torch.int64, device="cuda")
    gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, row_src=sch.row_src, dst_ptrs=ptrs,
                           TK=TK, dst_stride=N + 8, kernel=kernel, tile_m=128)
    return torch.stack(dst)


@pytest.mark.parametrize("counts,K,N", CASES[1:4])
def test_ws_push_matches_triton_bitwise(counts, K, N):
    sch, a, b, aq, as_, bq, bs = _case(counts, K, N, seed=K + 2 * N)
    got = _push(sch, aq, as_, bq, bs, N, hx.fp8_rows(N, K, 128, ws=True, programs=None))  # warp-specialized
    want = _push(sch, aq, as_, bq, bs, N, _triton())
    assert torch.equal(got, want)
    assert (got[..., N:] == -3.0).all(), "a push wrote past N"
    assert (got != -3.0).any(dim=-1).sum() == sum(counts), "not every routed row arrived once"


@pytest.mark.parametrize("counts,H,I", [([300, 0, 128, 5], 1024, 256), ([77, 500, 3], 2880, 320),
                                        ([129, 1, 700], 7168, 2048)])
def test_ws_down_dgrad_swiglu_matches_triton_bitwise(counts, H, I):
    sch, _, _, dq, ds, wq, wsc = _case(counts, H, I, seed=H + I)
    gu = rand(sch.R, 2 * I, seed=5).cuda()
    w = torch.rand(sch.R, generator=torch.Generator().manual_seed(6)).cuda()
    got = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, wq, wsc, gu, w, sch.tile_expert, sch.num_tiles,
                                         kernel=hx.fp8_down_dgrad(128, ws=True, programs=None), tile_m=128)
    want = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, wq, wsc, gu, w, sch.tile_expert, sch.num_tiles, kernel=_triton(),
                                          tile_m=128)
    used = slice(0, sch.used)
    for name, x, y in zip(("dgu", "hw"), got[:2], want[:2]):
        assert torch.equal(x[used], y[used]), (name, (x[used].float() - y[used].float()).abs().max())
    # dw's row sums over a tile's 128 columns: the same products, added in another order (the
    # reduction follows each kernel's register layout)
    assert rel(got[2][used], want[2][used]) < 1e-6


@pytest.mark.parametrize("counts,H,I", [([300, 0, 128, 5], 1024, 256), ([77, 500, 3], 2880, 320),
                                        ([129, 1, 700], 7168, 2048)])
@pytest.mark.parametrize("act", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("prefetch,grid", [(False, None), (True, None), (True, 3)])
def test_ws_down_dgrad_epilogue_partition(counts, H, I, act, prefetch, grid):
    """The down dgrad with the activation's backward on an epilogue partition (``launch_dgrad``)
    against the consumers' epilogue (the entry point's ws kernel): dgu and hw bitwise for SwiGLU
    (the same per-element math on the same fp32 sums; gpt-oss's within a rounding), dw summed in
    another order; grids of every SM and of
    three programs (the handoff's phases over many tiles); repeats bitwise; unused rows untouched."""
    from tabby.activation import Activation

    a = Activation("gpt-oss", limit=7.0, alpha=1.702) if act == "gpt-oss" else Activation()
    sch, _, _, dq, ds, wq, wsc = _case(counts, H, I, seed=H + I)
    gu = rand(sch.R, 2 * I, seed=5).cuda()
    w = torch.rand(sch.R, generator=torch.Generator().manual_seed(6)).cuda()
    want = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, wq, wsc, gu, w, sch.tile_expert, sch.num_tiles,
                                          kernel=hx.fp8_down_dgrad(128, ws=True, programs=None), tile_m=128, act=a)
    used = slice(0, sch.used)
    runs = []
    for _ in range(3):
        outs = tuple(torch.full_like(t, float("nan")) for t in want)
        *_, epi = gemm_fp8._swiglu_bwd_outputs(gu, w, want[2].shape[1], outs, a)
        gemm_fp8_ws.launch_dgrad(dq, ds, wq, wsc, sch.tile_expert, sch.num_tiles, 128, epi, I, stages=4, act=a,
                                 prefetch=prefetch, grid=grid)
        runs.append(outs)
    got = runs[0]
    for name, x, y in zip(("dgu", "hw"), got[:2], want[:2]):
        if act == "swiglu":
            assert torch.equal(x[used], y[used]), (name, (x[used].float() - y[used].float()).abs().max())
        else:  # (its limit and alpha constants there, fp32 arguments on the consumers: within a rounding)
            assert rel(x[used], y[used]) < 1e-2, name
    assert rel(got[2][used], want[2][used]) < 1e-5
    assert all(t[sch.used:].isnan().all() for t in got), "an unused tile was written"
    for r in runs[1:]:
        assert all(torch.equal(x[used], y[used]) for x, y in zip(r, got))


def test_ws_deterministic():
    sch, a, b, aq, as_, bq, bs = _case([1000, 3, 257, 0, 640], 2048, 512, seed=9)
    first = gemm_fp8_ws.rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, tile_n=256,
                                         stages=3)[:sch.used]
    for _ in range(20):
        again = gemm_fp8_ws.rows_gemm_fp8_ws(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, tile_n=256, stages=3)
        assert torch.equal(again[:sch.used], first)


def test_ws_rejects_what_it_cannot_run():
    sch, a, b, aq, as_, bq, bs = _case([128], 256, 256, seed=3)
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8_ws.rows_gemm_fp8_ws(aq[:, :200], as_, bq[:, :, :200], bs, sch.tile_expert, sch.num_tiles,
                                     tile_n=256, stages=3)
    with pytest.raises(ValueError, match="warp-specialized"):  # the plan named it; the operands do not suit it
        gemm_fp8.rows_gemm_fp8(aq[:, :200], as_, bq[:, :, :200], bs, sch.tile_expert, sch.num_tiles,
                               kernel=hx.fp8_rows(256, 200, 128, ws=True, programs=None), tile_m=128)


GATE_UP_CASES = [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1040, 720), ([77, 500, 3], 2880, 2880),
                 ([512] * 4, 7168, 2048)]


def _gate_up_case(counts, H, I):
    """(schedule, operands, the Triton kernel's (hq, h_scale, g | u)) of one gate/up case."""
    sch = Sched(counts, 128, seed=H + I)
    xq, xs = quantize_rows(rand(sch.R, H, seed=11).cuda())
    (gq, gs), (uq, us) = (quantize_blocks(rand(len(counts), I, H, seed=s, scale=H ** -0.5).cuda()) for s in (12, 13))
    ops = (xq, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles)
    return sch, ops, gemm_fp8.gate_up_swiglu_fp8(*ops, kernel=_triton_gate_up(), tile_m=128)


def _assert_bitwise(got, want, used, what=""):
    for name, a, b in zip(("hq", "h_scale", "gu"), got, want):
        a, b = a[used], b[used]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), (name, what, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("counts,H,I", GATE_UP_CASES)
@pytest.mark.parametrize("stages,grid", [(3, None), (4, 7)])
def test_ws_gate_up_matches_triton_bitwise(counts, H, I, stages, grid):
    """hq, h_scale and g | u bitwise the Triton kernel's (its TMA loop at other tiles than the
    defaults), and without g | u the same hq and h_scale."""
    sch, ops, want = _gate_up_case(counts, H, I)
    assert gemm_fp8_ws.fits_gate_up(ops[0], ops[2], ops[4], 128)
    used = slice(0, sch.used)
    _assert_bitwise(gemm_fp8_ws.gate_up_swiglu_fp8_ws(*ops, stages=stages, grid=grid), want, used)
    hq, hs, gu = gemm_fp8_ws.gate_up_swiglu_fp8_ws(*ops, save_gu=False, stages=3)
    assert gu is None
    _assert_bitwise((hq, hs), want[:2], used, "without g | u")
    # the entry point at the plan's sm_90 kernel: the warp-specialized one, into given outputs
    outs = (torch.full_like(want[0].view(torch.uint8), 0x7F).view(torch.float8_e4m3fn),
            torch.full_like(want[1], -1.0), torch.full_like(want[2], -1.0))
    dflt = gemm_fp8.gate_up_swiglu_fp8(*ops, hq=outs[0], h_scale=outs[1], gu=outs[2], tile_m=128,
                                       kernel=hx.fp8_gate_up(H, 128, ws=True, programs=None))
    assert all(d is o for d, o in zip(dflt, outs))
    _assert_bitwise(dflt, want, used, "the plan's entry point")


def test_ws_gate_up_deterministic_and_without_gu():
    sch = Sched([1000, 3, 257, 0, 640], 128, seed=21)
    xq, xs = quantize_rows(rand(sch.R, 2048, seed=22).cuda())
    (gq, gs), (uq, us) = (quantize_blocks(rand(5, 768, 2048, seed=s, scale=2048 ** -0.5).cuda()) for s in (23, 24))
    first = gemm_fp8_ws.gate_up_swiglu_fp8_ws(xq, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles, stages=3)
    for _ in range(20):
        again = gemm_fp8_ws.gate_up_swiglu_fp8_ws(xq, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles, stages=3)
        for a, b in zip(again, first):
            assert torch.equal(a[:sch.used].view(torch.uint8), b[:sch.used].view(torch.uint8))
    hq, hs, gu = gemm_fp8_ws.gate_up_swiglu_fp8_ws(xq, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles,
                                                   save_gu=False, stages=3)
    assert gu is None
    assert torch.equal(hq[:sch.used].view(torch.uint8), first[0][:sch.used].view(torch.uint8))
    assert torch.equal(hs[:sch.used], first[1][:sch.used])


@pytest.mark.parametrize("M,N", [(256, 192), (7168, 2048), (2880, 2880), (320, 200), (200, 136)])
@pytest.mark.parametrize("grid", [None, 3])
def test_ws_wgrad_matches_triton_bitwise(M, N, grid):
    """The padded weight gradient (the layer's segments: at multiples of 128, padding rows zeros;
    empty experts first, between and last, one of one row, one of exactly 256, one of 11 blocks:
    more than a ring holds) bitwise the Triton kernel's at the layer's tiles, bf16 (its TMA stores
    clip the last tiles at M and N, 200 and 136 inside a 64-row half and a 64-column box, and write
    no row of the next expert); an fp32 result is refused by the warp-specialized kernel (its TMA
    stores are 16-bit) and computed by the Triton one."""
    sch = Sched([0, 37, 0, 256, 5, 1, 1400, 300, 0], 128, seed=M + N)
    a, b = rand(sch.R, M, seed=31), rand(sch.R, N, seed=32)
    a[sch.row_src_cpu < 0] = float("nan")  # padding rows hold anything before quantize_cols
    aq, as_ = quantize_cols(a.cuda(), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=128)
    bq, bs = quantize_cols(b.cuda(), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=128)
    start = torch.tensor([st for _, st, _ in sch.segments], dtype=torch.int32, device="cuda")
    count = torch.tensor([c for _, _, c in sch.segments], dtype=torch.int32, device="cuda")
    assert gemm_fp8_ws.fits_wgrad(aq, bq) and not gemm_fp8_ws.fits_wgrad(aq, bq, torch.float32)
    want = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.bfloat16, padded=True,
                                     kernel=_triton_wgrad())
    got = gemm_fp8_ws.expert_wgrad_fp8_ws(aq, as_, bq, bs, start, count, stages=3, grid=grid)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got.float() - want.float()).abs().max()
    planned = hx.fp8_wgrad(ws=True, programs=None)
    dflt = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.bfloat16, padded=True,
                                     kernel=planned)
    assert torch.equal(dflt.view(torch.int16), want.view(torch.int16)), "the plan's entry point"
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.float32, padded=True, kernel=planned)
    f32 = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.float32, padded=True,
                                    kernel=hx.fp8_wgrad(ws=False, programs=None))
    assert torch.equal(f32.to(torch.bfloat16).view(torch.int16), want.view(torch.int16)), "fp32 result"
    assert not got[[0, 2, 8]].any()  # the empty experts
    again = gemm_fp8_ws.expert_wgrad_fp8_ws(aq, as_, bq, bs, start, count, stages=3, grid=grid)
    assert torch.equal(again.view(torch.int16), got.view(torch.int16))
