"""The bf16 weight gradient's kernels on one GPU: the default (one program per output tile) at a few
tile configs, and the persistent one (``expert_wgrad(..., persistent=True)``: ~#SMs programs, each
one flattened loop over its tiles' K steps; measurement only, not yet the default).

At each shape's routed rows (T*k = 131072 rows spread evenly over E experts, 128-row padded
segments, as scripts/fp8_bench.py), both launchers of the backward (tabby/functional/backward.py):
``expert_wgrad(dys [R, H], hw [R, I])`` (dW_down, [E, H, I]) and ``expert_wgrad_gate_up(dgu [R, 2I],
xs [R, H])`` (dW_gate, dW_up, [E, I, H] each). Per variant: median ms (CUDA events), TFLOP/s over the
real rows, and whether its output is BITWISE the default's (the persistent kernel at the default
config must be). Ends with the wgrad phase (both launchers) per shape: default vs the best variant.

    PYTHONPATH=$PWD python3 scripts/wgrad_bench.py [--shapes kimi-k2,qwen3-30b-a3b] [--iters 20] [--out DIR]
    PYTHONPATH=$PWD python3 scripts/wgrad_bench.py --tiny   # a CPU smoke run under the interpreter

--out DIR: DIR/wgrad_bench.json and DIR/wgrad_bench.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_bench import bench, even_schedule  # noqa: E402

from tabby.ops import gemm  # noqa: E402
from tabby.ops.gemm import GemmConfig  # noqa: E402
from tabby_bench.shapes import SHAPES  # noqa: E402


def C(bm, bn, bk, w, s):
    return GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, GROUP_M=8)


# (name, config, persistent, programs per SM); the first is the default, the reference of the bitwise check
VARIANTS = [
    ("default 128x256x32/8w/4s", C(128, 256, 32, 8, 4), False, 0),
    ("128x128x32/4w/4s", C(128, 128, 32, 4, 4), False, 0),
    ("128x128x64/4w/3s", C(128, 128, 64, 4, 3), False, 0),
    ("128x256x64/8w/3s", C(128, 256, 64, 8, 3), False, 0),
    ("128x256x32/8w/5s", C(128, 256, 32, 8, 5), False, 0),
    ("persistent 128x256x32/8w/4s x1/SM", C(128, 256, 32, 8, 4), True, 1),
    ("persistent 128x128x32/4w/4s x2/SM", C(128, 128, 32, 4, 4), True, 2),
]
TINY_VARIANTS = [("default 16x32x16/4w/2s", GemmConfig(BM=16, BN=32, BK=16, num_warps=4, num_stages=2, GROUP_M=2),
                  False, 0),
                 ("16x16x32/4w/2s", GemmConfig(BM=16, BN=16, BK=32, num_warps=4, num_stages=2, GROUP_M=2), False, 0),
                 ("persistent 16x32x16/4w/2s", GemmConfig(BM=16, BN=32, BK=16, num_warps=4, num_stages=2, GROUP_M=2),
                  True, 1)]


def timed(fn, iters, warmup):
    if torch.cuda.is_available():
        return bench(fn, iters=iters, warmup=warmup)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def run_shape(name, E, H, I, rows, variants, iters, warmup, sms, dev):
    R, _, _, start, count = even_schedule(rows, E, device=dev)
    real = int(count.sum())
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(n, m):
        return torch.randn(n, m, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    dys, hw, dgu, xs = rnd(R, H), rnd(R, I), rnd(R, 2 * I), rnd(R, H)
    fl_down, fl_gu = 2 * real * H * I, 2 * 2 * real * I * H
    ref_down = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev)
    ref_g, ref_u = (torch.empty(E, I, H, dtype=torch.bfloat16, device=dev) for _ in range(2))
    out_down = torch.empty_like(ref_down)
    out_g, out_u = torch.empty_like(ref_g), torch.empty_like(ref_u)
    res = []
    for j, (vname, cfg, persistent, per_sm) in enumerate(variants):
        first = j == 0
        od, og, ou = (ref_down, ref_g, ref_u) if first else (out_down, out_g, out_u)
        kw = dict(config=cfg, persistent=persistent, programs=per_sm * sms if persistent else None)
        row = {"shape": name, "variant": vname, "config": [cfg.BM, cfg.BN, cfg.BK, cfg.num_warps, cfg.num_stages],
               "persistent": persistent, "programs": kw["programs"]}
        for kind, fn, flops in (
                ("down", lambda od=od, kw=kw: gemm.expert_wgrad(dys, hw, start, count, out=od, **kw), fl_down),
                ("gate_up", lambda og=og, ou=ou, kw=kw: gemm.expert_wgrad_gate_up(dgu, xs, start, count, out_gate=og,
                                                                                 out_up=ou, **kw), fl_gu)):
            try:
                if not first:
                    for t in ((od,) if kind == "down" else (og, ou)):
                        t.fill_(float("nan"))
                fn()  # compile, and the output the bitwise check reads
                same = True if first else (torch.equal(od, ref_down) if kind == "down"
                                           else torch.equal(og, ref_g) and torch.equal(ou, ref_u))
                ms = timed(fn, iters, warmup)
                row[kind] = {"ms": ms, "tflops": flops / ms / 1e9, "bitwise": same}
            except Exception as e:  # noqa: BLE001 -- a variant that does not fit is reported, not fatal
                row[kind] = {"ms": float("nan"), "tflops": float("nan"), "bitwise": None,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"}
        d, u = row["down"], row["gate_up"]
        row["wgrad_ms"] = d["ms"] + u["ms"]
        print(f"{name:14s} {vname:36s} down {d['ms']:7.3f} ms {d['tflops']:6.1f} TF/s bitwise {d['bitwise']}  "
              f"gate_up {u['ms']:7.3f} ms {u['tflops']:6.1f} TF/s bitwise {u['bitwise']}  "
              f"sum {row['wgrad_ms']:7.3f} ms" + "".join(f"  [{k}: {r['error']}]" for k, r in (("down", d), ("gate_up", u))
                                                      if "error" in r), flush=True)
        res.append(row)
    return {"shape": name, "E": E, "H": H, "I": I, "rows": real, "R": R, "rows_per_expert": real // E,
            "k_steps_at_bk32": -(-(real // E) // 32), "variants": res}


def markdown(meta, shapes):
    lines = [f"# bf16 weight gradient kernels ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['time']})", "",
             f"T*k = {meta['rows']} routed rows spread evenly; TFLOP/s over the real rows; bitwise: output equal to the "
             "default's bit for bit.", "",
             "| shape | variant | programs | dW_down ms | TFLOP/s | bitwise | dW_gate+up ms | TFLOP/s | bitwise | "
             "wgrad ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        for r in s["variants"]:
            d, u = r["down"], r["gate_up"]
            lines.append(f"| {s['shape']} | {r['variant']} | {r['programs'] or 'tiles'} | {d['ms']:.3f} | "
                         f"{d['tflops']:.0f} | {d['bitwise']} | {u['ms']:.3f} | {u['tflops']:.0f} | {u['bitwise']} | "
                         f"{r['wgrad_ms']:.3f} |")
    lines.append("")
    for s in shapes:
        v = [r for r in s["variants"] if r["wgrad_ms"] == r["wgrad_ms"]]
        if not v:
            continue
        best = min(v, key=lambda r: r["wgrad_ms"])
        lines.append(f"- {s['shape']} (E {s['E']}, {s['rows_per_expert']} rows per expert, "
                     f"{s['k_steps_at_bk32']} K steps of 32): default {s['variants'][0]['wgrad_ms']:.3f} ms, "
                     f"best {best['variant']} {best['wgrad_ms']:.3f} ms")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2,qwen3-30b-a3b")
    ap.add_argument("--rows", type=int, default=131072, help="routed rows (T*k), spread evenly over E")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shape and tiles (a CPU smoke run of this script)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 3
    import triton
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "sms": sms, "rows": a.rows,
            "torch": torch.__version__, "triton": triton.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("TABBY_GIT_COMMIT", "")}
    print(meta, flush=True)
    shapes = []
    if a.tiny:
        shapes.append(run_shape("tiny", 5, 48, 40, 203, TINY_VARIANTS, 1, 0, sms, dev))
    else:
        for name in a.shapes.split(","):
            s = SHAPES[name]
            shapes.append(run_shape(name, s.E, s.H, s.I, a.rows, VARIANTS, a.iters, a.warmup, sms, dev))
            torch.cuda.empty_cache()
    md = markdown(meta, shapes)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "wgrad_bench.json"), "w") as f:
            json.dump({"meta": meta, "shapes": shapes}, f, indent=1)
        with open(os.path.join(a.out, "wgrad_bench.md"), "w") as f:
            f.write(md)
    bad = [(s["shape"], r["variant"]) for s in shapes for r in s["variants"]
           if r["persistent"] and r["config"] == s["variants"][0]["config"]
           and not (r["down"]["bitwise"] and r["gate_up"]["bitwise"])]
    if bad:
        print(f"FAIL: the persistent kernel at the default config is not bitwise the default: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
