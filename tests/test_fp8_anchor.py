"""The FP8 rows of the benchmark: the ``torch-fp8`` anchor (torch._scaled_grouped_mm, rowwise
scales, quantization fused by torch.compile) and ``tabby-fp8``, checked by the benchmark's own check
against the fp32 reference with an FP8 tolerance (values and every gradient), and the policy both
are timed under (each timed call starts from a new weight version, so both quantize the weights
on every call).

On the CPU: the anchor's quantizers against their definitions, compiled (inductor's C++ backend)
against eager bit for bit, the eager fallback, the bench's weight-version policy and Tabby's
weight cache under it; torch-fp8 itself refuses clearly. On an sm_90 GPU: the rows against fp32,
the compiled quantizers against eager (Triton), and no fp32 copy of a weight while quantizing it.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch

import tabby
from tabby.functional import fp8 as tabby_fp8
from tabby_bench import bench, timing
from tabby_bench.anchors import torch_fp8 as anchor
from tabby_bench.anchors.torch_a2a import moe_torch_a2a
from tabby_bench.anchors.torch_fp8 import moe_torch_fp8, unavailable_reason
from tabby_bench.impls import IMPLS, LayerImpl, new_weight_version
from tabby_bench.shapes import TINY, Shape, make_inputs

# E4M3 against fp32: a few per cent (tabby's FP8 layer: ~5-7e-2 on random inputs; rowwise
# scales over a whole row of K are coarser than 1x128 tiles)
FP8_TOL = 1e-1
QWEN_LIKE = Shape("qwen3-30b-a3b-small", 128, 2048, 768, 8)
FEW_EXPERTS = Shape("few-experts", 16, 1024, 512, 4, I_shared=256)
# gpt-oss-120b's widths, H = I = 2880 (22.5 x 128: partial last tiles), with fewer experts
GPT_OSS_LIKE = Shape("gpt-oss-120b-small", 32, 2880, 2880, 4)
on_gpu = pytest.mark.skipif(unavailable_reason() is not None, reason=f"torch-fp8: {unavailable_reason()}")


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def same(got, want) -> bool:
    """Two quantizer results (E4M3, scales) are equal bit for bit, with the same shapes and strides."""
    (q, s), (q2, s2) = got, want
    return (q.shape == q2.shape and q.stride() == q2.stride() and torch.equal(bits(q), bits(q2))
            and s.shape == s2.shape and torch.equal(s, s2))


@pytest.fixture
def fresh_quantizers(monkeypatch):
    """The anchor's quantizers as in a new process: nothing compiled, no fallback, no environment override."""
    monkeypatch.setattr(anchor, "_compiled", {})
    monkeypatch.setattr(anchor, "_eager_reason", [])
    monkeypatch.delenv(anchor.QUANTIZE_ENV, raising=False)


def operand(rows: int, cols: int, seed: int, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """Rows of very different magnitudes, one of zeros, values on both sides of E4M3's range once scaled."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, device=device)
    t = t * torch.logspace(-6, 4, rows, device=device)[torch.randperm(rows, generator=g, device=device)][:, None]
    t[rows // 3] = 0
    return t.to(dtype)


def padded_rows(counts, cols: int, seed: int, device="cpu"):
    """Rows grouped by expert (``counts`` per expert, some empty) in the anchor's padded layout:
    (t [M_pad, C] bf16, zeros in the padding; gid [M_pad]; padded group ends; M_pad)."""
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    M, E = sum(counts), len(counts)
    dest, pends, gid, M_pad = anchor._padded_layout(offs, M, E)
    rows = operand(M, cols, seed, device=device)
    return rows.new_zeros(M_pad, cols).index_copy(0, dest, rows), gid, pends, M_pad


COUNTS = [5, 0, 16, 1, 40, 0, 33]  # an empty expert, one of exactly 16 rows, one of one row


# ----------------------------------------------------------------------------------------------
# The quantizers against their definitions (eager, CPU)
# ----------------------------------------------------------------------------------------------

def test_scales_are_the_smallest_power_of_two_that_fits():
    f32 = torch.float32
    special = torch.tensor([0.0, 1e-30, 1e-12, 2.0 ** -20, 1.0, 1.75, 224.0, 448.0, 3e38], dtype=f32)
    down, up = torch.tensor(0.0), torch.tensor(float("inf"))
    nudged = torch.cat([torch.nextafter(special[3:], down), torch.nextafter(special[3:-1], up)])
    amax = torch.cat([special, nudged, torch.rand(4096, generator=torch.Generator().manual_seed(0)).exp2() ** 40])
    mult, inv = anchor.pow2_scales(amax)
    floored = amax.clamp_min(anchor.AMAX_FLOOR).double()
    assert torch.all(floored <= 448 * inv.double()) and torch.all(floored > 224 * inv.double())
    assert torch.all(mult.double() * inv.double() == 1)
    assert torch.all(mult.view(torch.int32) & 0x7FFFFF == 0) and torch.all(inv.view(torch.int32) & 0x7FFFFF == 0)


def test_quantize_rows_scales_each_row_into_e4m3():
    t = operand(37, 200, seed=1)
    q, inv = anchor.quantize_rows(t)
    assert q.dtype == anchor.E4M3 and q.shape == t.shape and q.is_contiguous() and inv.shape == (37,)
    scaled = t.double() / inv.double()[:, None]  # exact: inv is a power of two
    amax = scaled.abs().amax(1)
    nonzero = t.abs().amax(1) > 0
    assert torch.all((amax[nonzero] > 224) & (amax[nonzero] <= 448))
    assert torch.equal(bits(q), bits(scaled.float().to(anchor.E4M3)))  # one rounding, to nearest even
    assert torch.all(q[~nonzero].float() == 0)


def test_quantize_rows_of_a_transposed_weight_is_per_input_column():
    w = torch.stack([operand(48, 64, seed=s) for s in range(3)])  # [E, N, K]
    q, inv = anchor.quantize_rows(w.transpose(-2, -1))
    assert q.shape == (3, 64, 48) and q.is_contiguous() and inv.shape == (3, 64)
    for e in range(3):
        assert same((q[e], inv[e]), anchor.quantize_rows(w[e].t().contiguous()))


def test_quantize_group_cols_is_per_column_within_each_group():
    t, gid, pends, M_pad = padded_rows(COUNTS, 80, seed=2)
    E = len(COUNTS)
    q_t, inv = anchor.quantize_group_cols_t(t, gid, E)
    assert q_t.shape == (80, M_pad) and q_t.is_contiguous() and inv.shape == (E, 80)
    start = 0
    for e, end in enumerate(pends.tolist()):
        if end == start:  # an empty group: the scale of a zero amax
            assert torch.equal(inv[e], anchor.pow2_scales(torch.zeros(80))[1]), e
            continue
        q_e, inv_e = anchor.quantize_rows(t[start:end].t())  # this group's rows, per column
        assert torch.equal(bits(q_t[:, start:end]), bits(q_e)) and torch.equal(inv[e], inv_e), e
        start = end


# ----------------------------------------------------------------------------------------------
# Compiled quantizers, the eager fallback
# ----------------------------------------------------------------------------------------------

def quantizer_cases(device):
    t, gid, _, _ = padded_rows(COUNTS, 80, seed=3, device=device)
    w = torch.stack([operand(48, 64, seed=s, device=device) for s in range(3)])
    return [(anchor.quantize_rows, (t,)), (anchor.quantize_rows, (w,)),
            (anchor.quantize_rows, (w.transpose(-2, -1),)), (anchor.quantize_group_cols_t, (t, gid, len(COUNTS)))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below compiles for the GPU")
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_quantizers_equal_eager_bitwise_on_cpu(fresh_quantizers):
    """Inductor's C++ backend (about 30 s of compiling): the fused quantizers give the eager bits."""
    for fn, args in quantizer_cases("cpu"):
        assert same(anchor.fused(fn, *args), fn(*args)), fn.__name__
    assert anchor.quantize_mode() == "fused (torch.compile)"
    assert set(anchor._compiled) == {anchor.quantize_rows, anchor.quantize_group_cols_t}


def test_eager_quantizers_on_request(fresh_quantizers, monkeypatch):
    monkeypatch.setenv(anchor.QUANTIZE_ENV, "eager")
    t = operand(16, 32, seed=4)
    assert same(anchor.fused(anchor.quantize_rows, t), anchor.quantize_rows(t))
    assert anchor._compiled == {} and anchor.quantize_mode() == f"eager: {anchor.QUANTIZE_ENV}=eager"
    monkeypatch.setenv(anchor.QUANTIZE_ENV, "fast")
    with pytest.raises(tabby.MoEInputError, match=anchor.QUANTIZE_ENV):
        anchor.fused(anchor.quantize_rows, t)


def test_eager_fallback_where_compiling_fails(fresh_quantizers, monkeypatch):
    def no_compiler(fn, **kw):
        raise RuntimeError("no backend here\nsecond line")

    monkeypatch.setattr(torch, "compile", no_compiler)
    t = operand(16, 32, seed=5)
    with pytest.warns(RuntimeWarning, match="quantizing eagerly"):
        got = anchor.fused(anchor.quantize_rows, t)
    assert same(got, anchor.quantize_rows(t))
    assert anchor.quantize_mode() == "eager: torch.compile failed (RuntimeError: no backend here)"
    assert IMPLS["torch-fp8"].note() == "quantization " + anchor.quantize_mode()


def test_out_of_memory_is_not_taken_for_a_compiler_failure(fresh_quantizers, monkeypatch):
    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 21.00 GiB")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: oom)
    with pytest.raises(torch.OutOfMemoryError):
        anchor.fused(anchor.quantize_rows, operand(16, 32, seed=6))
    assert anchor.quantize_mode() == "fused (torch.compile)"


def test_torch_fp8_refuses_clearly_where_it_cannot_run():
    reason = unavailable_reason()
    if reason is None:
        pytest.skip("torch-fp8 can run here")
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(tabby.MoEInputError, match="torch-fp8"):
        moe_torch_fp8(x, torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1), w, w, w)


def test_torchao_fp8_refuses_clearly_where_it_cannot_run():
    from tabby_bench.anchors import torchao_fp8

    reason = torchao_fp8.unavailable_reason()
    if reason is None:
        pytest.skip("torchao-fp8 can run here")
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(tabby.MoEInputError, match="torchao-fp8 " + re.escape(reason)):
        torchao_fp8.moe_torchao_fp8(x, torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1), w, w, w)


# ----------------------------------------------------------------------------------------------
# The bench's policy: every timed call starts from a new weight version
# ----------------------------------------------------------------------------------------------

def test_each_timed_call_starts_from_a_new_weight_version():
    inp = make_inputs(TINY, 16, 1, 0, torch.device("cpu"))
    values = [w.detach().clone() for w in inp.weights()]
    seen = []

    def layer(*args, group=None):
        seen.append([w._version for w in inp.weights()])
        return moe_torch_a2a(*args, group=group)

    run = LayerImpl("x", layer).prepare(inp, None)
    run.check(with_grads=True)
    run.run_fwd()
    run.run_fwdbwd()
    run.run_fwd()
    assert len(seen) == 4 and all(a < b for s, t in zip(seen, seen[1:]) for a, b in zip(s, t)), seen
    assert len(seen[0]) == 6  # the expert weights and the shared expert's
    assert all(torch.equal(w, v) for w, v in zip(inp.weights(), values))  # values untouched


def test_fixed_weights_keep_one_version_over_the_timed_calls():
    """``--weights fixed``: the bench leaves the weights' versions alone (the setting reaches the
    prepared run), and its header names that policy."""
    inp = make_inputs(TINY, 16, 1, 0, torch.device("cpu"))
    seen = []

    def layer(*args, group=None):
        seen.append([w._version for w in inp.weights()])
        return moe_torch_a2a(*args, group=group)

    prepared = []

    class Kept(LayerImpl):  # the run that measure prepares, kept to call its timed passes here
        def prepare(self, inp, group):
            prepared.append(super().prepare(inp, group))
            return prepared[-1]

    cfg = bench.Config(shapes=[TINY], tokens=[16], eps=[1], impls=["tabby-fp8"], passes=["fwd"], weights="fixed")
    bench.measure(Kept("x", layer), inp, None, cfg, timed=False)  # the check: one call
    (run,) = prepared
    assert run.new_weights is False  # measure passed the policy on
    run.run_fwd()
    run.run_fwd()
    assert len(seen) == 3 and seen[1] == seen[2], seen
    assert bench.run_notes(cfg, []) == [bench.FIXED_WEIGHTS_NOTE]


def test_tabby_fp8_quantizes_the_weights_again_after_a_new_version():
    """What the bump is for: Tabby's FP8 copy is cached per weight version (same object while the
    version holds), made again (the same bits) after it, and dropped by the bench's free_memory."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the quantizer runs where the weight is
    inp = make_inputs(Shape("blocks", 2, 128, 128, 1), 4, 1, 0, dev)
    tabby_fp8.clear_weight_cache()
    first = tabby_fp8.fp8_weight(inp.w_gate)
    assert tabby_fp8.fp8_weight(inp.w_gate) is first
    new_weight_version(inp)
    again = tabby_fp8.fp8_weight(inp.w_gate)
    assert again is not first and torch.equal(bits(again[0]), bits(first[0])) and torch.equal(again[1], first[1])
    assert tabby_fp8._weight_cache
    timing.free_memory()
    assert not tabby_fp8._weight_cache


def test_the_bench_names_the_policy_and_records_how_torch_fp8_quantized():
    assert "new weight version" in bench.WEIGHTS_NOTE and "quantize their weights on every call" in bench.WEIGHTS_NOTE
    inp = make_inputs(TINY, 16, 1, 0, torch.device("cpu"))
    cfg = bench.Config(shapes=[TINY], tokens=[16], eps=[1], impls=["x"], passes=["fwd"])
    recs = bench.measure(LayerImpl("x", moe_torch_a2a, note=lambda: "how it ran"), inp, None, cfg, timed=False)
    assert [r["note"] for r in recs] == ["how it ran"]
    assert IMPLS["torch-fp8"].note().startswith("quantization ")
    fp8 = dict(recs[0], impl="torch-fp8", note="quantization fused (torch.compile)")
    assert bench.run_notes(cfg, recs) == ["x: how it ran"]
    assert bench.run_notes(bench.Config(shapes=[TINY], tokens=[16], eps=[1], impls=["tabby-fp8", "torch-fp8"],
                                        passes=["fwd"]), [fp8, fp8]) == [
        bench.WEIGHTS_NOTE, "torch-fp8: quantization fused (torch.compile)"]
    # a row that ran with several notes (tabby-fp8 caching its transposes or not, by shape) names the shapes
    not_held = "weight transposes not held: the dgrads read the forward copies transposed"
    held, made = (dict(recs[0], impl="tabby-fp8", shape=s, note=n)
                  for s, n in (("a", "weight transposes cached"), ("b", not_held)))
    assert bench.run_notes(cfg, [held, fp8, made, dict(held, shape="c")]) == [
        "tabby-fp8: weight transposes cached (a, c)", "torch-fp8: quantization fused (torch.compile)",
        f"tabby-fp8: {not_held} (b)"]


def test_tabby_fp8_row_caches_transposes_where_they_fit(monkeypatch):
    """The tabby-fp8 bench row keeps the default (transposes cached) unless the weights, their
    gradients and both E4M3 orientations (6 bytes a parameter) pass FP8_HOLD_SHARE of the GPU."""
    import tabby_bench.impls as impls

    seen = []
    monkeypatch.setattr(impls.tabby, "moe", lambda *a, config, **kw: seen.append(config.cache_fp8_transposes))
    w = torch.empty(2, 8, 16)
    impls.tabby_fp8(torch.empty(4, 16), None, None, w, w, w.transpose(1, 2))
    assert seen == [True] and impls._fp8_held[-1]

    class Props:
        total_memory = int(6 * 3 * w.numel() / impls.FP8_HOLD_SHARE) - 1

    x = torch.empty(4, 16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    impls.tabby_fp8(x, None, None, w, w, w.transpose(1, 2))
    assert seen == [True, False] and not impls._fp8_held[-1]


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

def _torchao_missing():
    from tabby_bench.anchors import torchao_fp8

    return torchao_fp8.unavailable_reason()


@on_gpu
@pytest.mark.parametrize("impl", ["torch-fp8", "tabby-fp8", "torchao-fp8"])
@pytest.mark.parametrize("shape", [QWEN_LIKE, FEW_EXPERTS, GPT_OSS_LIKE], ids=lambda s: s.name)
def test_fp8_rows_one_gpu(impl, shape):
    if impl == "torchao-fp8" and _torchao_missing():
        pytest.skip(f"torchao-fp8: {_torchao_missing()}")
    inp = make_inputs(shape, 2048, 1, 0, torch.device("cuda", 0))
    errs = IMPLS[impl].prepare(inp, None).check(with_grads=True)
    print(f"FP8 row {impl} {shape.name} T=2048 errors against fp32: {({k: round(v, 4) for k, v in errs.items()})}")
    assert errs and all(v < FP8_TOL for v in errs.values()), errs
    # and it is FP8: further from fp32 than bf16 is
    assert errs["y"] > 1e-2, errs
    if impl == "torch-fp8":
        assert anchor.quantize_mode() == "fused (torch.compile)"


@on_gpu
def test_compiled_quantizers_equal_eager_bitwise_on_gpu(fresh_quantizers):
    for fn, args in quantizer_cases("cuda"):
        assert same(anchor.fused(fn, *args), fn(*args)), fn.__name__
    w = torch.randn(8, 768, 2048, device="cuda").bfloat16()
    for args in ((w,), (w.transpose(-2, -1),)):
        assert same(anchor.fused(anchor.quantize_rows, *args), anchor.quantize_rows(*args))
    assert anchor.quantize_mode() == "fused (torch.compile)"


@on_gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_weight_quantization_makes_no_fp32_copy(fresh_quantizers, transposed):
    """Eager quantization of a weight holds two fp32 copies of it at once (8 bytes a parameter:
    what ran kimi-k2 out of memory); fused, only the E4M3 result (1 byte) and the scales."""
    w = torch.randn(16, 2048, 4096, device="cuda").bfloat16()
    arg = w.transpose(-2, -1) if transposed else w
    anchor.fused(anchor.quantize_rows, arg)  # compiled and warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q, inv = anchor.fused(anchor.quantize_rows, arg)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 1.1 * w.numel()
    assert same((q, inv), anchor.quantize_rows(arg))


@on_gpu
def test_tabby_fp8_quantizes_on_every_timed_call():
    inp = make_inputs(FEW_EXPERTS, 256, 1, 0, torch.device("cuda", 0))
    run = IMPLS["tabby-fp8"].prepare(inp, None)
    copies = []
    for _ in range(2):
        run.run_fwd()
        copies.append(tabby_fp8.fp8_weight(inp.w_gate))  # the copy the call made (a cache hit here)
    assert copies[0] is not copies[1] and torch.equal(bits(copies[0][0]), bits(copies[1][0]))
    timing.release_implementation()
