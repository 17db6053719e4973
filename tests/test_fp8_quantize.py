"""FP8 quantization: the plain PyTorch definition (tabby/reference_fp8.py) and the Triton kernels
(tabby/ops/quantize.py), which must agree with it bit for bit. Runs under the interpreter on the CPU
and compiled on a GPU."""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tabby import reference_fp8 as ref  # noqa: E402
from tabby.ops import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def same(a, b):
    """Bitwise equality of two tensors (E4M3 or fp32)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b.cpu()))


def e4m3_values():
    """Every finite E4M3 value, fp32 [254]."""
    v = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return v[~torch.isnan(v)]


def mixed_rows(T, K, seed, dtype=torch.float32):
    """Rows of random magnitudes: per 1x128 tile a different binade (2^-40 .. 2^40), some zero tiles."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    nk = math.ceil(K / 128)
    mag = torch.randint(-40, 41, (T, nk), generator=g).float().exp2()
    x = x * mag.repeat_interleave(128, 1)[:, :K]
    x[torch.rand(T, nk, generator=g).repeat_interleave(128, 1)[:, :K] < 0.1] = 0.0
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# The definition
# --------------------------------------------------------------------------------------------

def test_scale_exponent_is_the_smallest_power_of_two_that_fits():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.rand(2000, generator=g) * torch.randint(-140, 120, (2000,), generator=g).float().exp2(),
                      torch.tensor([0.0, 448.0, 448.00003, 447.99997, 224.0, 896.0, 1e-45, 2.0 ** -126 * 448,
                                    3.0e38])])
    j = ref.scale_exponent(amax)
    a64 = amax.double()
    for jj, a in zip(j.tolist(), a64.tolist()):
        assert jj >= -126
        assert a <= 448.0 * 2.0 ** jj
        if jj > -126:
            assert a > 448.0 * 2.0 ** (jj - 1), (a, jj)


def test_reference_quantization_is_one_rounding_to_nearest_even():
    """Tiles whose scale is 1 (amax in (224, 448]): q is the E4M3 rounding of x itself, including
    ties (midpoints of neighbouring E4M3 values go to the even one)."""
    v = e4m3_values()
    pos = v[v > 0].sort().values
    mids = (pos[:-1] + pos[1:]) / 2  # exact in fp32
    x = torch.cat([mids, -mids, pos, torch.tensor([0.0, 2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), 448.0), x], dim=1)
    q, s = ref.quantize_rows_ref(x)
    assert torch.equal(s, torch.ones_like(s))
    assert same(q, x.to(E4M3))
    # ties to even: the E4M3 encoding of a tie's result has an even last bit
    qm, _ = ref.quantize_rows_ref(torch.cat([torch.full((1, 1), 448.0), mids[None, :127]], dim=1))
    assert (bits(qm)[0, 1:] & 1 == 0).all()


def test_reference_round_trip():
    x = mixed_rows(9, 300, seed=1)
    q, s = ref.quantize_rows_ref(x)
    d = ref.dequantize_rows_ref(q, s)
    # dequantized values survive a second quantization exactly (the scales are exact; a tile
    # whose largest value rounded down to 224 gets half the scale and twice the values)
    q2, s2 = ref.quantize_rows_ref(d)
    assert torch.equal(ref.dequantize_rows_ref(q2, s2), d)
    assert same(q2, q) == bool((s2 == s).all())
    # each tile's largest magnitude lands in [224, 448] (224: (224, 232) rounds down to it)
    tile_max = torch.nn.functional.pad(q.float().abs(), (0, 384 - 300)).view(9, 3, 128).amax(-1)
    nonzero = tile_max > 0
    assert ((tile_max[nonzero] >= 224) & (tile_max[nonzero] <= 448)).all()
    # relative error of E4M3 rounding: at most 2^-4 for values in E4M3's normal range
    big = q.float().abs() >= 2.0 ** -6
    err = (d - x).abs()[big] / x.abs()[big]
    assert err.max() <= 2.0 ** -4


@pytest.mark.parametrize("kind", ["rows", "cols", "blocks"])
def test_reference_partial_tiles_are_the_zero_padded_tiles(kind):
    """Where 128 does not divide a dimension (272 = 2 x 128 + 16, 144 = 128 + 16), quantizing is
    quantizing the tensor zero-padded to whole tiles and cropping: the same values and scales (the
    last tile's scale is its own elements' amax), the padding quantized to zeros."""
    quant, deq = {"rows": (ref.quantize_rows_ref, ref.dequantize_rows_ref),
                  "cols": (ref.quantize_cols_ref, ref.dequantize_cols_ref),
                  "blocks": (ref.quantize_blocks_ref, ref.dequantize_blocks_ref)}[kind]
    x = mixed_rows(272, 144, seed=7)
    x[:, 128:] *= 2.0 ** -20  # the partial tiles far below the others: a scale of their own
    q, s = quant(x)
    qp, sp = quant(torch.nn.functional.pad(x, (0, 256 - 144, 0, 384 - 272)))
    assert same(q, qp[:272, :144].contiguous()) and same(s, sp[:s.shape[0], :s.shape[1]].contiguous())
    assert bool((qp[272:].float() == 0).all()) and bool((qp[:, 144:].float() == 0).all())
    # the partial tiles' scales are their own amax's (not the neighbouring whole tiles')
    if kind != "cols":
        amax = x[:, 128:].abs().amax(1) if kind == "rows" else x[:128, 128:].abs().amax()[None]
        want = ref.exp2_int(ref.scale_exponent(amax))
        assert torch.equal(s[:, 1] if kind == "rows" else s[0, 1][None], want)
    # round trip: the dequantized values quantize to themselves, bit for bit
    q2, s2 = quant(deq(q, s))
    assert torch.equal(deq(q2, s2), deq(q, s))


# --------------------------------------------------------------------------------------------
# The kernels against the definition
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,K,dtype", [(1, 128, torch.bfloat16), (7, 200, torch.float32), (33, 256, torch.bfloat16),
                                       (40, 64, torch.float32), (9, 272, torch.bfloat16), (5, 144, torch.float32)])
def test_quantize_rows_matches_reference(T, K, dtype):
    x = mixed_rows(T, K, seed=T + K, dtype=dtype)
    if dtype == torch.float32:  # fp32 extremes: huge, fp32 subnormals
        x[0, :3] = torch.tensor([3.0e38, -1.0e-40, 1.0e-45])
    x[-1] = 0.0  # a zero row
    q, s = quantize.quantize_rows(x.to(DEV))
    rq, rs = ref.quantize_rows_ref(x)
    assert same(q, rq) and same(s, rs)
    if dtype == torch.float32:
        assert s[-1].eq(2.0 ** -126).all()  # the floor


def test_quantize_rows_every_e4m3_value_and_tie():
    """Scale-1 tiles: the kernel's rounding (the interpreter's own, or the hardware's) against torch's."""
    v = e4m3_values()
    pos = v[v > 0].sort().values
    mids = (pos[:-1] + pos[1:]) / 2
    quarter = pos[:-1] + (pos[1:] - pos[:-1]) / 4
    x = torch.cat([mids, -mids, pos, -pos, quarter, -quarter * 0.999])
    x = torch.cat([x, torch.zeros((-x.numel()) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), -448.0), x], dim=1)
    q, s = quantize.quantize_rows(x.to(DEV))
    assert same(q, x.to(E4M3)) and bool((s == 1).all())


def test_quantize_rows_gated_by_num_tiles():
    x = mixed_rows(256, 128, seed=3, dtype=torch.bfloat16).to(DEV)
    q = torch.zeros(256, 128, dtype=E4M3, device=DEV)
    s = torch.full((256, 1), -1.0, device=DEV)
    quantize.quantize_rows(x, num_tiles=torch.tensor([1], dtype=torch.int32, device=DEV), tile_rows=128, out=q,
                      scale_out=s)
    rq, rs = ref.quantize_rows_ref(x[:128].cpu())
    assert same(q[:128], rq) and same(s[:128], rs)
    assert bool((s[128:] == -1).all()) and bool((q[128:].view(torch.uint8) == 0).all())


@pytest.mark.parametrize("shape", [(2, 200, 130), (1, 128, 128), (3, 64, 256), (129, 40), (2, 144, 272),
                                   (2, 272, 144)])
def test_quantize_blocks_matches_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * torch.randint(-20, 20, shape[:-2] + (1, 1), generator=g).float().exp2()
    w = w.to(torch.bfloat16)
    if len(shape) == 3:
        w[0, :128, :128] = 0.0  # a zero block
    q, s = quantize.quantize_blocks(w.to(DEV))
    rq, rs = ref.quantize_blocks_ref(w)
    assert same(q, rq) and same(s, rs)
    # both orientations from one read: the transposed values into a wider buffer's view (as the
    # gate/up dgrad's [W_gate^T | W_up^T]), its other bytes untouched
    N, K = shape[-2:]
    wide = torch.full(shape[:-2] + (K, N + 48), 0x7E, dtype=torch.uint8, device=DEV)
    q2, s2 = quantize.quantize_blocks(w.to(DEV), out_t=wide[..., 16:16 + N].view(quantize.E4M3))
    assert same(q2, rq) and same(s2, rs)
    assert same(wide[..., 16:16 + N].view(quantize.E4M3), rq.transpose(-2, -1))
    assert bool((wide[..., :16] == 0x7E).all()) and bool((wide[..., 16 + N:] == 0x7E).all())
    # round trip: the same values; the same bits unless a block's amax rounded down to 224 * 2^j
    # (it then takes half the scale and twice the values)
    q2, s2 = ref.quantize_blocks_ref(ref.dequantize_blocks_ref(rq, rs))
    assert torch.equal(ref.dequantize_blocks_ref(q2, s2), ref.dequantize_blocks_ref(rq, rs))
    assert same(q2, rq) == same(s2, rs)


@pytest.mark.parametrize("T,K", [(9, 272), (300, 144)])
def test_kernel_round_trips_with_partial_tiles(T, K):
    """Kernels on values the recipe already represents (dequantized): the same values and scales back,
    partial tiles included (rows per 1x128, blocks per 128x128, columns per 128x1 over T rows)."""
    x = mixed_rows(T, K, seed=T * K)
    q, s = quantize.quantize_rows(x.to(DEV))
    d = ref.dequantize_rows_ref(q.cpu(), s.cpu())
    q2, s2 = quantize.quantize_rows(d.to(DEV))
    assert torch.equal(ref.dequantize_rows_ref(q2.cpu(), s2.cpu()), d)
    rq, rs = ref.quantize_rows_ref(d)
    assert same(q2, rq) and same(s2, rs)
    w = x.to(torch.bfloat16)[None]
    bq, bs = quantize.quantize_blocks(w.to(DEV))
    rq, rs = ref.quantize_blocks_ref(w)
    assert same(bq, rq) and same(bs, rs)
    bq2, bs2 = quantize.quantize_blocks(ref.dequantize_blocks_ref(rq, rs).to(DEV))
    assert torch.equal(ref.dequantize_blocks_ref(bq2.cpu(), bs2.cpu()), ref.dequantize_blocks_ref(rq, rs))
    cq, cs = quantize.quantize_cols(x.to(DEV))
    rq, rs = ref.quantize_cols_ref(x)
    assert same(cq.cpu().t().contiguous(), rq) and same(cs, rs)


@pytest.mark.parametrize("R,C", [(300, 272), (256, 128)])
def test_quantize_cols_of_quantized_rows(R, C):
    """Columns (128x1) of rows already quantized per 1x128 (E4M3 + row scales): the definition's
    columns of the dequantized rows, bit for bit; padding rows (row_src < 0) and rows past the used
    tiles count as, and are stored as, zeros."""
    rq, rs = ref.quantize_rows_ref(mixed_rows(R, C, seed=R + C))
    row_src = torch.arange(R, dtype=torch.int32)
    row_src[5:9] = -1
    num_tiles = torch.tensor([R // 128], dtype=torch.int32)  # rows past the last full 128-row tile unused
    q, s = quantize.quantize_cols(rq.to(DEV), row_scale=rs.to(DEV), row_src=row_src.to(DEV), num_tiles=num_tiles.to(DEV),
                             tile_rows=128)
    d = ref.dequantize_rows_ref(rq, rs)
    d[5:9] = 0
    d[(R // 128) * 128:] = 0
    wq, ws_ = ref.quantize_cols_ref(d)
    assert same(q.cpu().t().contiguous(), wq) and same(s, ws_)


@pytest.mark.parametrize("R,C,tile_rows", [(300, 272, 128), (384, 256, 128), (600, 384, 256)])
def test_quantize_rows_and_cols_is_both_kernels(R, C, tile_rows):
    """One read, two quantizations: bit for bit ``quantize_rows`` (gated by the used row tiles) and
    ``quantize_cols`` (padding rows and unused rows as zeros), partial last tiles of rows and
    columns, NaN in the padding rows (their rows' tiles are what ``quantize_rows`` makes of them),
    and the transposed result written into column slices of a larger buffer."""
    x = mixed_rows(R, C, seed=R * C).to(torch.bfloat16)
    row_src = torch.arange(R, dtype=torch.int32)
    row_src[5:9] = -1
    row_src[130] = -1
    x[[5, 130]] = float("nan")
    x, row_src = x.to(DEV), row_src.to(DEV)
    num_tiles = torch.tensor([(R - 1) // tile_rows], dtype=torch.int32)  # the last row tile unused
    args = dict(num_tiles=num_tiles.to(DEV), tile_rows=tile_rows)

    def untouched():  # the row outputs before a call: unused rows are left as they were
        return (torch.full((R, C), 0x7E, dtype=torch.uint8, device=DEV).view(quantize.E4M3),
                torch.full((R, -(-C // 128)), -1.0, device=DEV))

    want_q, want_s = untouched()
    quantize.quantize_rows(x, out=want_q, scale_out=want_s, **args)
    want_qt, want_st = quantize.quantize_cols(x, row_src=row_src, **args)
    got_q, got_s = untouched()
    wide_t = torch.zeros(C + 16, R, dtype=torch.uint8, device=DEV).view(quantize.E4M3)
    wide_st = torch.zeros(-(-R // 128), C + 16, device=DEV)
    (q, s), (qt, st) = quantize.quantize_rows_and_cols(x, row_src=row_src, out=got_q, scale_out=got_s,
                                                  out_t=wide_t[8:8 + C], scale_out_t=wide_st[:, 8:8 + C], **args)
    assert q is got_q and same(q, want_q) and same(s, want_s)
    assert same(qt, want_qt) and same(st, want_st)
    assert not wide_t.view(torch.uint8)[:8].any() and not wide_st[:, C + 8:].any()  # nothing past the slices
    (q2, s2), (qt2, st2) = quantize.quantize_rows_and_cols(x, row_src=row_src, **args)
    assert same(qt2, want_qt) and same(st2, want_st)
    used = (R - 1) // tile_rows * tile_rows
    assert same(q2[:used], want_q[:used]) and same(s2[:used], want_s[:used])


def test_quantize_cols_reference_is_rows_of_the_transpose():
    x = mixed_rows(200, 130, seed=5)
    q, s = ref.quantize_cols_ref(x)
    qt, st = ref.quantize_rows_ref(x.t().contiguous())
    assert same(q, qt.t().contiguous()) and same(s, st.t().contiguous())
    assert torch.equal(ref.dequantize_cols_ref(q, s), ref.dequantize_rows_ref(qt, st).t())


# --------------------------------------------------------------------------------------------
# MXFP8 import
# --------------------------------------------------------------------------------------------

def mx_weights(E, N, K, seed, spread=6):
    """MXFP8 weights that convert exactly: group exponents spread over ``spread`` binades below the
    block's largest, values that stay E4M3 values after the shift (normal, or subnormal multiples
    of 2^-9), some zeros."""
    g = torch.Generator().manual_seed(seed)
    e8 = (120 + torch.randint(0, spread + 1, (E, N, K // 32), generator=g)).to(torch.uint8)
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    e_max = torch.nn.functional.pad(e8.int(), (0, kb * 4 - K // 32, 0, nb * 128 - N)).view(E, nb, 128, kb, 4).amax((2, 4))
    d = (e_max.repeat_interleave(128, 1)[:, :N].repeat_interleave(4, 2)[:, :, :K // 32] - e8.int())
    d = d.repeat_interleave(32, 2).float()
    v = e4m3_values()
    pick = v[torch.randint(0, v.numel(), (E, N, K), generator=g)]
    # exact after the shift: |v| * 2^-d >= 2^-6, or v a multiple of 2^(d-9)
    ok = (pick.abs() * torch.exp2(-d) >= 2.0 ** -6) | (torch.remainder(pick, torch.exp2(d - 9)) == 0)
    pick = torch.where(ok, pick, torch.zeros_like(pick))
    return pick.to(E4M3), e8


@pytest.mark.parametrize("E,N,K", [(2, 130, 160), (1, 128, 256), (1, 64, 96)])
def test_mxfp8_import_exact(E, N, K):
    q, e8 = mx_weights(E, N, K, seed=N + K)
    rq, rs = ref.mxfp8_to_blocks_ref(q, e8)
    mx = ref.mxfp8_dequantize_ref(q, e8)
    assert torch.equal(ref.dequantize_blocks_ref(rq, rs), mx)  # exact, elementwise
    kq, ks = quantize.mxfp8_to_blocks(q.to(DEV), e8.to(DEV))
    assert same(kq, rq) and same(ks, rs)
    # the subnormal case is reached: some values were re-expressed below 2^-6
    assert bool(((rq.float().abs() < 2.0 ** -6) & (rq.float() != 0)).any())


def test_mxfp8_import_scale_zero_is_two_to_minus_127():
    q = torch.full((1, 128, 128), 1.0).to(E4M3)
    e8 = torch.zeros(1, 128, 4, dtype=torch.uint8)
    rq, rs = ref.mxfp8_to_blocks_ref(q, e8)
    kq, ks = quantize.mxfp8_to_blocks(q.to(DEV), e8.to(DEV))
    assert rs.item() == 2.0 ** -127 and same(ks, rs) and same(kq, rq)


@pytest.mark.parametrize("case", ["lost_bits", "nan_scale", "nan_value"])
def test_mxfp8_import_refuses_what_is_not_exact(case):
    q = torch.full((1, 128, 128), 1.0).to(E4M3)
    e8 = torch.full((1, 128, 4), 127, dtype=torch.uint8)
    if case == "lost_bits":
        e8[0, 5, 2] = 130  # its block's scale becomes 2^3; 2^-9 in another group would be 2^-12
        q[0, 7, 0] = 2.0 ** -9
    elif case == "nan_scale":
        e8[0, 0, 0] = 255
    else:
        q.view(torch.uint8)[0, 3, 3] = 0x7F
    with pytest.raises(ValueError, match="MXFP8"):
        ref.mxfp8_to_blocks_ref(q, e8)
    with pytest.raises(ValueError, match="MXFP8"):
        quantize.mxfp8_to_blocks(q.to(DEV), e8.to(DEV))
    if case == "lost_bits":  # 2^-3 instead: 2^-3 * 2^-3 = 2^-6, a normal E4M3 value, kept exactly
        q[0, 7, 0] = 2.0 ** -3
        rq, rs = ref.mxfp8_to_blocks_ref(q, e8)
        assert rs.item() == 8.0 and rq[0, 7, 0].item() == 2.0 ** -6
        assert torch.equal(ref.dequantize_blocks_ref(rq, rs), ref.mxfp8_dequantize_ref(q, e8))
        kq, ks = quantize.mxfp8_to_blocks(q.to(DEV), e8.to(DEV))
        assert same(kq, rq) and same(ks, rs)


@pytest.mark.parametrize("R,C,scaled", [(300, 272, False), (384, 256, True)])
def test_quantize_cols_word_stores_are_the_byte_stores(R, C, scaled, monkeypatch):
    """The 128x1 kernels store the transposed values as 32-bit words (4 rows of a column) where qt's
    rows allow it (``_packs``), else byte by byte: both give the same bits, and the words are taken
    where they should be (R a multiple of 4, aligned rows) and not elsewhere."""
    x = mixed_rows(R, C, seed=R + 3 * C).to(torch.bfloat16).to(DEV)
    kw = {}
    if scaled:
        x, xs = quantize.quantize_rows(x)
        kw["row_scale"] = xs
    row_src = torch.arange(R, dtype=torch.int32, device=DEV)
    row_src[7:12] = -1
    kw.update(row_src=row_src, num_tiles=torch.tensor([R // 128], dtype=torch.int32, device=DEV), tile_rows=128)
    words = quantize.quantize_cols(x, **kw)
    assert quantize._packs(words[0])
    assert not quantize._packs(torch.empty(C, R + 2, dtype=torch.uint8)[:, 1:R + 1])
    assert not quantize._packs(torch.empty(C, R - 2, dtype=torch.uint8))
    monkeypatch.setattr(quantize, "_packs", lambda qt: False)
    bytewise = quantize.quantize_cols(x, **kw)
    assert same(words[0], bytewise[0]) and same(words[1], bytewise[1])
    if not scaled:
        both = quantize.quantize_rows_and_cols(x, **kw)[1]
        assert same(both[0], words[0]) and same(both[1], words[1])
