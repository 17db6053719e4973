"""FP8 routed-row GEMMs (tabby/ops/gemm/fp8.py) against the recipe's plain PyTorch GEMM
(tabby/reference_fp8.py: the same quantized operands, fp32 promotion per K block of 128) and
against fp32 on the unquantized operands. Interpreter on the CPU, compiled on a GPU.
(The GPU measurements: `tabby profile --precision fp8`; the GEMM variants' A/Bs in docs/fp8-measurements.md.)"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tabby import reference_fp8 as ref  # noqa: E402
from tabby.ops.gemm import fp8 as gemm_fp8  # noqa: E402
from tabby.ops.quantize import quantize_blocks, quantize_cols, quantize_rows  # noqa: E402
from tabby.ops.gemm.bf16 import GemmConfig, tma_aligned  # noqa: E402
from tabby.ops.gemm.fp8 import CORE_TRITON, CORE_WS, Fp8Gemm  # noqa: E402
from tabby.functional import heuristics  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp32 sums in another order (CPU); Hopper's FP8 MMA keeps ~14 bits within a K block (GPU)
TIGHT = 1e-3 if CUDA else 1e-6
# bf16 outputs against the reference rounded to bf16: the interpreter's fp32 -> bf16 cast truncates
TIGHT_BF16 = 8e-3


class Sched:
    """Routed rows of ``counts`` per expert, each segment padded to BM, ``extra`` unused tiles."""

    def __init__(self, counts, BM, TK=4096, extra=1, seed=0):
        g = torch.Generator().manual_seed(seed)
        starts, s = [], 0
        for c in counts:
            starts.append(s)
            s += -(-c // BM) * BM
        self.used, self.R = s, s + extra * BM
        te = torch.full((self.R // BM,), -1, dtype=torch.int32)
        row_src = torch.full((self.R,), -1, dtype=torch.int32)
        ids = torch.randperm(TK, generator=g)[:sum(counts)].to(torch.int32)
        j = 0
        self.segments = []
        for e, (st, c) in enumerate(zip(starts, counts)):
            te[st // BM:(st + -(-c // BM) * BM) // BM] = e
            row_src[st:st + c] = ids[j:j + c]
            j += c
            self.segments.append((e, st, c))
        self.TK, self.BM = TK, BM
        self.tile_expert = te.to(DEV)
        self.num_tiles = torch.tensor([self.used // BM], dtype=torch.int32, device=DEV)
        self.row_src = row_src.to(DEV)
        self.row_src_cpu = row_src


def rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def triton_kernel(cfg, tma=False):
    """The Triton core at ``cfg`` (the plan's choice, given as the entry points take it)."""
    return Fp8Gemm(CORE_TRITON, cfg, tma=tma)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("K,N,BN", [(256, 192, 128), (200, 96, 64), (384, 256, 256), (144, 272, 128),
                                    (272, 144, 128), (144, 272, 256)])
def test_rows_gemm_fp8_store(K, N, BN):
    BM = 16 if not CUDA else 128
    counts = [37, 0, 16, 5] if not CUDA else [300, 0, 128, 5]
    sch = Sched(counts, BM, seed=K)
    E = len(counts)
    a = rand(sch.R, K, seed=1)
    b = rand(E, N, K, seed=2, scale=K ** -0.5)
    aq, as_ = quantize_rows(a.to(DEV))
    bq, bs = quantize_blocks(b.to(DEV))
    sentinel = -7.0
    out = torch.full((sch.R, N), sentinel, dtype=torch.float32, device=DEV)
    cfg = GemmConfig(BM=BM, BN=BN, BK=128, num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, out=out, kernel=triton_kernel(cfg),
                           tile_m=BM)
    out = out.cpu()
    aqc, asc, bqc, bsc = aq.cpu(), as_.cpu(), bq.cpu(), bs.cpu()
    for e, st, c in sch.segments:
        if c == 0:
            continue
        want = ref.fp8_gemm_ref(aqc[st:st + c], asc[st:st + c], bqc[e], bsc[e])
        assert rel(out[st:st + c], want) < TIGHT
        # against fp32 on the unquantized operands: E4M3's rounding, a few per cent
        assert rel(out[st:st + c], a[st:st + c].float() @ b[e].float().t()) < 6e-2
    assert bool((out[sch.used:] == sentinel).all())  # unused tiles are not written


@pytest.mark.parametrize("K,N", [(256, 128), (144, 272)])
def test_rows_gemm_fp8_push(K, N):
    BM = 16 if not CUDA else 128
    counts = [20, 33] if not CUDA else [200, 333]
    W, TKr = 2, 64 if not CUDA else 512
    sch = Sched(counts, BM, TK=W * TKr, seed=3)
    a = rand(sch.R, K, seed=4)
    b = rand(2, N, K, seed=5, scale=0.06)
    aq, as_ = quantize_rows(a.to(DEV))
    bq, bs = quantize_blocks(b.to(DEV))
    dst = [torch.zeros(TKr, N, dtype=torch.bfloat16, device=DEV) for _ in range(W)]
    ptrs = torch.tensor([d.data_ptr() for d in dst], dtype=torch.int64, device=DEV)
    cfg = GemmConfig(BM=BM, BN=128, BK=128, num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    gemm_fp8.down_push_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, sch.row_src, ptrs, TKr,
                           kernel=triton_kernel(cfg), tile_m=BM)
    got = torch.zeros(W * TKr, N, dtype=torch.bfloat16)
    for w in range(W):
        got[w * TKr:(w + 1) * TKr] = dst[w].cpu()
    for e, st, c in sch.segments:
        want = ref.fp8_gemm_ref(aq.cpu()[st:st + c], as_.cpu()[st:st + c], bq.cpu()[e], bs.cpu()[e])
        assert rel(got[sch.row_src_cpu[st:st + c].long()], want.to(torch.bfloat16)) < TIGHT_BF16


@pytest.mark.parametrize("H,I", [(256, 256), (272, 144), (208, 80)])
def test_gate_up_swiglu_fp8(H, I):
    """Also with H and I not multiples of 128: a partial last K block, and a partial last h tile
    (its scale from its own columns)."""
    BM = 16 if not CUDA else 128
    counts = [21, 0, 40] if not CUDA else [210, 0, 400]
    sch = Sched(counts, BM, seed=6)
    E = len(counts)
    x = rand(sch.R, H, seed=7)
    wg, wu = rand(E, I, H, seed=8, scale=H ** -0.5), rand(E, I, H, seed=9, scale=H ** -0.5)
    xq, xs = quantize_rows(x.to(DEV))
    (gq, gs), (uq, us) = quantize_blocks(wg.to(DEV)), quantize_blocks(wu.to(DEV))
    hq = torch.zeros(sch.R, I, dtype=torch.float8_e4m3fn, device=DEV)
    hs = torch.full((sch.R, -(-I // 128)), -1.0, device=DEV)
    gu = torch.zeros(sch.R, 2 * I, dtype=torch.bfloat16, device=DEV)
    cfg = GemmConfig(BM=BM, BN=128, BK=128, num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    gemm_fp8.gate_up_swiglu_fp8(xq, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles, hq=hq, h_scale=hs, gu=gu,
                                kernel=triton_kernel(cfg, tma=True), tile_m=BM)
    hq, hs, gu = hq.cpu(), hs.cpu(), gu.cpu()
    xqc, xsc = xq.cpu(), xs.cpu()
    for e, st, c in sch.segments:
        if c == 0:
            continue
        g = ref.fp8_gemm_ref(xqc[st:st + c], xsc[st:st + c], gq.cpu()[e], gs.cpu()[e])
        u = ref.fp8_gemm_ref(xqc[st:st + c], xsc[st:st + c], uq.cpu()[e], us.cpu()[e])
        assert rel(gu[st:st + c, :I], g.to(torch.bfloat16)) < TIGHT_BF16
        assert rel(gu[st:st + c, I:], u.to(torch.bfloat16)) < TIGHT_BF16
        rq, rs = ref.quantize_rows_ref(torch.nn.functional.silu(g) * u)
        got = ref.dequantize_rows_ref(hq[st:st + c], hs[st:st + c])
        want = ref.dequantize_rows_ref(rq, rs)
        # the same quantization of (almost) the same fp32 h: equal but for rare neighbours
        assert (hq[st:st + c].view(torch.uint8) != rq.view(torch.uint8)).float().mean() < (2e-2 if CUDA else 1e-3)
        assert rel(got, want) < (1e-2 if CUDA else 1e-3)
        x32 = x[st:st + c].float()
        h32 = torch.nn.functional.silu(x32 @ wg[e].float().t()) * (x32 @ wu[e].float().t())
        assert rel(got, h32) < 8e-2
    assert bool((hs[sch.used:] == -1).all())


@pytest.mark.parametrize("BM,H,I", [(128, 256, 256), (128, 208, 256), (16, 256, 256), (128, 272, 144),
                                    (16, 272, 144)])
def test_gate_up_swiglu_fp8_tma_and_pointer_loops_agree(BM, H, I):
    """gate/up through tensor descriptors at the plan's kernel (at BM 128, kernel tiles of
    FP8_GATE_UP_TMA_BM rows, two per schedule tile) and through the pointer loop at the schedule's
    tile (on the same operands, and on a copy at an address that is not 16-byte aligned, where TMA
    cannot load and is refused): the same bits, also with H and I not multiples of 128 (TMA's
    out-of-bounds zeros, along K and past I, against the pointer loop's masked loads and weight
    rows modulo I)."""
    counts = [130, 0, 40] if BM == 128 else [21, 0, 40]
    sch = Sched(counts, BM, seed=H)
    E = len(counts)
    x = rand(sch.R, H, seed=11)
    wg, wu = rand(E, I, H, seed=12, scale=H ** -0.5), rand(E, I, H, seed=13, scale=H ** -0.5)
    xq, xs = quantize_rows(x.to(DEV))
    (gq, gs), (uq, us) = quantize_blocks(wg.to(DEV)), quantize_blocks(wu.to(DEV))
    xq_odd = torch.empty(sch.R * H + 1, dtype=xq.dtype, device=DEV)[1:].view(sch.R, H)
    xq_odd.copy_(xq)
    assert all(tma_aligned(t) for t in (xq, gq, uq)) and not tma_aligned(xq_odd)
    tma = heuristics.fp8_gate_up(H, BM, ws=False, programs=None)
    assert tma.tma and tma.config.BM == (heuristics.FP8_GATE_UP_TMA_BM if BM == 128 else BM)
    pointers = triton_kernel(GemmConfig(BM=BM, BN=128, BK=128, num_warps=8, GROUP_M=8,
                                        num_stages=heuristics.FP8_GATE_UP_PTR_STAGES))
    outs = []
    for a, kernel in ((xq, tma), (xq, pointers), (xq_odd, pointers)):
        hq = torch.zeros(sch.R, I, dtype=torch.float8_e4m3fn, device=DEV)
        hs = torch.full((sch.R, -(-I // 128)), -1.0, device=DEV)
        gu = torch.zeros(sch.R, 2 * I, dtype=torch.bfloat16, device=DEV)
        gemm_fp8.gate_up_swiglu_fp8(a, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles, hq=hq, h_scale=hs,
                                    gu=gu, kernel=kernel, tile_m=BM)
        outs.append((hq.view(torch.uint8).cpu(), hs.cpu(), gu.cpu()))
    (hq_t, hs_t, gu_t) = outs[0]
    for hq_p, hs_p, gu_p in outs[1:]:
        assert torch.equal(hq_t, hq_p) and torch.equal(hs_t, hs_p) and torch.equal(gu_t, gu_p)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA asked for, operands it cannot load: refused
        gemm_fp8.gate_up_swiglu_fp8(xq_odd, xs, gq, gs, uq, us, sch.tile_expert, sch.num_tiles, kernel=tma, tile_m=BM)
    assert bool((hs_t[sch.used:] == -1).all()) and bool((gu_t[sch.used:] == 0).all())
    g = ref.fp8_gemm_ref(xq.cpu()[:counts[0]], xs.cpu()[:counts[0]], gq.cpu()[0], gs.cpu()[0])
    assert rel(gu_t[:counts[0], :I], g.to(torch.bfloat16)) < TIGHT_BF16


def _zero_operands(R: int, N: int):
    """A [R, 256] and one expert's B [1, N, 256], E4M3 zeros, with unit scales (N at most 256)."""
    a = torch.zeros(R, 256, dtype=torch.float8_e4m3fn, device=DEV)
    w = torch.zeros(1, N, 256, dtype=torch.float8_e4m3fn, device=DEV)
    return a, torch.ones(R, 2, device=DEV), w, torch.ones(1, 2, 2, device=DEV)


def test_config_checks():
    sch = Sched([3], 16)
    a, s, w, ws = _zero_operands(sch.R, 200)
    k16 = triton_kernel(GemmConfig(BM=16, BN=128, BK=128))
    with pytest.raises(ValueError, match="w_gate and w_up"):
        gemm_fp8.gate_up_swiglu_fp8(a, s, w, ws, w[:, :128], ws[:, :1], sch.tile_expert, sch.num_tiles,
                                    kernel=k16, tile_m=16)
    with pytest.raises(ValueError, match="scales"):  # I = 200: two scale block rows, not one
        gemm_fp8.gate_up_swiglu_fp8(a, s, w, ws[:, :1], w, ws[:, :1], sch.tile_expert, sch.num_tiles,
                                    kernel=k16, tile_m=16)
    with pytest.raises(ValueError, match="scales"):
        gemm_fp8.rows_gemm_fp8(a, s[:, :1], w, ws, sch.tile_expert, sch.num_tiles, kernel=k16, tile_m=16)
    with pytest.raises(ValueError, match="schedule's tile"):  # a Triton rows kernel's BM is the schedule's
        gemm_fp8.rows_gemm_fp8(a, s, w, ws, sch.tile_expert, sch.num_tiles,
                               kernel=triton_kernel(GemmConfig(BM=32, BN=128, BK=128)), tile_m=16)
    with pytest.raises(ValueError, match="BK=64"):
        triton_kernel(GemmConfig(BM=16, BN=128, BK=64))
    with pytest.raises(ValueError, match="warp-specialized"):  # its tiles are 128 rows at 4 warps
        Fp8Gemm(CORE_WS, GemmConfig(BM=64, BN=128, BK=128, num_warps=4))


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability()[0] == 9, reason="sm_90 runs the ws kernels")
def test_the_warp_specialized_kernels_named_where_they_cannot_run_raise():
    """The plan names the core; an entry point that cannot run it says so (it never switches)."""
    sch = Sched([130], 128)
    a, s, w, ws = _zero_operands(sch.R, 256)
    k = heuristics.fp8_rows(256, 256, 128, ws=True, programs=4)
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8.rows_gemm_fp8(a, s, w, ws, sch.tile_expert, sch.num_tiles, kernel=k, tile_m=128)
    with pytest.raises(ValueError, match="warp-specialized"):
        gemm_fp8.gate_up_swiglu_fp8(a, s, w, ws, w, ws, sch.tile_expert, sch.num_tiles,
                                    kernel=heuristics.fp8_gate_up(256, 128, ws=True, programs=4), tile_m=128)


def test_quantize_cols_masks_padding_rows():
    BM = 16 if not CUDA else 128
    sch = Sched([37, 0, 150, 5], BM, seed=12)
    x = rand(sch.R, 96, seed=13)
    x[sch.row_src_cpu < 0] = float("nan")  # padding rows hold anything
    qt, s = quantize_cols(x.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=BM)
    clean = torch.where((sch.row_src_cpu >= 0)[:, None], x, torch.zeros_like(x))
    rq, rs = ref.quantize_cols_ref(clean)
    assert qt.shape == (96, sch.R)  # stored transposed
    assert torch.equal(qt.cpu().t().contiguous().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("M,N", [(256, 128), (192, 96), (144, 272)])
def test_expert_wgrad_fp8(M, N):
    BM = 16 if not CUDA else 128
    counts = [37, 0, 150, 5, 1] if not CUDA else [370, 0, 150, 5, 1]
    sch = Sched(counts, BM, seed=M + N)
    a, b = rand(sch.R, M, seed=14), rand(sch.R, N, seed=15)
    aq, as_ = quantize_cols(a.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=BM)
    bq, bs = quantize_cols(b.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=BM)
    cfg = GemmConfig(BM=64 if not CUDA else 128, BN=64 if not CUDA else 128, BK=128,
                     num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    start = torch.tensor([st for _, st, _ in sch.segments], dtype=torch.int32, device=DEV)
    count = torch.tensor([c for _, _, c in sch.segments], dtype=torch.int32, device=DEV)
    out = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.float32,
                                    kernel=triton_kernel(cfg)).cpu()
    aqc, bqc = aq.cpu().t().contiguous(), bq.cpu().t().contiguous()  # [R, C], as the reference takes them
    for e, st, c in sch.segments:
        want = ref.fp8_wgrad_ref(aqc, as_.cpu(), bqc, bs.cpu(), st, c)
        if c == 0:
            assert bool((out[e] == 0).all())
            continue
        assert rel(out[e], want) < TIGHT
        assert rel(out[e], a[st:st + c].float().t() @ b[st:st + c].float()) < 6e-2


@pytest.mark.parametrize("M,N", [(64, 96), (144, 80)])
def test_expert_wgrad_fp8_padded_segments(M, N):
    """``padded=True`` on the layer's layout (segments at multiples of 128, padding rows quantized as
    zeros; empty experts first, between and last, one of one row, one of exactly 256): bitwise the
    general kernel, which masks each segment's last block; and a buffer whose R is not a multiple
    of 128 refused."""
    sch = Sched([0, 37, 0, 256, 5, 1, 0], 128, seed=M * N)
    a, b = rand(sch.R, M, seed=24), rand(sch.R, N, seed=25)
    a[sch.row_src_cpu < 0] = float("nan")  # padding rows hold anything before quantize_cols
    aq, as_ = quantize_cols(a.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=128)
    bq, bs = quantize_cols(b.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=128)
    cfg = GemmConfig(BM=64 if not CUDA else 128, BN=64 if not CUDA else 128, BK=128,
                     num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    start = torch.tensor([st for _, st, _ in sch.segments], dtype=torch.int32, device=DEV)
    count = torch.tensor([c for _, _, c in sch.segments], dtype=torch.int32, device=DEV)
    k = triton_kernel(cfg)
    general = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.float32, kernel=k)
    padded = gemm_fp8.expert_wgrad_fp8(aq, as_, bq, bs, start, count, out_dtype=torch.float32, kernel=k, padded=True)
    assert torch.equal(general.view(torch.int32), padded.view(torch.int32))
    assert not padded[[0, 2, 6]].any()  # the empty experts
    with pytest.raises(ValueError, match="multiple of 128"):
        gemm_fp8.expert_wgrad_fp8(aq[:, :-16], as_, bq[:, :-16], bs, start, count, padded=True, kernel=k)


@pytest.mark.parametrize("H,I", [(256, 256), (272, 144), (208, 80)])
def test_down_dgrad_swiglu_fp8(H, I):
    """The FP8 down dgrad (dy per 1x128, W_down's blocks transposed) with gemm.py's SwiGLU backward
    epilogue, against the bf16 kernel's epilogue fed with the recipe's fp32 dh_raw; also with a
    partial last K block (H) and a partial last column tile (I)."""
    BM = 16 if not CUDA else 128
    counts = [21, 0, 40] if not CUDA else [210, 0, 400]
    sch = Sched(counts, BM, seed=16)
    E = len(counts)
    dys = rand(sch.R, H, seed=17)
    wd = rand(E, H, I, seed=18, scale=I ** -0.5)
    gu = rand(sch.R, 2 * I, seed=19)
    row_w = torch.rand(sch.R, generator=torch.Generator().manual_seed(20))
    dq, ds = quantize_rows(dys.to(DEV))
    wq, wsc = quantize_blocks(wd.to(DEV))
    wtq, wts = gemm_fp8.transpose_blocks(wq, wsc)
    cfg = GemmConfig(BM=BM, BN=128, BK=128, num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    dgu, hw, dwp = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, wtq, wts, gu.to(DEV), row_w.to(DEV), sch.tile_expert,
                                                  sch.num_tiles, kernel=triton_kernel(cfg), tile_m=BM)
    dgu, hw, dw = dgu.cpu().float(), hw.cpu().float(), dwp.cpu().sum(1)
    # the transposed blocks are the same quantization as quantizing W_down^T itself
    rq, rs = ref.quantize_blocks_ref(wd.transpose(1, 2).contiguous())
    assert torch.equal(wtq.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(wts.cpu(), rs)
    for e, st, c in sch.segments:
        if c == 0:
            continue
        sl = slice(st, st + c)
        dh_raw = ref.fp8_gemm_ref(dq.cpu()[sl], ds.cpu()[sl], rq[e], rs[e])
        g, u = gu[sl, :I].float(), gu[sl, I:].float()
        sg = torch.sigmoid(g)
        h = g * sg * u
        dh = dh_raw * row_w[sl, None]
        assert rel(dgu[sl, :I], dh * u * sg * (1 + g * (1 - sg))) < TIGHT_BF16
        assert rel(dgu[sl, I:], dh * g * sg) < TIGHT_BF16
        assert rel(hw[sl], h * row_w[sl, None]) < TIGHT_BF16
        assert rel(dw[sl], (dh_raw * h).sum(1)) < (1e-3 if CUDA else 1e-5)
        assert rel(dh_raw, dys[sl].float() @ wd[e].float()) < 6e-2


@pytest.mark.parametrize("H,I,made", [(272, 144, "transposed"), (208, 80, "transposed"), (256, 256, "transposed"),
                                      (272, 144, "with_copies"), (256, 256, "with_copies")])
def test_gate_up_dgrad_fp8_halves_padded(H, I, made):
    """The gate/up dgrad dxs = dg @ W_gate + du @ W_up as one rows GEMM over K = 2 Ip (Ip = I rounded
    up to 128): A from ``quantize_gate_up_grad`` and B from ``fp8_gate_up_t`` are bitwise the
    recipe's operands (``gate_up_grad_operands_ref``: dg, du, W_gate^T, W_up^T each quantized on its
    own, each half zero-padded), the product is the recipe's GEMM on them, and near fp32. B made
    either way: transposed from the forward's copies, or with them from one read of the weights
    (``fp8_layer_weights(transposed=True)``, then found in the cache)."""
    from tabby.functional import fp8 as fp8_layer

    BM = 128  # an FP8 backward's routed tile height
    counts = [21, 0, 40] if not CUDA else [210, 0, 400]
    sch = Sched(counts, BM, seed=H + I)
    E, Ip = len(counts), -(-I // 128) * 128
    dgu = rand(sch.R, 2 * I, seed=31)
    wg, wu = rand(E, I, H, seed=32, scale=I ** -0.5), rand(E, I, H, seed=33, scale=I ** -0.5)
    (aq, as_), (dgu_t, dgu_ts) = fp8_layer.quantize_gate_up_grad(dgu.to(DEV), I, sch.row_src, sch.num_tiles, BM)
    # the weight gradients' operand, from the same read: dg | du per 128x1, as quantize_cols makes it
    want_t, want_ts = quantize_cols(dgu.to(DEV), row_src=sch.row_src, num_tiles=sch.num_tiles, tile_rows=BM)
    assert torch.equal(dgu_t.view(torch.uint8), want_t.view(torch.uint8)) and torch.equal(dgu_ts, want_ts)
    wg_d, wu_d = wg.to(DEV), wu.to(DEV)
    fp8_layer.clear_weight_cache()
    if made == "with_copies":
        wd_d = rand(E, H, I, seed=34).to(DEV)
        fp8_layer.fp8_layer_weights(wg_d, wu_d, wd_d, transposed=True)
        assert len(fp8_layer._weight_cache) == 5  # three copies, two transposed operands
    bq, bs = fp8_layer.fp8_gate_up_t(wg_d, wu_d, hold=False)
    if made == "with_copies":
        assert fp8_layer.fp8_gate_up_t(wg_d, wu_d, hold=False)[0] is bq  # the cached operand
        wt, wts = fp8_layer.fp8_weight_t(wd_d, hold=False)  # W_down^T: the forward copy's transpose, exactly
        assert torch.equal(wt.cpu().view(torch.uint8),
                           fp8_layer.fp8_weight(wd_d)[0].cpu().transpose(1, 2).contiguous().view(torch.uint8))
        assert torch.equal(wts, fp8_layer.fp8_weight(wd_d)[1].transpose(1, 2))
    fp8_layer.clear_weight_cache()
    assert aq.shape == (sch.R, 2 * Ip) and bq.shape == (E, H, 2 * Ip) and bs.shape == (E, -(-H // 128), 2 * Ip // 128)
    used = slice(0, sch.used)
    raq, ras = ref.gate_up_grad_operands_ref(ref.quantize_rows_ref(dgu[used, :I]), ref.quantize_rows_ref(dgu[used, I:]))
    assert torch.equal(aq.cpu()[used].view(torch.uint8), raq.view(torch.uint8)) and torch.equal(as_.cpu()[used], ras)
    rbq, rbs = zip(*(ref.gate_up_grad_operands_ref(*(ref.quantize_blocks_ref(w[e].t().contiguous()) for w in (wg, wu)))
                     for e in range(E)))
    assert torch.equal(bq.cpu().view(torch.uint8), torch.stack(rbq).view(torch.uint8))
    assert torch.equal(bs.cpu(), torch.stack(rbs))
    out = torch.full((sch.R, H), -7.0, dtype=torch.float32, device=DEV)
    cfg = GemmConfig(BM=BM, BN=128, BK=128, num_warps=8 if CUDA else 4, num_stages=3 if CUDA else 1, GROUP_M=2)
    gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, sch.tile_expert, sch.num_tiles, out=out, kernel=triton_kernel(cfg),
                           tile_m=BM)
    out = out.cpu()
    for e, st, c in sch.segments:
        if c == 0:
            continue
        sl = slice(st, st + c)
        assert rel(out[sl], ref.fp8_gemm_ref(raq[sl], ras[sl], rbq[e], rbs[e])) < TIGHT
        exact = dgu[sl, :I].float() @ wg[e].float() + dgu[sl, I:].float() @ wu[e].float()
        assert rel(out[sl], exact) < 6e-2


def test_transpose_blocks_exact_into_a_view():
    """The E4M3 transpose (the backward's weight copies): every byte moved, NaN patterns included,
    odd sizes (partial 64-wide tiles), into a column slice of a wider buffer as the gate/up dgrad's
    [W_gate^T | W_up^T] takes it; the scales transposed."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (3, 200, 136), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(3, 2, 2, generator=g)
    wide = torch.zeros(3, 136, 300, dtype=torch.uint8)
    out, st = gemm_fp8.transpose_blocks(q.to(DEV), s.to(DEV), out=wide.to(DEV).view(torch.float8_e4m3fn)[:, :, 50:250])
    full = out._base.view(torch.uint8).cpu() if out._base is not None else None
    assert torch.equal(out.cpu().view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
    assert full is None or (not full[:, :, :50].any() and not full[:, :, 250:].any())  # nothing written outside
    assert torch.equal(st.cpu(), s.transpose(1, 2))
    alone, _ = gemm_fp8.transpose_blocks(q.to(DEV), s.to(DEV))
    assert alone.is_contiguous() and torch.equal(alone.cpu().view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
