"""The backward megakernel against the backward of separate launches, one GPU (EP1).

For each shape: forward (the default megakernel forward, keeping its rows) plus backward with
``Tuning(mega_backward=False)`` and ``True``; medians of CUDA-event times per forward + backward
and per backward alone, peak memory above the inputs, TFLOP/s as the bench counts them, and
whether the two variants' outputs and gradients are bitwise equal. Compilation is done first, in
parallel processes (one per shape and variant, at a small token count), so the timed part is short.

    python scripts/bwd_bench.py --out DIR [--shapes a,b] [--tokens 16384] [--iters 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

SHAPES = "qwen3-30b-a3b,gpt-oss-120b,kimi-k2,glm-5,deepseek-v4-pro,qwen3.5-397b"


def _config(mega_backward: bool):
    from tabby import MoEConfig, Tuning
    return MoEConfig(tuning=Tuning(mega_backward=mega_backward))


def _call(inp, config):
    import tabby
    return tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down,
                     shared=inp.shared, config=config)


def _leaves(inp):
    return [t for t in inp.leaves()]


def run_once(inp, config):
    y = _call(inp, config)
    grads = torch.autograd.grad(y, _leaves(inp), inp.dy)
    return y, grads


def warm(shape_name: str, T: int):
    """Compile every kernel of both variants for this shape (a small call each)."""
    from tabby_bench.shapes import SHAPES as ALL, make_inputs
    inp = make_inputs(ALL[shape_name], T, 1, 0, "cuda")
    for mb in (False, True):
        run_once(inp, _config(mb))
    torch.cuda.synchronize()


def measure(shape_name: str, T: int, iters: int) -> dict:
    from tabby_bench.shapes import SHAPES as ALL, flops, make_inputs
    shape = ALL[shape_name]
    inp = make_inputs(shape, T, 1, 0, "cuda")
    row = {"shape": shape_name, "tokens": T}
    outs = {}
    for mb in (False, True):
        cfg = _config(mb)
        name = "mega" if mb else "separate"
        out = run_once(inp, cfg)  # warm-up (and the workspace)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t_all, t_bwd = [], []
        for _ in range(iters):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            y = _call(inp, cfg)
            e1.record()
            g = torch.autograd.grad(y, _leaves(inp), inp.dy)
            e2.record()
            e2.synchronize()
            t_all.append(e0.elapsed_time(e2))
            t_bwd.append(e1.elapsed_time(e2))
            del y, g
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        med = sorted(t_all)[len(t_all) // 2]
        row[name] = {"fwdbwd_ms": med, "bwd_ms": sorted(t_bwd)[len(t_bwd) // 2], "fwdbwd_all_ms": t_all,
                     "tflops": flops(shape, T, "fwd+bwd") / med / 1e9, "peak_gb": peak}
        outs[name] = [out[0].cpu()] + [g.cpu() for g in out[1]]  # (host memory: the weights' gradients
        del out                                                    # of two variants may not fit the GPU)
        torch.cuda.synchronize()
    a, b = outs["separate"], outs["mega"]
    row["bitwise_equal"] = all(torch.equal(x, y) for x, y in zip(a, b))
    row["speedup_fwdbwd"] = row["separate"]["fwdbwd_ms"] / row["mega"]["fwdbwd_ms"]
    row["speedup_bwd"] = row["separate"]["bwd_ms"] / row["mega"]["bwd_ms"]
    # the same inputs, again: bitwise repeat of the megakernel backward
    y, g = run_once(inp, _config(True))
    row["mega_repeat_bitwise"] = all(torch.equal(x.cpu(), z) for x, z in zip([y, *g], b))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warm-tokens", type=int, default=2048)
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # (a warm-up worker: one shape)
    a = ap.parse_args()
    if a.warm:
        warm(a.warm, a.warm_tokens)
        return
    os.makedirs(a.out, exist_ok=True)
    shapes = [s for s in a.shapes.split(",") if s]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--out", a.out, "--warm", s, "--warm-tokens",
                               str(a.warm_tokens)]) for s in shapes]
    rcs = [p.wait() for p in procs]
    print(f"compiled in {time.time() - t0:.0f} s (worker exit codes {rcs})", flush=True)
    rows = []
    for s in shapes:
        t1 = time.time()
        try:
            row = measure(s, a.tokens, a.iters)
        except Exception as e:  # (reported, and the next shape runs)
            print(f"{s}: {type(e).__name__}: {e}", flush=True)
            rows.append({"shape": s, "tokens": a.tokens, "error": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(f"{s:16s} T={a.tokens}  fwd+bwd separate {row['separate']['fwdbwd_ms']:8.2f} ms "
              f"({row['separate']['tflops']:5.0f} TFLOP/s)  mega {row['mega']['fwdbwd_ms']:8.2f} ms "
              f"({row['mega']['tflops']:5.0f})  bwd {row['separate']['bwd_ms']:7.2f} -> {row['mega']['bwd_ms']:7.2f} ms"
              f"  peak GB {row['separate']['peak_gb']:.2f} / {row['mega']['peak_gb']:.2f}  bitwise "
              f"{row['bitwise_equal']} repeat {row['mega_repeat_bitwise']}  ({time.time() - t1:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    meta = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": os.environ.get("TABBY_GIT_COMMIT", "unknown"), "tokens": a.tokens, "iters": a.iters}
    with open(os.path.join(a.out, "bwd_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = ["| shape | fwd+bwd ms, separate | fwd+bwd ms, megakernel | TFLOP/s | bwd ms | peak GB | bitwise |",
             "|---|--:|--:|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['error']} | | | | | |")
            continue
        s, m = r["separate"], r["mega"]
        lines.append(f"| {r['shape']} | {s['fwdbwd_ms']:.2f} | {m['fwdbwd_ms']:.2f} | {s['tflops']:.0f} -> "
                     f"{m['tflops']:.0f} | {s['bwd_ms']:.2f} -> {m['bwd_ms']:.2f} | {s['peak_gb']:.2f} / "
                     f"{m['peak_gb']:.2f} | {r['bitwise_equal']} |")
    with open(os.path.join(a.out, "bwd_bench.md"), "w") as f:
        f.write(f"{meta}\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
