"""The warp-specialized bf16 GEMMs (tabby/ops/gemm/bf16_ws.py) on a GPU against bf16.py's Triton
kernels (the same wgmma sums over K in order: bitwise equal expected) and plain torch fp32, for
each form the layer runs: gate/up with the SwiGLU, the down projection's rows stored and pushed;
through the entry points with the plan's kernel choice, and a ws choice where the Triton kernel
must run (the dgrads) refused. Odd K (a partial last block), N not a multiple of the tile, empty experts, all
rows on one expert, unused tiles, schedule tiles of 256 rows, two ring depths and a grid smaller
than the tiles (persistent); 20 repeats bitwise. Its sm_90a code: test_gemm_ws_compile.py."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from tabby.functional import heuristics  # noqa: E402
from tabby.ops.gemm import bf16 as gemm, bf16_ws as ws  # noqa: E402

from test_gemm import Sched, check_pushed, make_dsts, per_row_ref, rand, rel_err  # noqa: E402

# (rows per expert, K, N): the last two K not multiples of 64, N not of 256
CASES = [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1040, 384), ([512] * 6, 2048, 1024),
         ([40, 0, 0, 900], 7168, 128), ([77, 500, 3], 2880, 328)]
RING = [(256, 4, None), (256, 3, 5), (128, 4, None)]  # (tile_n, stages, grid)


def _cfg(kind, N, K, BM=128):
    return heuristics.gemm_config(kind, N, K, BM)


def _ws_rows(a, b, s, epilogue, epi, tile_n, stages, grid, BM=128):
    assert ws.fits(a, b, sched_bm=BM)
    ws.rows_launch(a, b, s.tile_expert, s.num_tiles, BM, epilogue, epi, tile_n=tile_n, stages=stages, grid=grid)


@pytest.mark.parametrize("counts,K,N", CASES)
@pytest.mark.parametrize("tile_n,stages,grid", RING)
@pytest.mark.parametrize("BM", [128, 256])
def test_store_and_push_k_major(counts, K, N, tile_n, stages, grid, BM):
    """The forward's down (B [E, N, K]): stored rows and pushed rows, bitwise the Triton kernel's."""
    s = Sched(counts, BM, W=3, TK=(sum(counts) + 2) // 3 + 1, seed=K)
    a = s.rows(K, seed=K + 1)
    b = rand(s.E, N, K, seed=K + 2, scale=K ** -0.5)
    want = gemm.rows_gemm(a, b, s.tile_expert, s.num_tiles, config=_cfg(gemm.KIND_DOWN, N, K, BM))
    got = torch.full((s.R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    _ws_rows(a, b, s, ws.EPI_STORE, (got, got.stride(0)), tile_n, stages, grid, BM)
    used = s.used_rows.cuda()
    assert torch.equal(got[used], want[used])
    assert torch.all(got[~used].isnan()), "unused tiles must not be written"
    ref = per_row_ref(s, a, lambda e, x: x @ b[e].float().cpu().T)
    assert rel_err(got[used], ref[s.used_rows]) < 1e-2
    dsts, ptrs = make_dsts(s, N)
    _ws_rows(a, b, s, ws.EPI_PUSH, (s.row_src, ptrs, s.TK, N, ptrs.view(torch.bfloat16)), tile_n, stages, grid, BM)
    check_pushed(s, dsts, ref, N)
    want_d, want_ptrs = make_dsts(s, N)
    gemm.down_push(a, b, s.tile_expert, s.num_tiles, s.row_src, want_ptrs, s.TK, config=_cfg(gemm.KIND_DOWN, N, K, BM))
    for x, y in zip(dsts, want_d):
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))


@pytest.mark.parametrize("counts,K,N", CASES)
@pytest.mark.parametrize("stages,grid", [(4, None), (3, 7)])
@pytest.mark.parametrize("save_gu", [True, False])
def test_gate_up_swiglu(counts, K, N, stages, grid, save_gu):
    """gate/up + SwiGLU (W [E, I, H], H = K, I = N): h and g | u bitwise the Triton kernel's."""
    H, I = K, N
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=H + I)
    xs = s.rows(H, seed=H + 9)
    wg = rand(s.E, I, H, seed=H + 10, scale=H ** -0.5)
    wu = rand(s.E, I, H, seed=H + 11, scale=H ** -0.5)
    want_h, want_gu = gemm.gate_up_swiglu(xs, wg, wu, s.tile_expert, s.num_tiles, save_gu=True,
                                          config=_cfg(gemm.KIND_GATE_UP, I, H))
    h = torch.full((s.R, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    gu = torch.full((s.R, 2 * I), float("nan"), dtype=torch.bfloat16, device="cuda") if save_gu else None
    assert ws.fits(xs, wg, wu, sched_bm=128)
    ws.gate_up_swiglu_ws(xs, wg, wu, s.tile_expert, s.num_tiles, h, gu, sched_bm=128, stages=stages, grid=grid)
    used = s.used_rows.cuda()
    assert torch.equal(h[used], want_h[used])
    assert torch.all(h[~used].isnan())
    if save_gu:
        assert torch.equal(gu[used], want_gu[used])
    g = per_row_ref(s, xs, lambda e, x: x @ wg[e].float().cpu().T)
    u = per_row_ref(s, xs, lambda e, x: x @ wu[e].float().cpu().T)
    assert rel_err(h[used], (torch.nn.functional.silu(g) * u)[s.used_rows]) < 1e-2


def test_repeat_bitwise():
    """20 calls of each kernel on one input: the same bits (no atomics, a fixed K order)."""
    counts, K, N = [77, 500, 3, 0, 1024], 2880, 328
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=1)
    a = s.rows(K, seed=2)
    b = rand(s.E, N, K, seed=3, scale=K ** -0.5)
    outs = []
    for _ in range(20):
        out = torch.zeros(s.R, N, dtype=torch.bfloat16, device="cuda")
        _ws_rows(a, b, s, ws.EPI_STORE, (out, out.stride(0)), 256, 4, None)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    hs = []
    for _ in range(20):
        h = torch.zeros(s.R, N, dtype=torch.bfloat16, device="cuda")
        ws.gate_up_swiglu_ws(a, b, b, s.tile_expert, s.num_tiles, h, None, sched_bm=128, stages=4)
        hs.append(h)
    assert all(torch.equal(h, hs[0]) for h in hs)


def test_entry_points_run_the_plans_kernels():
    """The entry points with the plan's ``Bf16Gemm``: gate/up and down on the ws kernel bitwise the
    Triton tiles' results; the dgrads' entry points refuse a ws choice (their kernel is bf16.py's)."""
    counts, K, N = [300, 0, 128, 5], 1040, 384
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=5)
    x = s.rows(K, seed=6)
    w = rand(s.E, N, K, seed=7, scale=K ** -0.5)
    wd = rand(s.E, K, N, seed=8, scale=N ** -0.5)
    choice = {kind: heuristics.bf16_gemm(kind, n, k, 128, True, None)
              for kind, n, k in ((gemm.KIND_GATE_UP, N, K), (gemm.KIND_DOWN, K, N))}
    assert {c.core for c in choice.values()} == {gemm.CORE_WS}
    used = s.used_rows.cuda()
    h = gemm.gate_up_swiglu(x, w, w, s.tile_expert, s.num_tiles, config=choice[gemm.KIND_GATE_UP])
    want_h = gemm.gate_up_swiglu(x, w, w, s.tile_expert, s.num_tiles, config=_cfg(gemm.KIND_GATE_UP, N, K))
    assert torch.equal(h[used], want_h[used])
    y = gemm.down_local(h, wd, s.tile_expert, s.num_tiles, config=choice[gemm.KIND_DOWN])
    want_y = gemm.down_local(h, wd, s.tile_expert, s.num_tiles, config=_cfg(gemm.KIND_DOWN, K, N))
    assert torch.equal(y[used], want_y[used])
    ws_dgrad = gemm.Bf16Gemm(gemm.CORE_WS, _cfg(gemm.KIND_DGRAD_SWIGLU, N, K))
    with pytest.raises(ValueError, match="one K phase"):
        gemm.gate_up_dgrad_local(torch.cat([h, h], 1), w, w, s.tile_expert, s.num_tiles, config=ws_dgrad)


WGRAD_CASES = [([300, 0, 128, 5], 256, 384), ([129, 1, 700], 1040, 328), ([0, 0, 900, 64], 2048, 768),
               ([77, 500, 3], 2880, 2880)]  # (rows per expert, M, N): empty, single-row, 64-row experts


@pytest.mark.parametrize("counts,M,N", WGRAD_CASES)
@pytest.mark.parametrize("stages,grid", [(4, None), (3, 5), (2, 1)])
def test_expert_wgrad(counts, M, N, stages, grid):
    """C[e] = A_seg^T B_seg, one and two pairs, against bf16.py's Triton kernel and fp32 torch; the
    padding rows NaN in both operands (the kernel zeroes a partial block's rows: nothing leaks),
    experts without rows zeros, a grid of one program and grids smaller than the tiles."""
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=M + N)
    pad = ~s.real.cuda()
    a, a2, b = s.rows(M, seed=M + 1), s.rows(M, seed=M + 2), s.rows(N, seed=M + 3)
    for t in (a, a2, b):
        t[pad] = float("nan")
    E = s.E
    cfg = heuristics.wgrad_config(N)
    want = gemm.expert_wgrad(a.nan_to_num(0.0), b.nan_to_num(0.0), s.expert_start, s.expert_count, config=cfg,
                             programs=8)
    outs = [torch.full((E, M, N), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    ws.expert_wgrad_ws([a], b, s.expert_start, s.expert_count, outs[:1], stages=stages, grid=grid)
    torch.testing.assert_close(outs[0], want, rtol=1e-2, atol=1e-3 * want.abs().max().item())
    ref = torch.stack([a[st:st + c].float().T @ b[st:st + c].float() if c else torch.zeros(M, N, device="cuda")
                       for st, c in zip(s.start_list, counts)])
    assert rel_err(outs[0], ref) < 1e-2
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(outs[0][e] == 0)
    one_pair = outs[0].clone()
    outs[0].fill_(float("nan"))
    ws.expert_wgrad_ws([a, a2], b, s.expert_start, s.expert_count, outs, stages=stages, grid=grid)
    assert torch.equal(outs[0], one_pair)  # a pair's tiles the same sums with a second pair beside
    ref2 = torch.stack([a2[st:st + c].float().T @ b[st:st + c].float() if c else torch.zeros(M, N, device="cuda")
                        for st, c in zip(s.start_list, counts)])
    assert rel_err(outs[1], ref2) < 1e-2 and not outs[1].isnan().any()
    again = [torch.empty_like(o) for o in outs]
    for _ in range(5):
        ws.expert_wgrad_ws([a, a2], b, s.expert_start, s.expert_count, again, stages=stages, grid=grid)
        assert all(torch.equal(x, y) for x, y in zip(again, outs))


# (rows per expert, H, I): empty and one-row experts, I not a multiple of the 128-column tile (H and I
# multiples of 64: the transposed weights' K blocks)
LAYOUT_CASES = [([300, 0, 128, 5], 256, 384), ([129, 1, 700], 1024, 320), ([77, 500, 3], 2880, 2880)]


@pytest.mark.parametrize("counts,H,I", LAYOUT_CASES)
def test_weights_read_as_they_lie(counts, H, I):
    """gate/up and down on the weights as transformers stores them, against the Triton kernels (same
    sums; gate/up with biases starts its products from them, so there within rounding): Tabby's
    layout as halves of one gate_up [E, 2I, H] bitwise as contiguous weights; transposed ("kn")
    and interleaved ("kn-paired") [E, H, 2I] with biases (column stride 1, 2); relu2 (w_up
    alone); the down projection on a transposed down_proj [E, I, H] with its bias."""
    from tabby.activation import Activation

    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=H + I)
    x = s.rows(H, seed=1)
    wg, wu = rand(s.E, I, H, seed=2, scale=H ** -0.5), rand(s.E, I, H, seed=3, scale=H ** -0.5)
    bg, bu = rand(s.E, I, seed=4, scale=0.5), rand(s.E, I, seed=5, scale=0.5)
    used = s.used_rows.cuda()
    gpt = Activation("gpt-oss", limit=7.0, alpha=1.702)

    def run(w_gate, w_up, biases=None, act=gpt, core=True):
        h = torch.full((s.R, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        gu = torch.full((s.R, 2 * I), float("nan"), dtype=torch.bfloat16, device="cuda")
        if core:
            ws.gate_up_swiglu_ws(x, w_gate, w_up, s.tile_expert, s.num_tiles, h, gu, sched_bm=128, stages=4, act=act,
                                 layout=gemm.gate_up_layout(w_gate, w_up), biases=biases)
        else:
            gemm.gate_up_swiglu(x, w_gate, w_up, s.tile_expert, s.num_tiles, h=h, gu=gu, act=act, biases=biases,
                                config=_cfg(gemm.KIND_GATE_UP, I, H))
        return h[used], gu[used]

    base = run(wg, wu)
    fused = torch.cat([wg, wu], 1)  # [E, 2I, H]: each half's experts 2I rows apart
    assert all(torch.equal(a, b) for a, b in zip(run(*fused.unflatten(1, (2, I)).unbind(1)), base))
    want = run(wg, wu, (bg, bu), core=False)
    kn = fused.transpose(1, 2).contiguous()  # [E, H, 2I]
    paired = torch.stack([wg, wu], 2).flatten(1, 2).transpose(1, 2).contiguous()
    b_paired = torch.stack([bg, bu], 2).flatten(1, 2).contiguous()
    for w_gate, w_up, biases in ((wg, wu, (bg, bu)),
                                 (*(w.transpose(1, 2) for w in kn.unflatten(2, (2, I)).unbind(2)), (bg, bu)),
                                 (*(w.transpose(1, 2) for w in paired.unflatten(2, (I, 2)).unbind(3)),
                                  tuple(b_paired.unflatten(1, (I, 2)).unbind(2)))):
        got = run(w_gate, w_up, biases)
        assert all(rel_err(a, b) < 5e-3 for a, b in zip(got, want)), gemm.gate_up_layout(w_gate, w_up)
    relu2 = Activation("relu2")
    h, gu = run(wu, wu, act=relu2)
    h_t, gu_t = run(wu, wu, act=relu2, core=False)
    assert rel_err(h, h_t) < 5e-3 and rel_err(gu[:, I:], gu_t[:, I:]) < 5e-3
    # the down projection: a transposed down_proj [E, I, H] read in place, + b_down
    hin = s.rows(I, seed=6)
    down_proj = rand(s.E, I, H, seed=7, scale=I ** -0.5)
    bd = rand(s.E, H, seed=8, scale=0.5)
    wd = down_proj.transpose(1, 2)  # [E, H, I], unit stride along H
    choice = heuristics.bf16_gemm(gemm.KIND_DOWN, H, I, 128, True, None)
    for bias in (None, bd):
        dsts, ptrs = make_dsts(s, H)
        gemm.down_push(hin, wd, s.tile_expert, s.num_tiles, s.row_src, ptrs, s.TK, config=choice, bias=bias)
        want_d, want_ptrs = make_dsts(s, H)
        gemm.down_push(hin, wd, s.tile_expert, s.num_tiles, s.row_src, want_ptrs, s.TK, bias=bias,
                       config=_cfg(gemm.KIND_DOWN, H, I))
        for a, b in zip(dsts, want_d):
            assert rel_err(a.nan_to_num(7.0), b.nan_to_num(7.0)) < 5e-3


DGRAD_CASES = [([300, 0, 128, 5], 256, 256), ([129, 1, 700], 1024, 384), ([40, 0, 0, 900], 7168, 200),
               ([77, 500, 3], 2880, 2880)]  # (rows per expert, H, I): I not a multiple of 128, empty experts


@pytest.mark.parametrize("counts,H,I", DGRAD_CASES)
@pytest.mark.parametrize("act", ["swiglu", "gpt-oss", "gpt-oss-paired", "relu2"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tile_n,stages,epi_cols,grid,prefetch", [
    (128, 4, None, None, False), (128, 4, None, None, True), (128, 2, 8, 1, True), (256, 3, None, None, False),
    (256, 3, None, None, True), (256, 2, 8, 3, True)])
def test_down_dgrad_with_epilogue_partition(counts, H, I, act, transposed, tile_n, stages, epi_cols, grid, prefetch):
    """The down dgrad + activation backward on bf16_ws's kernel (its epilogue partition) against
    bf16.py's Triton kernel: dgu and hw within one bf16 rounding, dw summed in another order (and,
    at 256 columns, from dh_raw rounded to bf16); Wd as Tabby's [E, H, I] and as a transposed
    down_proj [E, I, H] read in place; unused rows untouched; grids of one and three programs (the
    handoff's phases over many tiles); g, u loaded in turn and prefetched; 3 repeats bitwise."""
    from tabby.activation import Activation

    paired = act.endswith("-paired")  # dg, du interleaved (gpt-oss's gate_up_proj order)
    a = {"swiglu": Activation(), "gpt-oss": Activation("gpt-oss", limit=7.0, alpha=1.702),
         "relu2": Activation("relu2")}[act.removesuffix("-paired")]
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=H + I)
    dys = s.rows(H, seed=H)
    gu = s.rows(2 * I, seed=H + 1, scale=2.0)
    wd = rand(s.E, H, I, seed=H + 2, scale=I ** -0.5)
    if transposed:
        wd = wd.transpose(1, 2).contiguous().transpose(1, 2)  # a down_proj [E, I, H] seen as [E, H, I]
    wts = torch.rand(s.R, device="cuda")
    used = s.used_rows.cuda()
    wts[~used] = 0
    want = gemm.down_dgrad_swiglu_bwd(dys, wd, gu, wts, s.tile_expert, s.num_tiles, act=a, dgu_paired=paired,
                                      config=_cfg(gemm.KIND_DGRAD_SWIGLU, I, H))
    outs = []
    for _ in range(3):
        nan = float("nan")
        dgu = torch.full((s.R, 2 * I), nan, dtype=torch.bfloat16, device="cuda")
        hw = torch.full((s.R, I), nan, dtype=torch.bfloat16, device="cuda")
        dwp = torch.full((s.R, -(-I // tile_n)), nan, dtype=torch.float32, device="cuda")
        ws.down_dgrad_ws(dys, wd, gu, wts, s.tile_expert, s.num_tiles, dgu, hw, dwp, sched_bm=128, stages=stages,
                         tile_n=tile_n, epi_cols=epi_cols, grid=grid, act=a, dgu_paired=paired, prefetch=prefetch)
        outs.append((dgu, hw, dwp))
    dgu, hw, dwp = outs[0]
    cols = slice(I, 2 * I) if not a.gated else slice(0, 2 * I)
    assert rel_err(dgu[used][:, cols], want[0][used][:, cols]) < 1e-2
    assert rel_err(hw[used], want[1][used]) < 1e-2
    assert rel_err(gemm.reduce_dw(dwp)[used], gemm.reduce_dw(want[2])[used]) < (1e-4 if tile_n == 128 else 1e-2)
    assert torch.all(dgu[~used].isnan()) and torch.all(hw[~used].isnan()), "unused tiles must not be written"
    for o in outs[1:]:  # (ungated: dgu's g columns unwritten, NaN in every run)
        assert torch.equal(o[0][used][:, cols], dgu[used][:, cols])
        assert torch.equal(o[1][used], hw[used]) and torch.equal(o[2][used], dwp[used])


@pytest.mark.parametrize("counts,K,N", CASES)
@pytest.mark.parametrize("form", ["swiglu", "gpt-oss", "gpt-oss-kn-bias", "gpt-oss-paired-bias", "relu2",
                                  "swiglu-bias"])
@pytest.mark.parametrize("stages,epi_cols,grid", [(3, 16, None), (2, 32, 3)])
def test_gate_up_with_epilogue_partition(counts, K, N, form, stages, epi_cols, grid):
    """Gate/up on the epilogue partition's kernel (``handoff``) against the kernel without it: g, u
    bitwise, h within a rounding (the activation of the rounded g, u); unused rows untouched;
    repeats bitwise."""
    from tabby.activation import Activation
    from tabby.validate import LAYOUT_KN, LAYOUT_KN_PAIRED, LAYOUT_NK

    gpt = Activation("gpt-oss", limit=7.0, alpha=1.702)
    act = {"gpt-oss": gpt, "gpt-oss-kn-bias": gpt, "gpt-oss-paired-bias": gpt, "relu2": Activation("relu2")}.get(
        form, Activation())
    layout = LAYOUT_KN if "kn" in form else LAYOUT_KN_PAIRED if "paired" in form else LAYOUT_NK
    if layout != LAYOUT_NK and K % 64:
        pytest.skip("transposed weights need H a multiple of 64")
    s = Sched(counts, 128, W=1, TK=sum(counts) + 1, seed=K + N)
    x = s.rows(K, seed=K)
    wg = rand(s.E, N, K, seed=K + 1, scale=K ** -0.5)
    wu = rand(s.E, N, K, seed=K + 2, scale=K ** -0.5)
    biases = None
    if "bias" in form:
        biases = (rand(s.E, N, seed=K + 3, scale=0.5), rand(s.E, N, seed=K + 4, scale=0.5))
    if layout == LAYOUT_KN:
        wg, wu = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (wg, wu))
    elif layout == LAYOUT_KN_PAIRED:  # gpt-oss's gate_up_proj [E, H, 2I] and gate_up_proj_bias [E, 2I] as stored
        paired = torch.stack([wg, wu], 2).flatten(1, 2).transpose(1, 2).contiguous()
        wg, wu = (w.transpose(1, 2) for w in paired.unflatten(2, (N, 2)).unbind(3))
        biases = tuple(torch.stack(biases, 2).flatten(1, 2).contiguous().unflatten(1, (N, 2)).unbind(2))
    used = s.used_rows.cuda()

    def run(handoff):
        h = torch.full((s.R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        gu = torch.full((s.R, 2 * N), float("nan"), dtype=torch.bfloat16, device="cuda")
        kw = dict(handoff=True, epi_cols=epi_cols) if handoff else {}
        ws.gate_up_swiglu_ws(x, wg, wu, s.tile_expert, s.num_tiles, h, gu, sched_bm=128, stages=stages, grid=grid,
                             act=act, layout=layout, biases=biases, **kw)
        return h, gu

    want_h, want_gu = run(False)
    outs = [run(True) for _ in range(3)]
    h, gu = outs[0]
    cols = slice(0, 2 * N) if act.gated else slice(N, 2 * N)
    assert torch.equal(gu[used][:, cols], want_gu[used][:, cols])
    assert rel_err(h[used], want_h[used]) < 1e-2
    g_r, u_r = gu[used][:, :N].float(), gu[used][:, N:].float()
    from tabby.activation import apply
    assert rel_err(h[used], apply(g_r if act.gated else u_r, u_r, act).cpu()) < 1e-2
    assert torch.all(h[~used].isnan()) and torch.all(gu[~used].isnan()), "unused tiles must not be written"
    for o in outs[1:]:
        assert torch.equal(o[0][used], h[used]) and torch.equal(o[1][used], gu[used])
