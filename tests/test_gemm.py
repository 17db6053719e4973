"""Tests of tabby.ops.gemm.bf16: routed-row expert GEMMs against plain torch fp32.

Without CUDA the kernels run in the Triton interpreter on CPU tensors (small tiles, small sizes);
with CUDA the same tests run on the GPU, plus realistic-size checks. The weight gradients (5.) have
their own file, tests/test_wgrad.py.
`python tests/test_gemm.py` (with CUDA) prints a small benchmark of every kernel.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tabby.functional import heuristics  # noqa: E402
from tabby.ops.gemm import bf16 as gemm  # noqa: E402
from tabby.ops.gemm.bf16 import GemmConfig  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

BM = 16
CFG = GemmConfig(BM=BM, BN=16, BK=16, num_warps=4, num_stages=2, GROUP_M=2)
CFG32 = GemmConfig(BM=BM, BN=32, BK=16, num_warps=4, num_stages=2, GROUP_M=4)


# --------------------------------------------------------------------------------------------
# A schedule like the real one: experts in order, each segment padded to BM, unused tiles at the end.
# --------------------------------------------------------------------------------------------

class Sched:
    def __init__(self, counts, BM, W, TK, extra_tiles=2, seed=0, device=DEV):
        g = torch.Generator().manual_seed(seed)
        E = len(counts)
        padded = [(c + BM - 1) // BM * BM for c in counts]
        start = [0]
        for p in padded:
            start.append(start[-1] + p)
        used = start[-1]
        R = used + extra_tiles * BM
        te = torch.full((R // BM,), -1, dtype=torch.int32)
        for e in range(E):
            te[start[e] // BM:start[e + 1] // BM] = e
        n_real = sum(counts)
        assert n_real <= W * TK
        ids = torch.randperm(W * TK, generator=g)[:n_real].to(torch.int32)
        row_src = torch.full((R,), -1, dtype=torch.int32)
        real = torch.zeros(R, dtype=torch.bool)
        j = 0
        for e in range(E):
            row_src[start[e]:start[e] + counts[e]] = ids[j:j + counts[e]]
            real[start[e]:start[e] + counts[e]] = True
            j += counts[e]
        self.E, self.BM, self.R, self.W, self.TK = E, BM, R, W, TK
        self.counts, self.start_list, self.used = list(counts), start, used
        self.row_expert = torch.full((R,), -1, dtype=torch.long)
        for e in range(E):
            self.row_expert[start[e]:start[e + 1]] = e
        self.real = real
        self.used_rows = torch.arange(R) < used
        self.tile_expert = te.to(device)
        self.num_tiles = torch.tensor([used // BM], dtype=torch.int32, device=device)
        self.expert_start = torch.tensor(start, dtype=torch.int32, device=device)
        self.expert_count = torch.tensor(counts, dtype=torch.int32, device=device)
        self.row_src = row_src.to(device)
        self.row_src_cpu = row_src

    def rows(self, n_cols, seed, dtype=torch.bfloat16, scale=1.0):
        """Random [R, n_cols] rows, zero on padding rows and unused rows."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.R, n_cols, generator=g) * scale
        x[~self.real] = 0
        return x.to(dtype).to(DEV)


def rand(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def rel_err(got, ref):
    got, ref = got.float().cpu(), ref.float().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def per_row_ref(sched, a, fn):
    """out[r] = fn(e, a rows of expert e) for used rows (fp32, cpu); other rows NaN."""
    outs = None
    for e in range(sched.E):
        s, t = sched.start_list[e], sched.start_list[e + 1]
        if t == s:
            continue
        y = fn(e, a[s:t].float().cpu())
        if outs is None:
            outs = torch.full((sched.R, y.shape[1]), float("nan"))
        outs[s:t] = y
    return outs


COUNTS = {
    "mixed": [5, 0, 23, 16],  # a ragged expert, an empty one, one spanning tiles, one exactly a tile
    "one_expert": [0, 0, 37, 0],  # every row on one expert
}


def swiglu_ref(sched, xs, wg, wu):
    g = per_row_ref(sched, xs, lambda e, x: x @ wg[e].float().cpu().T)
    u = per_row_ref(sched, xs, lambda e, x: x @ wu[e].float().cpu().T)
    return g, u, torch.nn.functional.silu(g) * u


# --------------------------------------------------------------------------------------------
# 1. gate/up + SwiGLU
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("cfg", [CFG, CFG32], ids=["bn16", "bn32"])
def test_gate_up_swiglu(counts, cfg):
    H, I = 48, 40
    s = Sched(COUNTS[counts], BM, W=2, TK=40)
    xs = s.rows(H, seed=1)
    wg = rand(s.E, I, H, seed=2, scale=H ** -0.5)
    wu = rand(s.E, I, H, seed=3, scale=H ** -0.5)
    h = torch.full((s.R, I), float("nan"), dtype=torch.bfloat16, device=DEV)
    gu = torch.full((s.R, 2 * I), float("nan"), dtype=torch.bfloat16, device=DEV)
    gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, h=h, gu=gu, config=cfg)
    g_ref, u_ref, h_ref = swiglu_ref(s, xs, wg, wu)
    used = s.used_rows
    assert rel_err(h[used], h_ref[used]) < 1e-2
    assert rel_err(gu[used, :I], g_ref[used]) < 1e-2
    assert rel_err(gu[used, I:], u_ref[used]) < 1e-2
    assert torch.all(h[~used.to(DEV)].isnan()), "unused tiles must not be written"
    assert torch.all(gu[~used.to(DEV)].isnan())
    assert torch.all(h[(used & ~s.real).to(DEV)] == 0), "padding rows give zeros"
    # without SAVE_GU, and determinism
    h2 = gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, config=cfg)
    h3 = gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, config=cfg)
    assert torch.equal(h2[used], h[used]) and torch.equal(h2[used], h3[used])


# --------------------------------------------------------------------------------------------
# 2. down GEMM: local store and push
# --------------------------------------------------------------------------------------------

def make_dsts(s, N, n_cols_buf=None):
    """W destination buffers [TK, N] poisoned with NaN and their address table."""
    dsts = [torch.full((s.TK, n_cols_buf or N), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(s.W)]
    ptrs = torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64, device=DEV)
    return dsts, ptrs


def check_pushed(s, dsts, ref_rows, N):
    """Every real row r landed at dsts[src][row] with the right values; every other row is NaN."""
    rs = s.row_src_cpu
    expected = [torch.full((s.TK, N), float("nan")) for _ in range(s.W)]
    for r in range(s.R):
        if rs[r] >= 0:
            expected[int(rs[r]) // s.TK][int(rs[r]) % s.TK] = ref_rows[r]
    for w in range(s.W):
        got = dsts[w][:, :N].float().cpu()
        exp = expected[w]
        pushed = ~exp[:, 0].isnan()
        assert torch.all(got[~pushed].isnan()), f"dst {w}: rows written that no row_src names"
        assert not torch.any(got[pushed].isnan()), f"dst {w}: a pushed row was not written"
        if pushed.any():
            assert rel_err(got[pushed], exp[pushed]) < 1e-2


@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("cfg", [CFG, CFG32], ids=["bn16", "bn32"])
def test_down_push(counts, cfg):
    H, I = 48, 40
    s = Sched(COUNTS[counts], BM, W=3, TK=20)
    hh = s.rows(I, seed=4)
    wd = rand(s.E, H, I, seed=5, scale=I ** -0.5)
    ref = per_row_ref(s, hh, lambda e, x: x @ wd[e].float().cpu().T)
    dsts, ptrs = make_dsts(s, H)
    gemm.down_push(hh, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, config=cfg)
    check_pushed(s, dsts, ref, H)
    # determinism
    dsts2, ptrs2 = make_dsts(s, H)
    gemm.down_push(hh, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs2, s.TK, config=cfg)
    for a, b in zip(dsts, dsts2):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    # local store
    out = torch.full((s.R, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    gemm.down_local(hh, wd, s.tile_expert, s.num_tiles, out=out, config=cfg)
    used = s.used_rows
    assert rel_err(out[used], ref[used]) < 1e-2
    assert torch.all(out[~used.to(DEV)].isnan())


def test_push_wider_destination_and_nonzero_padding():
    """Destination row stride != N; padding rows carrying garbage are still never pushed."""
    H, I = 48, 40
    s = Sched(COUNTS["mixed"], BM, W=2, TK=30)
    hh = s.rows(I, seed=6)
    pad = s.used_rows & ~s.real
    hh[pad.to(DEV)] = 5.0  # robustness: padding rows not zero
    wd = rand(s.E, H, I, seed=7, scale=I ** -0.5)
    ref = per_row_ref(s, hh, lambda e, x: x @ wd[e].float().cpu().T)
    dsts, ptrs = make_dsts(s, H, n_cols_buf=64)
    gemm.down_push(hh, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, dst_stride=64, config=CFG32)
    check_pushed(s, dsts, ref, H)
    for d in dsts:
        assert torch.all(d[:, H:].isnan()), "columns past N must not be written"


def test_rows_gemm_generic_layouts():
    """rows_gemm with B[e] as [K, N] (A @ B), two phases and odd K, local store and fp32 out."""
    K1, K2, N = 40, 24, 48
    s = Sched(COUNTS["mixed"], BM, W=1, TK=64)
    a = s.rows(K1 + K2, seed=8)
    a1, a2 = a[:, :K1], a[:, K1:]  # the phases share A's row stride (column slices of one buffer)
    b1 = rand(s.E, K1, N, seed=10, scale=0.2)
    b2 = rand(s.E, K2, N, seed=11, scale=0.2)
    ref = per_row_ref(s, a1, lambda e, x: x @ b1[e].float().cpu())
    ref2 = per_row_ref(s, a2, lambda e, x: x @ b2[e].float().cpu())
    out = gemm.rows_gemm(a1, b1, s.tile_expert, s.num_tiles, b_layout="kn", a2=a2, b2=b2,
                         out_dtype=torch.float32, config=CFG32)
    used = s.used_rows
    assert out.dtype == torch.float32
    assert rel_err(out[used], (ref + ref2)[used]) < 1e-2
    for cfg in (CFG, CFG32):
        out1 = gemm.rows_gemm(a1, b1, s.tile_expert, s.num_tiles, b_layout="kn", config=cfg)
        assert rel_err(out1[used], ref[used]) < 1e-2


# --------------------------------------------------------------------------------------------
# 3. down dgrad + SwiGLU backward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("cfg", [CFG, CFG32], ids=["bn16", "bn32"])
def test_down_dgrad_swiglu_bwd(counts, cfg):
    H, I = 48, 40
    s = Sched(COUNTS[counts], BM, W=2, TK=40)
    dys = s.rows(H, seed=12)
    gu = s.rows(2 * I, seed=13, scale=2.0)
    wd = rand(s.E, H, I, seed=14, scale=I ** -0.5)
    g = torch.Generator().manual_seed(15)
    ws = torch.rand(s.R, generator=g)
    ws[~s.real] = 0
    ws = ws.to(DEV)
    R = s.R
    nan = float("nan")
    dgu = torch.full((R, 2 * I), nan, dtype=torch.bfloat16, device=DEV)
    hw = torch.full((R, I), nan, dtype=torch.bfloat16, device=DEV)
    nt = -(-I // cfg.BN)
    dwp = torch.full((R, nt), nan, dtype=torch.float32, device=DEV)
    gemm.down_dgrad_swiglu_bwd(dys, wd, gu, ws, s.tile_expert, s.num_tiles, dgu=dgu, hw=hw, dw_part=dwp, config=cfg)

    # reference: autograd through y = ws * down(silu(g) * u)
    used = s.used_rows
    dh_raw = per_row_ref(s, dys, lambda e, x: x @ wd[e].float().cpu())
    gf = gu[:, :I].float().cpu()
    uf = gu[:, I:].float().cpu()
    gf_ = gf.clone().requires_grad_()
    uf_ = uf.clone().requires_grad_()
    wsc = ws.cpu()
    h = torch.nn.functional.silu(gf_) * uf_
    (h * (dh_raw.nan_to_num(0) * wsc[:, None])).sum().backward()
    dw_ref = (dh_raw * h.detach()).sum(1)
    assert rel_err(dgu[used, :I], gf_.grad[used]) < 1e-2
    assert rel_err(dgu[used, I:], uf_.grad[used]) < 1e-2
    assert rel_err(hw[used], (h.detach() * wsc[:, None])[used]) < 1e-2
    dw = gemm.reduce_dw(dwp)
    assert rel_err(dw[used], dw_ref[used]) < 1e-2
    ud = (~used).to(DEV)
    assert torch.all(dgu[ud].isnan()) and torch.all(hw[ud].isnan()) and torch.all(dwp[ud].isnan())
    # determinism
    dgu2, hw2, dwp2 = gemm.down_dgrad_swiglu_bwd(dys, wd, gu, ws, s.tile_expert, s.num_tiles, config=cfg)
    ue = used.to(DEV)
    assert torch.equal(dgu2[ue], dgu[ue]) and torch.equal(hw2[ue], hw[ue]) and torch.equal(dwp2[ue], dwp[ue])
    assert torch.equal(gemm.reduce_dw(dwp2)[ue], dw[ue])


def test_reduce_dw():
    x = torch.randn(300, 7, generator=torch.Generator().manual_seed(0)).to(DEV)
    assert torch.allclose(gemm.reduce_dw(x), x.sum(1), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# 4. gate/up dgrad with push
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("cfg", [CFG, CFG32], ids=["bn16", "bn32"])
def test_gate_up_dgrad_push(counts, cfg):
    H, I = 48, 40  # I not a multiple of BK: both phases masked
    s = Sched(COUNTS[counts], BM, W=3, TK=20)
    dgu = s.rows(2 * I, seed=16)
    wg = rand(s.E, I, H, seed=17, scale=I ** -0.5)
    wu = rand(s.E, I, H, seed=18, scale=I ** -0.5)
    ref = per_row_ref(s, dgu, lambda e, x: x[:, :I] @ wg[e].float().cpu() + x[:, I:] @ wu[e].float().cpu())
    dsts, ptrs = make_dsts(s, H)
    gemm.gate_up_dgrad_push(dgu, wg, wu, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, config=cfg)
    check_pushed(s, dsts, ref, H)
    dsts2, ptrs2 = make_dsts(s, H)
    gemm.gate_up_dgrad_push(dgu, wg, wu, s.tile_expert, s.num_tiles, s.row_src, ptrs2, s.TK, config=cfg)
    for a, b in zip(dsts, dsts2):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    out = gemm.gate_up_dgrad_local(dgu, wg, wu, s.tile_expert, s.num_tiles, config=cfg)
    used = s.used_rows
    assert rel_err(out[used], ref[used]) < 1e-2


def test_planned_configs():
    """The heuristics' tiles of every standalone kernel (the plan's: the launchers take them as given)."""
    for N, K in ((768, 2048), (2048, 768), (40, 48)):
        for kind in (gemm.KIND_GATE_UP, gemm.KIND_DOWN, gemm.KIND_DGRAD_SWIGLU, gemm.KIND_GATE_UP_DGRAD):
            c = heuristics.gemm_config(kind, N, K, 128)
            assert c.BM == 128 and c.BK == 64 and c.BN in (16, 32, 64, 128, 256)
        c = heuristics.wgrad_config(N)
        assert c.BM == 128 and c.BK == 32 and c.BN in (16, 32, 64, 128, 256)
    with pytest.raises(ValueError, match="unknown GEMM kind"):
        heuristics.gemm_config("wgrad", 768, 2048, 128)


def planned(kind, N, K):
    """The plan's tiles of ``kind`` at 128-row tiles (``heuristics.gemm_config``)."""
    return heuristics.gemm_config(kind, N, K, 128)


def planned_wgrad(N):
    """The plan's weight-gradient tiles and grid on this device."""
    return dict(config=heuristics.wgrad_config(N),
                programs=heuristics.wgrad_programs(torch.cuda.get_device_properties(0).multi_processor_count
                                                   if CUDA else None))


# --------------------------------------------------------------------------------------------
# Realistic sizes on the GPU
# --------------------------------------------------------------------------------------------

def big_sched(E=8, rows=4096, W=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(E, generator=g) + 0.2
    p[3] = 0  # an empty expert
    counts = torch.distributions.Multinomial(rows, p / p.sum()).sample().long().tolist()
    TK = (rows + W - 1) // W + 64
    return Sched(counts, 128, W=W, TK=TK, extra_tiles=3, seed=seed)


@needs_cuda
def test_gpu_forward_realistic():
    E, H, I = 8, 2048, 768
    s = big_sched(E)
    xs = s.rows(H, seed=1)
    wg = rand(E, I, H, seed=2, scale=H ** -0.5)
    wu = rand(E, I, H, seed=3, scale=H ** -0.5)
    wd = rand(E, H, I, seed=4, scale=I ** -0.5)
    h, gu = gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, save_gu=True,
                                config=planned(gemm.KIND_GATE_UP, I, H))
    used = s.used_rows.to(DEV)
    ex = s.row_expert.to(DEV)
    g_ref = torch.zeros(s.R, I, device=DEV)
    u_ref = torch.zeros(s.R, I, device=DEV)
    for e in range(E):
        m = ex == e
        g_ref[m] = xs[m].float() @ wg[e].float().T
        u_ref[m] = xs[m].float() @ wu[e].float().T
    h_ref = torch.nn.functional.silu(g_ref) * u_ref
    assert rel_err(h[used], h_ref[used]) < 1e-2
    assert rel_err(gu[used, :I], g_ref[used]) < 1e-2
    dsts, ptrs = make_dsts(s, H)
    gemm.down_push(h, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, config=planned(gemm.KIND_DOWN, H, I))
    y_ref = torch.zeros(s.R, H, device=DEV)
    for e in range(E):
        m = ex == e
        y_ref[m] = h[m].float() @ wd[e].float().T
    check_pushed(s, dsts, y_ref.cpu(), H)


@needs_cuda
def test_gpu_backward_realistic():
    E, H, I = 8, 2048, 768
    s = big_sched(E, seed=1)
    dys = s.rows(H, seed=5)
    xs = s.rows(H, seed=6)
    gu = s.rows(2 * I, seed=7, scale=2.0)
    wg = rand(E, I, H, seed=8, scale=H ** -0.5)
    wu = rand(E, I, H, seed=9, scale=H ** -0.5)
    wd = rand(E, H, I, seed=10, scale=I ** -0.5)
    ws = torch.rand(s.R, device=DEV)
    ws[~s.real.to(DEV)] = 0
    dgrad_cfg = planned(gemm.KIND_DGRAD_SWIGLU, I, H)
    dgu, hw, dwp = gemm.down_dgrad_swiglu_bwd(dys, wd, gu, ws, s.tile_expert, s.num_tiles, config=dgrad_cfg)
    dw = gemm.reduce_dw(dwp)
    used = s.used_rows.to(DEV)
    ex = s.row_expert.to(DEV)
    dh_raw = torch.zeros(s.R, I, device=DEV)
    for e in range(E):
        m = ex == e
        dh_raw[m] = dys[m].float() @ wd[e].float()
    g, u = gu[:, :I].float(), gu[:, I:].float()
    sg = torch.sigmoid(g)
    hh = g * sg * u
    dh = dh_raw * ws[:, None]
    assert rel_err(dgu[used, :I], (dh * u * sg * (1 + g * (1 - sg)))[used]) < 1e-2
    assert rel_err(dgu[used, I:], (dh * g * sg)[used]) < 1e-2
    assert rel_err(hw[used], (hh * ws[:, None])[used]) < 1e-2
    assert rel_err(dw[used], (dh_raw * hh).sum(1)[used]) < 1e-2

    dsts, ptrs = make_dsts(s, H)
    gemm.gate_up_dgrad_push(dgu, wg, wu, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK,
                            config=planned(gemm.KIND_GATE_UP_DGRAD, H, 2 * I))
    dx_ref = torch.zeros(s.R, H, device=DEV)
    for e in range(E):
        m = ex == e
        dx_ref[m] = dgu[m, :I].float() @ wg[e].float() + dgu[m, I:].float() @ wu[e].float()
    check_pushed(s, dsts, dx_ref.cpu(), H)

    dwd = gemm.expert_wgrad(dys, hw, s.expert_start, s.expert_count, **planned_wgrad(I))
    dwg, dwu = gemm.expert_wgrad_gate_up(dgu, xs, s.expert_start, s.expert_count, **planned_wgrad(H))
    for e in range(E):
        st, c = s.start_list[e], s.counts[e]
        if c == 0:
            assert torch.all(dwd[e] == 0) and torch.all(dwg[e] == 0)
            continue
        assert rel_err(dwd[e], dys[st:st + c].float().T @ hw[st:st + c].float()) < 1e-2
        assert rel_err(dwg[e], dgu[st:st + c, :I].float().T @ xs[st:st + c].float()) < 1e-2
        assert rel_err(dwu[e], dgu[st:st + c, I:].float().T @ xs[st:st + c].float()) < 1e-2
    # determinism of the full backward chain
    dgu2, hw2, dwp2 = gemm.down_dgrad_swiglu_bwd(dys, wd, gu, ws, s.tile_expert, s.num_tiles, config=dgrad_cfg)
    assert torch.equal(dgu2[used], dgu[used]) and torch.equal(dwp2[used], dwp[used])
    assert torch.equal(gemm.expert_wgrad(dys, hw, s.expert_start, s.expert_count, **planned_wgrad(I)), dwd)


# --------------------------------------------------------------------------------------------
# Benchmark (python tests/test_gemm.py): TFLOP/s of each kernel on a qwen3-30b-a3b-like shape
# --------------------------------------------------------------------------------------------

def _bench(fn, iters=20):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=iters * 5)


def main_bench(E=64, H=2048, I=768, rows=65536, configs=None):
    torch.manual_seed(0)
    s = big_sched(E, rows=rows, W=2)
    real = s.counts
    n = sum(real)
    xs = s.rows(H, seed=1)
    wg = rand(E, I, H, seed=2, scale=H ** -0.5)
    wu = rand(E, I, H, seed=3, scale=H ** -0.5)
    wd = rand(E, H, I, seed=4, scale=I ** -0.5)
    ws = torch.rand(s.R, device=DEV)
    configs = {"gate_up": planned(gemm.KIND_GATE_UP, I, H), "down": planned(gemm.KIND_DOWN, H, I),
               "dgrad_swiglu": planned(gemm.KIND_DGRAD_SWIGLU, I, H),
               "gate_up_dgrad": planned(gemm.KIND_GATE_UP_DGRAD, H, 2 * I), **(configs or {})}
    h, gu = gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, save_gu=True, config=configs["gate_up"])
    dsts, ptrs = make_dsts(s, H)
    res = {}

    def rep(name, ms, flop):
        res[name] = flop / ms / 1e9
        print(f"{name:28s} {ms * 1e3:8.1f} us  {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)

    f2 = 2 * n * H * I
    rep("gate_up_swiglu", _bench(lambda: gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, h=h, gu=gu,
                                                               config=configs.get("gate_up"))), 2 * f2)
    rep("down_push", _bench(lambda: gemm.down_push(h, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK,
                                                   config=configs.get("down"))), f2)
    out = torch.empty(s.R, H, dtype=torch.bfloat16, device=DEV)
    rep("down_local", _bench(lambda: gemm.down_local(h, wd, s.tile_expert, s.num_tiles, out=out,
                                                     config=configs.get("down"))), f2)
    dgu, hw, dwp = gemm.down_dgrad_swiglu_bwd(xs, wd, gu, ws, s.tile_expert, s.num_tiles,
                                              config=configs["dgrad_swiglu"])
    rep("down_dgrad_swiglu_bwd", _bench(lambda: gemm.down_dgrad_swiglu_bwd(
        xs, wd, gu, ws, s.tile_expert, s.num_tiles, dgu=dgu, hw=hw, dw_part=dwp,
        config=configs.get("dgrad_swiglu"))), f2)
    rep("gate_up_dgrad_local", _bench(lambda: gemm.gate_up_dgrad_local(
        dgu, wg, wu, s.tile_expert, s.num_tiles, out=out, config=configs.get("gate_up_dgrad"))), 2 * f2)
    rep("gate_up_dgrad_push", _bench(lambda: gemm.gate_up_dgrad_push(
        dgu, wg, wu, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, config=configs.get("gate_up_dgrad"))), 2 * f2)
    dwd = torch.empty(E, H, I, dtype=torch.bfloat16, device=DEV)
    wgd, wgu = planned_wgrad(I), planned_wgrad(H)
    if "wgrad" in configs:
        wgd["config"] = wgu["config"] = configs["wgrad"]
    rep("wgrad down", _bench(lambda: gemm.expert_wgrad(xs, hw, s.expert_start, s.expert_count, out=dwd, **wgd)), f2)
    dwg = torch.empty(E, I, H, dtype=torch.bfloat16, device=DEV)
    dwu = torch.empty(E, I, H, dtype=torch.bfloat16, device=DEV)
    rep("wgrad gate_up", _bench(lambda: gemm.expert_wgrad_gate_up(dgu, xs, s.expert_start, s.expert_count,
                                                                   out_gate=dwg, out_up=dwu, **wgu)), 2 * f2)
    # anchor: torch._grouped_mm on the same rows
    offs = torch.tensor(s.start_list[1:], dtype=torch.int32, device=DEV)
    xa = xs[:s.used]
    if hasattr(torch, "_grouped_mm"):
        wgt = wg.transpose(1, 2)
        rep("anchor _grouped_mm gate", _bench(lambda: torch._grouped_mm(xa, wgt, offs=offs)), f2)
    rep("anchor dense mm", _bench(lambda: xa @ wg[0].T.contiguous()), 2 * xa.shape[0] * H * I)
    return res


if __name__ == "__main__":
    import sys
    shapes = {"qwen3-30b": dict(E=64, H=2048, I=768, rows=65536),  # EP2, 16384 tokens per GPU, k=8
              "gpt-oss-120b": dict(E=64, H=2880, I=2880, rows=32768)}  # EP2, 16384 tokens per GPU, k=4
    for name in sys.argv[1:] or list(shapes):
        print(f"--- {name} {shapes[name]}", flush=True)
        main_bench(**shapes[name])
