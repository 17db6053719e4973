"""The dgrads reading the weights' forward E4M3 copies transposed in the kernel
(gemm_fp8.down_dgrad_swiglu_fp8_t, gemm_fp8.gate_up_dgrad_push_fp8_t; gemm_fp8_ws.launch_bt) on a
GPU, bitwise against the same GEMMs over the transposed copies (transpose_blocks): the same wgmma
over the same bytes, promoted alike. Partial K blocks (H 2880: a block reads the next expert's
first rows against A's zero columns), partial column tiles, I not a multiple of 128 (the gate/up
dgrad's padded halves), empty experts, unused tiles, schedule tiles of 256 rows, several ring
depths, lags and a grid smaller than the tiles; 20 repeats bitwise. Off sm_90 the entry points
refuse (the plan then has the layer transpose the copies first: ``Plan.fp8.dgrad``)."""

import pytest
import torch
import triton

from tabby.functional import heuristics as hx
from tabby.functional.fp8 import _gate_up_t_buffer, _gate_up_t_scales
from tabby.ops.gemm import fp8 as gemm_fp8, fp8_ws as gemm_fp8_ws
from tabby.ops.quantize import quantize_blocks, quantize_rows

from test_fp8_gemm import Sched, rand

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DOWN_CASES = [([300, 0, 128, 5], 1024, 256), ([77, 500, 3], 2880, 320), ([129, 1, 700], 7168, 2048),
              ([0, 40, 0, 900], 2048, 768)]
GATE_UP_CASES = [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1040, 720), ([77, 500, 3], 2880, 2880),
                 ([512] * 4, 7168, 2048)]


def _bt():
    """The plan's transposing kernel on sm_90 (``heuristics.fp8_down_dgrad(in_kernel=True)``)."""
    return hx.fp8_down_dgrad(128, ws=True, programs=None, in_kernel=True)


def _held(N, K, BM=128):
    """The plan's sm_90 kernel of the same GEMM over held transposes (``heuristics.fp8_rows`` and
    ``fp8_down_dgrad``)."""
    return hx.fp8_rows(N, K, BM, ws=True, programs=None)


def _down_case(counts, H, I, BM=128):
    """(schedule, dys E4M3 + scales, W_down's forward copy [E, H, I] + scales, gu, router weights)."""
    sch = Sched(counts, BM, seed=H + I)
    dq, ds = quantize_rows(rand(sch.R, H, seed=1).cuda())
    wq, wsc = quantize_blocks(rand(len(counts), H, I, seed=2, scale=H ** -0.5).cuda())
    gu = rand(sch.R, 2 * I, seed=5).cuda()
    w = torch.rand(sch.R, generator=torch.Generator().manual_seed(6)).cuda()
    return sch, dq, ds, wq, wsc, gu, w


def _assert_down_equal(got, want, used):
    for name, x, y in zip(("dgu", "hw", "dw_part"), got, want):
        assert torch.equal(x[used], y[used]), (name, (x[used].float() - y[used].float()).abs().max())


@gpu
@pytest.mark.parametrize("counts,H,I", DOWN_CASES)
def test_down_dgrad_reading_the_forward_copy_is_bitwise_the_transposed_one(counts, H, I):
    sch, dq, ds, wq, wsc, gu, w = _down_case(counts, H, I)
    assert gemm_fp8_ws.fits_bt(dq, (wq,), 128)
    want = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, *gemm_fp8.transpose_blocks(wq, wsc), gu, w, sch.tile_expert,
                                          sch.num_tiles, kernel=hx.fp8_down_dgrad(128, ws=True, programs=None),
                                          tile_m=128)
    got = gemm_fp8.down_dgrad_swiglu_fp8_t(dq, ds, wq, wsc, gu, w, sch.tile_expert, sch.num_tiles, kernel=_bt(),
                                           tile_m=128)
    _assert_down_equal(got, want, slice(0, sch.used))


@gpu
@pytest.mark.parametrize("stages,lag,grid", [(4, 1, None), (4, 3, 5), (3, 2, 3), (5, 2, None)])
def test_transposing_kernel_ring_depths_lags_and_grids(stages, lag, grid):
    """Every ring depth and lag the producer allows gives the same bits, also persistent over many
    tiles a program (grid 3, 5)."""
    sch, dq, ds, wq, wsc, gu, w = _down_case([77, 500, 3, 0, 260], 2880, 320)
    want = gemm_fp8.down_dgrad_swiglu_fp8_t(dq, ds, wq, wsc, gu, w, sch.tile_expert, sch.num_tiles, kernel=_bt(),
                                            tile_m=128)
    I = wq.shape[2]
    dgu, hw, dw, epi = gemm_fp8._swiglu_bwd_outputs(gu, w, triton.cdiv(I, 128))
    gemm_fp8_ws.launch_bt(dq, ds, (wq,), wsc.transpose(-2, -1).contiguous(), sch.tile_expert, sch.num_tiles, 128,
                          gemm_fp8_ws.EPI_SWIGLU_BWD, epi, I, stages=stages, lag=lag, grid=grid)
    _assert_down_equal((dgu, hw, dw), want, slice(0, sch.used))


def _gate_up_case(counts, H, I, BM=128):
    """(schedule, dg | du quantized per half into [R, 2Ip] with zero padding, the forward copies of
    W_gate and W_up [E, I, H] with scales)."""
    sch = Sched(counts, BM, seed=H + 3 * I)
    Ip = triton.cdiv(I, 128) * 128
    dgu = rand(sch.R, 2 * I, seed=21).cuda()
    q = torch.zeros(sch.R, 2 * Ip, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.empty(sch.R, 2 * Ip // 128, dtype=torch.float32, device="cuda")
    for half in range(2):
        hq, hs = quantize_rows(dgu[:, half * I:(half + 1) * I])
        q[:, half * Ip:half * Ip + I] = hq
        s[:, half * Ip // 128:(half + 1) * Ip // 128] = hs
    (gq, gs), (uq, us) = (quantize_blocks(rand(len(counts), I, H, seed=sd, scale=H ** -0.5).cuda()) for sd in (22, 23))
    return sch, q, s, gq, gs, uq, us


def _pushed(sch, H, run, W=3):
    """The rows ``run(dst_ptrs, TK)`` pushes to W origins of TK rows of H columns each."""
    TK = -(-sch.TK // W)
    dst = [torch.full((TK, H), -3.0, dtype=torch.bfloat16, device="cuda") for _ in range(W)]
    ptrs = torch.tensor([d.data_ptr() for d in dst], dtype=torch.int64, device="cuda")
    run(ptrs, TK)
    return torch.stack(dst)


@gpu
@pytest.mark.parametrize("counts,H,I", GATE_UP_CASES)
@pytest.mark.parametrize("BM", [128, 256])
def test_gate_up_dgrad_reading_the_forward_copies_is_bitwise_the_transposed_ones(counts, H, I, BM):
    sch, q, s, gq, gs, uq, us = _gate_up_case(counts, H, I, BM)
    E = len(counts)
    bt, (g_t, u_t) = _gate_up_t_buffer(E, I, H, q.device)
    gemm_fp8.transpose_blocks(gq, gs, out=g_t)
    gemm_fp8.transpose_blocks(uq, us, out=u_t)
    b_scale = _gate_up_t_scales(gs, us)
    want = _pushed(sch, H, lambda ptrs, TK: gemm_fp8.rows_gemm_fp8(
        q, s, bt, b_scale, sch.tile_expert, sch.num_tiles, row_src=sch.row_src, dst_ptrs=ptrs, TK=TK,
        kernel=_held(H, q.shape[1], BM), tile_m=BM))
    got = _pushed(sch, H, lambda ptrs, TK: gemm_fp8.gate_up_dgrad_push_fp8_t(
        q, s, gq, uq, b_scale, sch.tile_expert, sch.num_tiles, sch.row_src, ptrs, TK, kernel=_bt(), tile_m=BM))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert (got != -3.0).any(dim=-1).sum() == sum(counts), "not every routed row arrived once"


@gpu
def test_transposing_kernel_deterministic():
    sch, q, s, gq, gs, uq, us = _gate_up_case([1000, 3, 257, 0, 640], 2048, 704)
    b_scale = _gate_up_t_scales(gs, us)

    def run():
        return _pushed(sch, 2048, lambda ptrs, TK: gemm_fp8.gate_up_dgrad_push_fp8_t(
            q, s, gq, uq, b_scale, sch.tile_expert, sch.num_tiles, sch.row_src, ptrs, TK, kernel=_bt(), tile_m=128))

    first = run()
    for _ in range(20):
        assert torch.equal(run(), first)


def test_the_transposing_entry_points_refuse_off_sm90():
    """Off sm_90 (here: CPU tensors) the layer must transpose the copies first (the plan's
    ``fp8.dgrad`` says so there): the entry point refuses rather than run something else; and
    any kernel but the transposing one is refused."""
    dq = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(3, 256, 128, dtype=torch.float8_e4m3fn)
    assert not gemm_fp8_ws.fits_bt(dq, (wq,), 128)
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8.down_dgrad_swiglu_fp8_t(dq, None, wq, None, None, None, None, None, kernel=_bt(), tile_m=128)
    with pytest.raises(ValueError, match="transposing kernel"):
        gemm_fp8.down_dgrad_swiglu_fp8_t(dq, None, wq, None, None, None, None, None, tile_m=128,
                                         kernel=hx.fp8_down_dgrad(128, ws=True, programs=None))


@gpu
def test_the_transposing_entry_points_refuse_what_tma_cannot_read():
    """Weights whose rows are no TMA stride, or schedule tiles not a multiple of 128 rows."""
    sch, dq, ds, wq, wsc, gu, w = _down_case([130, 0, 5], 256, 128)
    bad = torch.zeros(3, 256, 200, dtype=torch.float8_e4m3fn, device="cuda")[:, :, :120]
    assert not gemm_fp8_ws.fits_bt(dq, (bad,), 128)
    assert not gemm_fp8_ws.fits_bt(dq, (wq,), 64)
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8.down_dgrad_swiglu_fp8_t(dq, ds, bad, wsc, gu, w, sch.tile_expert, sch.num_tiles, kernel=_bt(),
                                         tile_m=128)
