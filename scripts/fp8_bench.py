"""FP8 measurements on one GPU (docs/fp8-measurements.md).

1. The expert GEMMs at T*k routed rows over E experts (rows spread evenly, 128-row tiles):
   TFLOP/s of Tabby's bf16 GEMMs (gemm.py) and of the FP8 ones (gemm_fp8.py), with and without
   the quantization of their A operand, for a few tile variants.
2. The layer on the path of separate launches, EP1: time per forward and per forward + backward
   with precision "bf16", "fp8-forward" and "fp8".

    python scripts/fp8_bench.py [--gemm-only | --layer-only]
"""
from __future__ import annotations

import argparse
import time

import torch

import tabby
from tabby.ops.gemm import bf16 as gemm, fp8 as gemm_fp8, fp8_ws as gemm_fp8_ws
from tabby.ops.quantize import quantize_blocks, quantize_cols, quantize_rows, quantize_rows_and_cols
from tabby.ops.gemm.bf16 import GemmConfig


def bench(fn, iters=20, warmup=3):
    """Median ms of fn over iters (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def even_schedule(rows, E, BM=128, device="cuda"):
    per = rows // E
    padded = -(-per // BM) * BM
    R = padded * E
    te = torch.arange(E, dtype=torch.int32, device=device).repeat_interleave(padded // BM)
    nt = torch.tensor([R // BM], dtype=torch.int32, device=device)
    start = torch.arange(E + 1, dtype=torch.int32, device=device) * padded
    count = torch.full((E,), per, dtype=torch.int32, device=device)
    return R, te, nt, start, count


def gemms(T, k, E, H, I, variants):
    rows = T * k
    R, te, nt, start, count = even_schedule(rows, E)
    dev = "cuda"
    x = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(R, I, device=dev, dtype=torch.bfloat16)
    wg = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    wu = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    wd = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I ** -0.5
    xq, xs = quantize_rows(x)
    hq, hs = quantize_rows(h)
    (gq, gs), (uq, us), (dq, ds) = quantize_blocks(wg), quantize_blocks(wu), quantize_blocks(wd)
    fl_gu, fl_dn = 2 * rows * H * 2 * I, 2 * rows * I * H
    out = {}
    t = bench(lambda: gemm.gate_up_swiglu(x, wg, wu, te, nt, save_gu=True))
    out["bf16 gate_up"] = fl_gu / t / 1e9
    t = bench(lambda: gemm.down_local(h, wd, te, nt))
    out["bf16 down"] = fl_dn / t / 1e9
    t = bench(lambda: gemm.expert_wgrad(x, h, start, count))
    out["bf16 wgrad(x^T h)"] = fl_dn / t / 1e9
    tq = bench(lambda: quantize_rows(x))
    for name, cfg_gu, cfg_dn in variants:
        try:
            t = bench(lambda: gemm_fp8.gate_up_swiglu_fp8(xq, xs, gq, gs, uq, us, te, nt, config=cfg_gu))
            out[f"fp8 gate_up {name}"] = fl_gu / t / 1e9
            out[f"fp8 gate_up {name} +quant x"] = fl_gu / (t + tq) / 1e9
        except Exception as e:  # noqa: BLE001 -- a variant that does not fit is reported, not fatal
            out[f"fp8 gate_up {name} FAILED {type(e).__name__}"] = float("nan")
        try:
            t = bench(lambda: gemm_fp8.rows_gemm_fp8(hq, hs, dq, ds, te, nt, config=cfg_dn))
            out[f"fp8 down {name}"] = fl_dn / t / 1e9
        except Exception as e:  # noqa: BLE001
            out[f"fp8 down {name} FAILED {type(e).__name__}"] = float("nan")
    # the defaults (warp-specialized) bitwise the Triton kernels', and their ring depths
    want_gu = gemm_fp8.gate_up_swiglu_fp8(xq, xs, gq, gs, uq, us, te, nt, config=variants[1][1])
    got_gu = gemm_fp8.gate_up_swiglu_fp8(xq, xs, gq, gs, uq, us, te, nt)
    out["fp8 gate_up default bitwise triton"] = float(
        all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got_gu, want_gu)))
    del want_gu, got_gu
    out["fp8 down default bitwise triton"] = float(torch.equal(
        gemm_fp8.rows_gemm_fp8(hq, hs, dq, ds, te, nt), gemm_fp8.rows_gemm_fp8(hq, hs, dq, ds, te, nt,
                                                                               config=variants[1][2])))
    for stages in (3, 4):
        t = bench(lambda: gemm_fp8_ws.gate_up_swiglu_fp8_ws(xq, xs, gq, gs, uq, us, te, nt, stages=stages))
        out[f"fp8 gate_up ws s{stages}"] = fl_gu / t / 1e9
        t = bench(lambda: gemm_fp8_ws.rows_gemm_fp8_ws(hq, hs, dq, ds, te, nt, stages=stages))
        out[f"fp8 down ws s{stages}"] = fl_dn / t / 1e9
    xc, xcs = quantize_cols(x)
    hc, hcs = quantize_cols(h)
    try:
        t = bench(lambda: gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count))
        out["fp8 wgrad(x^T h)"] = fl_dn / t / 1e9
    except Exception as e:  # noqa: BLE001
        out[f"fp8 wgrad FAILED {type(e).__name__}: {e}"[:120]] = float("nan")
    return out


def wgrad_operands(T, k, E, H, I):
    """The weight gradient's operands over T * k rows spread evenly across E experts, each expert's
    segment padded to a multiple of 128 with zero rows (the layer's layout): (x, h bf16, their 128x1
    quantizations, expert_start, expert_count, FLOPs over the real rows)."""
    rows = T * k
    R, te, nt, start, count = even_schedule(rows, E)
    per = rows // E
    tail = (torch.arange(R, device="cuda") - start[:-1].repeat_interleave(R // E)) >= per  # rows past a segment
    x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16).masked_fill(tail[:, None], 0)
    h = torch.randn(R, I, device="cuda", dtype=torch.bfloat16).masked_fill(tail[:, None], 0)
    return x, h, quantize_cols(x), quantize_cols(h), start, count, 2 * E * per * H * I


def wgrad_segments(T, k, E, H, I):
    """The FP8 weight gradient where the experts' rows are not multiples of 128 (kimi-k2: 16384 x 8
    rows over 384 experts, 341 each): the general kernel (each segment's last block masked, after
    the loop) against ``padded`` (the layer's zero tail rows, every block in the loop); bf16's too."""
    x, h, (xc, xcs), (hc, hcs), start, count, fl = wgrad_operands(T, k, E, H, I)
    out = {"bf16": fl / bench(lambda: gemm.expert_wgrad(x, h, start, count)) / 1e9}
    out["fp8 general"] = fl / bench(lambda: gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count)) / 1e9
    triton_cfg = GemmConfig(BM=128, BN=64, BK=128, num_warps=4, num_stages=3, GROUP_M=4)  # not the default
    want = gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count, padded=True, config=triton_cfg)
    same = torch.equal(gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count, padded=True), want)
    out[f"fp8 padded{'' if same else ' MISMATCH'}"] = fl / bench(
        lambda: gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count, padded=True)) / 1e9
    out["fp8 padded triton"] = fl / bench(
        lambda: gemm_fp8.expert_wgrad_fp8(xc, xcs, hc, hcs, start, count, padded=True, config=triton_cfg)) / 1e9
    return out


def down_dgrad(T, k, E, H, I):
    """TFLOP/s of the FP8 down dgrad (dys [R, H] @ W_down per expert, SwiGLU backward epilogue,
    W_down^T as ``transpose_blocks`` makes it)."""
    rows = T * k
    R, te, nt, start, count = even_schedule(rows, E)
    dys = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(R, device="cuda")
    wd = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    dq, ds = quantize_rows(dys)
    wtq, wts = gemm_fp8.transpose_blocks(*quantize_blocks(wd))
    return 2 * rows * I * H / bench(lambda: gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, wtq, wts, gu, ws, te, nt)) / 1e9


def dgrads_bt(T, k, E, H, I):
    """TFLOP/s of the two dgrads with their weights' transposed copies held (K-major), with those
    copies made in the call (``transpose_blocks``), and reading the forward copies transposed in the
    kernel (``*_t``; ``bt lag L stages S``: its producer's lag and ring depth)."""
    R, te, nt, start, count = even_schedule(T * k, E)
    dq, ds = quantize_rows(torch.randn(R, H, device="cuda", dtype=torch.bfloat16))
    gu = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(R, device="cuda")
    wd = quantize_blocks(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5)
    wd_t = gemm_fp8.transpose_blocks(*wd)
    fl = 2 * T * k * I * H
    out = {}
    out["down held"] = fl / bench(lambda: gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, *wd_t, gu, ws, te, nt)) / 1e9
    del wd_t
    out["down made"] = fl / bench(lambda: gemm_fp8.down_dgrad_swiglu_fp8(
        dq, ds, *gemm_fp8.transpose_blocks(*wd), gu, ws, te, nt), iters=5) / 1e9
    out["down in-kernel"] = fl / bench(lambda: gemm_fp8.down_dgrad_swiglu_fp8_t(dq, ds, *wd, gu, ws, te, nt)) / 1e9
    dgu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device="cuda")
    hw = torch.empty(R, I, dtype=torch.bfloat16, device="cuda")
    dw = torch.empty(R, -(-I // 128), dtype=torch.float32, device="cuda")
    epi = (gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0), dw, dw.stride(0))
    wd_st = wd[1].transpose(-2, -1).contiguous()
    for lag, stages in ((1, 4), (3, 4), (2, 5)):
        out[f"down bt lag {lag} stages {stages}"] = fl / bench(lambda: gemm_fp8_ws.launch_bt(
            dq, ds, (wd[0],), wd_st, te, nt, 128, gemm_fp8_ws.EPI_SWIGLU_BWD, epi, I, stages=stages, lag=lag)) / 1e9
    del wd, dgu, hw, dw, gu
    # the gate/up dgrad, pushed: K = 2I (I a multiple of 128 here: no padding)
    aq, as_ = quantize_rows(torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16))
    (gq, gs), (uq, us) = (quantize_blocks(torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5)
                          for _ in range(2))
    b_scale = torch.cat([gs.transpose(-2, -1), us.transpose(-2, -1)], dim=-1).contiguous()
    TK = T * k
    dst = torch.empty(TK, H, dtype=torch.bfloat16, device="cuda")
    ptrs = torch.tensor([dst.data_ptr()], dtype=torch.int64, device="cuda")
    row_src = torch.arange(R, dtype=torch.int32, device="cuda") % TK

    def made():
        bt = torch.empty(E, H, 2 * I, dtype=gq.dtype, device="cuda")
        gemm_fp8.transpose_blocks(gq, gs, out=bt[:, :, :I])
        gemm_fp8.transpose_blocks(uq, us, out=bt[:, :, I:])
        return bt

    bt = made()
    push = dict(row_src=row_src, dst_ptrs=ptrs, TK=TK)
    out["gate/up held"] = 2 * fl / bench(lambda: gemm_fp8.rows_gemm_fp8(aq, as_, bt, b_scale, te, nt, **push)) / 1e9
    del bt
    out["gate/up made"] = 2 * fl / bench(lambda: gemm_fp8.rows_gemm_fp8(aq, as_, made(), b_scale, te, nt, **push),
                                         iters=5) / 1e9
    out["gate/up in-kernel"] = 2 * fl / bench(lambda: gemm_fp8.gate_up_dgrad_push_fp8_t(
        aq, as_, gq, uq, b_scale, te, nt, row_src, ptrs, TK)) / 1e9
    return out


def rows_stages(T, k, E, K, N):
    """TFLOP/s of the rows GEMM (stored rows) at its default ring depth (gemm_fp8_ws.wide_stages) and
    at 3 and 4 stages."""
    R, te, nt, start, count = even_schedule(T * k, E)
    aq, as_ = quantize_rows(torch.randn(R, K, device="cuda", dtype=torch.bfloat16))
    bq, bs = quantize_blocks(torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5)
    fl = 2 * T * k * K * N
    out = {"default": fl / bench(lambda: gemm_fp8.rows_gemm_fp8(aq, as_, bq, bs, te, nt)) / 1e9}
    for stages in (3, 4):
        out[f"s{stages}"] = fl / bench(lambda: gemm_fp8_ws.rows_gemm_fp8_ws(aq, as_, bq, bs, te, nt, stages=stages)) / 1e9
    return out


def routed_rows(R, C):
    """bf16 rows [R, C] as a routed-row buffer: (x, row_src with its last eighth padding, the used
    row tiles of 128 as a device scalar)."""
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
    row_src = torch.arange(R, dtype=torch.int32, device="cuda")
    row_src[R - R // 8:] = -1
    return x, row_src, torch.tensor([R // 128], dtype=torch.int32, device="cuda")


def quantize_cols_rate(R, C, e4m3: bool):
    """GB/s (read + written) of the backward's 128x1 quantization over R routed rows of C columns:
    from bf16 (hw, dg | du) or from E4M3 rows with 1x128 scales (dy, xs), padding rows masked."""
    x, row_src, nt = routed_rows(R, C)
    if e4m3:
        xq, xs = quantize_rows(x)
        fn = lambda: quantize_cols(xq, row_src=row_src, num_tiles=nt, tile_rows=128, row_scale=xs)  # noqa: E731
        moved = R * C + R * (C // 128) * 4 + R * C * 33 // 32  # E4M3 values and their row scales read
    else:
        fn = lambda: quantize_cols(x, row_src=row_src, num_tiles=nt, tile_rows=128)  # noqa: E731
        moved = R * C * 2 + R * C * 33 // 32
    return moved / bench(fn, iters=5) / 1e6


def rows_and_cols_ms(R, C):
    """ms of dg | du's two quantizations (1x128 rows for the gate/up dgrad, 128x1 transposed for the
    weight gradients) over R routed rows of C columns: from one read (``quantize_rows_and_cols``,
    the layer's) against ``quantize_rows`` then ``quantize_cols``, marked where not bitwise equal."""
    x, row_src, nt = routed_rows(R, C)
    fused = lambda: quantize_rows_and_cols(x, row_src=row_src, num_tiles=nt, tile_rows=128)  # noqa: E731
    apart = lambda: (quantize_rows(x, num_tiles=nt, tile_rows=128),  # noqa: E731
                     quantize_cols(x, row_src=row_src, num_tiles=nt, tile_rows=128))
    same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for pa, pb in zip(fused(), apart()) for a, b in zip(pa, pb))
    return {f"one read{'' if same else ' MISMATCH'}": bench(fused, iters=5),
            "rows then cols": bench(apart, iters=5)}


def transpose_rate(E, N, K):
    """GB/s (read + written) of the E4M3 weight transpose each FP8 backward makes (kimi-k2's
    W_down: [384, 7168, 2048], 5.6 GB)."""
    q = torch.randint(-100, 100, (E, N, K), device="cuda", dtype=torch.int8).view(torch.float8_e4m3fn)
    s = torch.ones(E, -(-N // 128), -(-K // 128), device="cuda")
    out = torch.empty(E, K, N, dtype=q.dtype, device="cuda")
    return 2 * q.numel() / bench(lambda: gemm_fp8.transpose_blocks(q, s, out=out), iters=5) / 1e6


def layer(T, k, E, H, I, iters=10):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    wts, idx = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
    ws = [(torch.randn(*s, device="cuda", generator=g) * s[-1] ** -0.5).to(torch.bfloat16).requires_grad_()
          for s in ((E, I, H), (E, I, H), (E, H, I))]
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    flops = 6 * T * k * H * I
    out = {}
    for precision in ("bf16", "fp8-forward", "fp8"):
        cfg = tabby.MoEConfig(megakernel=False, precision=precision)

        def fwd():
            with torch.no_grad():
                tabby.moe(x, idx, wts, *ws, config=cfg)

        def fwdbwd():
            y = tabby.moe(x, idx, wts, *ws, config=cfg)
            torch.autograd.grad(y, [x, *ws], dy)

        tf = bench(fwd, iters=iters)
        tb = bench(fwdbwd, iters=iters)
        out[precision] = (tf, tb, flops / tf / 1e9, 3 * flops / tb / 1e9)
    tabby.check_errors()
    return out


SECTIONS = ("gemms", "wgrad", "down-dgrad", "dgrad-bt", "rows", "transpose", "quantize")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm-only", action="store_true")
    ap.add_argument("--layer-only", action="store_true")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"the GEMM sections to run, comma-separated, of {','.join(SECTIONS)} (default all)")
    a = ap.parse_args()
    only = a.only.split(",")
    if unknown := sorted(set(only) - set(SECTIONS)):
        ap.error(f"unknown --only section(s) {unknown}: choose from {','.join(SECTIONS)}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    # (name, gate/up config, rows GEMM config): the defaults (the warp-specialized kernels on sm_90),
    # and "triton": gemm_fp8's Triton kernels (other tiles than the defaults, GROUP_M 4: the same sums)
    variants = [("default", None, None),
                ("triton", GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=5, GROUP_M=4),
                 GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=4, GROUP_M=4))]
    shapes = ((16384, 8, 128, 2048, 768), (16384, 8, 128, 7168, 2048))
    T, k, H, I = 16384, 8, 7168, 2048  # kimi-k2's routed GEMMs at 16384 tokens
    if not a.layer_only:
        if "gemms" in only:
            for T_, k_, E, H_, I_ in shapes:
                res = gemms(T_, k_, E, H_, I_, variants)
                print(f"GEMM TFLOP/s, T*k={T_ * k_} rows, E={E}, H={H_}, I={I_}: "
                      + "; ".join(f"{n} {v:.0f}" for n, v in res.items()), flush=True)
        if "wgrad" in only:
            # the weight gradient at kimi-k2's 341 rows an expert, then at 4x and 16x the rows (what a
            # tile's fill and store cost against its K)
            for E in (384, 96, 24):
                res = wgrad_segments(T, k, E, H, I)
                print(f"weight gradient TFLOP/s, {T * k // E} rows per expert, E={E}, H={H}, I={I}: "
                      + "; ".join(f"{n} {v:.0f}" for n, v in res.items()), flush=True)
        E = 384
        if "down-dgrad" in only:
            print(f"FP8 down dgrad TFLOP/s, E={E}, H={H}, I={I}: {down_dgrad(T, k, E, H, I):.0f}", flush=True)
        if "dgrad-bt" in only:
            for name, k_, I_ in (("kimi-k2", 8, 2048), ("deepseek-v4-pro", 6, 3072)):
                res = dgrads_bt(T, k_, E, H, I_)
                print(f"FP8 dgrads TFLOP/s, {name} (E={E}, H={H}, I={I_}, T*k={T * k_}): "
                      + "; ".join(f"{n} {v:.0f}" for n, v in res.items()), flush=True)
        if "rows" in only:
            for K, N, what in ((I, H, "down"), (2 * I, H, "gate/up dgrad")):
                res = rows_stages(T, k, E, K, N)
                print(f"FP8 rows GEMM TFLOP/s ({what}), E={E}, K={K}, N={N}: "
                      + "; ".join(f"{n} {v:.0f}" for n, v in res.items()), flush=True)
        if "transpose" in only:
            print(f"E4M3 weight transpose [E={E}, {H}, {I}]: {transpose_rate(E, H, I):.0f} GB/s", flush=True)
        if "quantize" in only:
            R = 155648  # kimi-k2's routed rows at 16384 tokens, each expert padded to 128
            print(f"128x1 quantization GB/s (read + written), R={R}: " + "; ".join(
                f"{what} {quantize_cols_rate(R, C, e4m3):.0f}" for what, C, e4m3 in
                (("hw bf16 C=2048", 2048, False), ("dg|du bf16 C=4096", 4096, False),
                 ("dy E4M3 C=7168", 7168, True))), flush=True)
            print(f"dg | du [{R}, 4096] quantized per 1x128 and per 128x1, ms: " + "; ".join(
                f"{n} {v:.3f}" for n, v in rows_and_cols_ms(R, 4096).items()), flush=True)
    if not a.gemm_only:
        for T_, k_, E, H_, I_ in shapes[:1] + ((4096, 8, 128, 7168, 2048),):
            try:
                res = layer(T_, k_, E, H_, I_)
            except Exception as e:  # noqa: BLE001
                print(f"layer T={T_} H={H_} I={I_} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"layer EP1 sync-free, T={T_} k={k_} E={E} H={H_} I={I_}: " + "; ".join(
                f"{p} fwd {v[0]:.2f} ms ({v[2]:.0f} TFLOP/s) fwd+bwd {v[1]:.2f} ms ({v[3]:.0f})"
                for p, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
