"""Each routed GEMM of the layer, one core against another, beside the floor and dense cuBLAS.

    python scripts/gemm_cores.py --shapes kimi-k2@ep8,qwen3-30b-a3b --tokens 16384 --out DIR

Per shape (uniform random top-k routing of T tokens over the shape's experts, rows padded to 128
a expert as the schedule pads them) and GEMM kind (gate/up + SwiGLU, down pushed to the rows'
origins, down dgrad + SwiGLU backward, gate/up dgrad pushed, the two weight gradients), the median
time and TFLOP/s of: bf16.py's Triton kernel at the plan's tiles (``triton``), the warp-specialized
kernels of bf16_ws.py at each (tile_n, stages) (``ws-N-S``; gate/up, down, the down dgrad and the weight
gradients), ``torch._grouped_mm`` on the same rows (the floor) and one dense ``torch.mm`` of the
same FLOPs (cuBLAS); the FP8 down dgrad (``fp8_dgrad``: fp8_ws's kernels against a dense
``torch._scaled_mm`` of the same FLOPs). FLOPs count real rows only. Writes
gemm-cores.json and gemm-cores.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tabby.activation import Activation  # noqa: E402
from tabby.functional import heuristics  # noqa: E402
from tabby.ops.gemm import bf16 as gemm, bf16_ws as ws  # noqa: E402
from tabby_bench.shapes import make_routing, shape_named  # noqa: E402

WS_VARIANTS = [(256, 4), (256, 3), (128, 4)]
# the down dgrad on bf16_ws's kernel with its epilogue partition: (tile width, stages, g/u prefetched,
# the epilogue's slice: None as the launcher picks)
DGRAD_WS_VARIANTS = [(128, 4, True, None), (128, 4, False, None), (256, 3, True, None), (256, 3, False, None),
                     (256, 3, True, 8)]


def ms_of(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def schedule(T, E, k, BM=128):
    """counts, R, tile_expert, num_tiles, row_src, offs (grouped_mm's, over the unpadded rows)."""
    gen = torch.Generator(device="cuda").manual_seed(T * 7 + E)
    idx, _ = make_routing(T, E, k, generator=gen, device="cuda")
    counts = torch.bincount(idx.flatten(), minlength=E).cpu()
    padded = (counts + BM - 1) // BM * BM
    R = int(padded.sum())
    te = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), padded // BM).cuda()
    row_src = torch.full((R,), -1, dtype=torch.int32)
    starts = torch.cumsum(padded, 0) - padded
    perm = torch.randperm(T * k, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    j = 0
    for e in range(E):
        c = int(counts[e])
        row_src[int(starts[e]):int(starts[e]) + c] = perm[j:j + c]
        j += c
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    return counts, R, te, torch.tensor([R // BM], dtype=torch.int32, device="cuda"), row_src.cuda(), offs


def run_shape(name, T, kinds=None):
    sh = shape_named(name)
    E, H, I, k = sh.E, sh.H, sh.I, sh.k
    counts, R, te, nt, row_src, offs = schedule(T, E, k)
    n_real = int(counts.sum())
    torch.manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    xs = torch.randn(R, H, **bf)
    wg = torch.randn(E, I, H, **bf) * H ** -0.5
    wu = torch.randn(E, I, H, **bf) * H ** -0.5
    wd = torch.randn(E, H, I, **bf) * I ** -0.5
    h = torch.empty(R, I, **bf)
    gu = torch.randn(R, 2 * I, **bf)
    dgu = torch.empty(R, 2 * I, **bf)
    hw = torch.empty(R, I, **bf)
    w = torch.rand(R, device="cuda")
    dst = torch.empty(T * k, H, **bf)
    ptrs = torch.tensor([dst.data_ptr()], dtype=torch.int64, device="cuda")
    xr = torch.randn(n_real, H, **bf)  # the floor's rows (no padding)
    hr = torch.randn(n_real, I, **bf)
    gur = torch.randn(n_real, 2 * I, **bf)
    wgu = torch.cat([wg, wu], 1)  # [E, 2I, H]
    wgu_t = wgu[0].T.contiguous()  # one expert's [H, 2I], the dense product's B
    push = (row_src, ptrs, T * k, H, ptrs.view(torch.bfloat16))
    rows = []

    def add(kind, core, fn, flop):
        if kinds and kind not in kinds:
            return
        try:
            t = ms_of(fn)
            rows.append(dict(shape=name, T=T, kind=kind, core=core, ms=t, tflops=flop / t / 1e9))
        except Exception as ex:  # noqa: BLE001 - a core that cannot run this shape says why
            rows.append(dict(shape=name, T=T, kind=kind, core=core, ms=None, tflops=None, error=repr(ex)[:300]))
        print(f"{name:22s} {kind:14s} {core:10s} " + (f"{rows[-1]['ms']:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s"
                                                      if rows[-1]["ms"] else rows[-1]["error"]), flush=True)

    f_gu, f_d = 2.0 * n_real * H * 2 * I, 2.0 * n_real * I * H
    # gate/up + SwiGLU
    cfg = heuristics.gemm_config(gemm.KIND_GATE_UP, I, H, 128)
    add("gate_up", "triton", lambda: gemm.gate_up_swiglu(xs, wg, wu, te, nt, h=h, gu=gu, config=cfg), f_gu)
    for st in (3, 4):
        add("gate_up", f"ws-128-{st}", lambda: ws.gate_up_swiglu_ws(xs, wg, wu, te, nt, h, gu, sched_bm=128, stages=st),
            f_gu)
    # gate/up with gpt-oss's activation (clamps, a second sigmoid), its epilogue on the consumers or
    # on a partition of its own (``handoff``: 3 stages beside the 64 KB of g, u)
    gpt = Activation("gpt-oss", limit=7.0, alpha=1.702)
    add("gate_up", "ws-128-4-gptoss", lambda: ws.gate_up_swiglu_ws(xs, wg, wu, te, nt, h, gu, sched_bm=128, stages=4,
                                                                  act=gpt), f_gu)
    for ec in (16, 32):
        add("gate_up", f"ws-ho-3-e{ec}-gptoss", lambda: ws.gate_up_swiglu_ws(xs, wg, wu, te, nt, h, gu, sched_bm=128,
                                                                            stages=3, act=gpt, handoff=True,
                                                                            epi_cols=ec), f_gu)
    add("gate_up", "floor", lambda: torch._grouped_mm(xr, wgu.transpose(-2, -1), offs=offs), f_gu)
    add("gate_up", "dense", lambda: torch.mm(xr, wgu_t), f_gu)
    # down, pushed
    cfg = heuristics.gemm_config(gemm.KIND_DOWN, H, I, 128)
    add("down", "triton", lambda: gemm.down_push(h, wd, te, nt, row_src, ptrs, T * k, config=cfg), f_d)
    for tn, st in WS_VARIANTS:
        add("down", f"ws-{tn}-{st}", lambda: ws.rows_launch(h, wd, te, nt, 128, ws.EPI_PUSH, push, tile_n=tn,
                                                              stages=st), f_d)
    add("down", "floor", lambda: torch._grouped_mm(hr, wd.transpose(-2, -1), offs=offs), f_d)
    add("down", "dense", lambda: torch.mm(hr, wd[0].T), f_d)
    # down dgrad + SwiGLU backward
    cfg = heuristics.gemm_config(gemm.KIND_DGRAD_SWIGLU, I, H, 128)
    dwp = torch.empty(R, -(-I // 128), dtype=torch.float32, device="cuda")
    add("dgrad_swiglu", "triton", lambda: gemm.down_dgrad_swiglu_bwd(xs, wd, gu, w, te, nt, dgu=dgu, hw=hw,
                                                                    dw_part=dwp, config=cfg), f_d)
    want = (dgu.clone(), hw.clone(), dwp.sum(1)) if not kinds or "dgrad_swiglu" in kinds else None

    def check_dgrad(vdwp):
        """The last row's dgu, hw against the Triton kernel's (bitwise, and the largest difference) and
        its dw (summed in another order)."""
        r = rows[-1]
        if want is None or not r["ms"]:
            return
        r["same_dgu_hw"] = bool(torch.equal(dgu, want[0]) and torch.equal(hw, want[1]))
        r["dgu_max_diff"] = float((dgu.float() - want[0].float()).abs().max().item())
        r["dw_max_rel"] = float(((vdwp.sum(1) - want[2]).abs().max() / want[2].abs().max()).item())
        print(f"    same dgu, hw: {r['same_dgu_hw']} (max diff {r['dgu_max_diff']:.2e}), dw rel {r['dw_max_rel']:.2e}",
              flush=True)

    for tn, st, pf, ec in DGRAD_WS_VARIANTS:
        vdwp = torch.empty(R, -(-I // tn), dtype=torch.float32, device="cuda")
        add("dgrad_swiglu", f"ws-{tn}-{st}{'' if pf else '-np'}{f'-e{ec}' if ec else ''}",
            lambda: ws.down_dgrad_ws(xs, wd, gu, w, te, nt, dgu, hw, vdwp, sched_bm=128, stages=st, tile_n=tn,
                                     prefetch=pf, epi_cols=ec), f_d)
        check_dgrad(vdwp)
    add("dgrad_swiglu", "floor", lambda: torch._grouped_mm(xr, wd, offs=offs), f_d)
    add("dgrad_swiglu", "dense", lambda: torch.mm(xr, wd[0]), f_d)
    # the FP8 down dgrad + activation backward (dys 1x128, W_down^T [E, I, H] 128x128): the plan's
    # ws kernel (the backward on its consumers), the kernel with an epilogue partition, dense FP8
    if not kinds or "fp8_dgrad" in kinds:
        from tabby.ops.gemm import fp8 as gemm_fp8, fp8_ws
        from tabby.ops.quantize import quantize_blocks, quantize_rows
        dq, dsc = quantize_rows(xs)
        wtq, wts = quantize_blocks(wd.transpose(1, 2).contiguous())
        fk = heuristics.fp8_down_dgrad(128, ws=True, programs=None)
        outs = (dgu, hw, torch.empty(R, -(-I // 128), dtype=torch.float32, device="cuda"))
        add("fp8_dgrad", "ws", lambda: gemm_fp8.down_dgrad_swiglu_fp8(dq, dsc, wtq, wts, gu, w, te, nt, kernel=fk,
                                                                      tile_m=128, outputs=outs), f_d)
        fwant = tuple(t.clone() for t in outs)
        *_, fepi = gemm_fp8._swiglu_bwd_outputs(gu, w, outs[2].shape[1], outs)
        for pf in (False, True):
            add("fp8_dgrad", f"ws-part{'-pf' if pf else ''}",
                lambda: fp8_ws.launch_dgrad(dq, dsc, wtq, wts, te, nt, 128, fepi, I, stages=fk.config.num_stages,
                                            prefetch=pf), f_d)
            if rows[-1]["ms"]:
                rows[-1]["same_dgu_hw"] = bool(torch.equal(outs[0], fwant[0]) and torch.equal(outs[1], fwant[1]))
                print(f"    same dgu, hw: {rows[-1]['same_dgu_hw']}", flush=True)
        one = torch.ones((), device="cuda")
        wt0 = wtq[0]  # one expert's [I, H]: B column-major as its transpose
        add("fp8_dgrad", "dense", lambda: torch._scaled_mm(dq[:n_real], wt0.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16), f_d)
    # gate/up dgrad, pushed
    cfg = heuristics.gemm_config(gemm.KIND_GATE_UP_DGRAD, H, 2 * I, 128)
    add("gate_up_dgrad", "triton", lambda: gemm.gate_up_dgrad_push(gu, wg, wu, te, nt, row_src, ptrs, T * k,
                                                                   config=cfg), f_gu)
    add("gate_up_dgrad", "floor", lambda: torch._grouped_mm(gur, wgu, offs=offs), f_gu)
    add("gate_up_dgrad", "dense", lambda: torch.mm(gur, wgu[0]), f_gu)
    # weight gradients (K = an expert's rows): dW_down = dys^T hw, dW_gate | dW_up = dg | du^T xs
    pad = (counts + 127) // 128 * 128
    es = (torch.cumsum(pad, 0) - pad).to(torch.int32).cuda()
    ec = counts.to(torch.int32).cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hw.normal_()
    dwd, dwg, dwu = torch.empty(E, H, I, **bf), torch.empty(E, I, H, **bf), torch.empty(E, I, H, **bf)
    f_w = 2.0 * n_real * H * I
    cfg = heuristics.wgrad_config(I)
    add("wgrad_down", "triton", lambda: gemm.expert_wgrad(xs, hw, es, ec, config=cfg, programs=sms, out=dwd), f_w)
    for st in (4, 3):
        add("wgrad_down", f"ws-256-{st}", lambda: ws.expert_wgrad_ws([xs], hw, es, ec, [dwd], stages=st), f_w)
    add("wgrad_down", "floor", lambda: torch._grouped_mm(xr.t(), hr, offs=offs), f_w)
    add("wgrad_down", "dense", lambda: torch.mm(xr.t(), hr), f_w)
    cfg = heuristics.wgrad_config(H)
    add("wgrad_gate_up", "triton", lambda: gemm.expert_wgrad_gate_up(gu, xs, es, ec, config=cfg, programs=sms,
                                                                      out_gate=dwg, out_up=dwu), 2 * f_w)
    for st in (4, 3):
        add("wgrad_gate_up", f"ws-256-{st}", lambda: ws.expert_wgrad_ws([gu[:, :I], gu[:, I:]], xs, es, ec, [dwg, dwu],
                                                                         stages=st), 2 * f_w)
    add("wgrad_gate_up", "floor", lambda: torch._grouped_mm(gur.t(), xr, offs=offs), 2 * f_w)
    add("wgrad_gate_up", "dense", lambda: torch.mm(gur.t(), xr), 2 * f_w)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="kimi-k2@ep8,glm-5@ep8,deepseek-v4-pro@ep8,qwen3.5-397b@ep8,"
                                        "qwen3-30b-a3b@ep8,gpt-oss-120b@ep8,qwen3-30b-a3b,gpt-oss-120b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=".")
    ap.add_argument("--kinds", default="", help="only these GEMM kinds (comma-separated: gate_up, down, "
                    "dgrad_swiglu, gate_up_dgrad, wgrad_down, wgrad_gate_up, fp8_dgrad)")
    a = ap.parse_args()
    rows = []
    for name in a.shapes.split(","):
        rows += run_shape(name, a.tokens, set(filter(None, a.kinds.split(","))))
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gemm-cores.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), commit=os.environ.get("TABBY_GIT_COMMIT"), rows=rows), f,
                  indent=1)
    with open(os.path.join(a.out, "gemm-cores.md"), "w") as f:
        f.write("| shape | GEMM | core | ms | TFLOP/s |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['shape']} | {r['kind']} | {r['core']} | "
                    + (f"{r['ms']:.3f} | {r['tflops']:.0f} |\n" if r["ms"] else f"- | {r.get('error', '')[:80]} |\n"))


if __name__ == "__main__":
    main()
