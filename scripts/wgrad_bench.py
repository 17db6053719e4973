"""Tile configs of the bf16 weight gradient (``gemm.expert_wgrad_kernel``, one program per SM) on one GPU.

At each shape's routed rows (T*k = 131072 rows spread evenly over E experts, 128-row padded
segments, as scripts/fp8_bench.py), both launchers of the backward (tabby/functional/backward.py):
``expert_wgrad(dys [R, H], hw [R, I])`` (dW_down, [E, H, I]) and ``expert_wgrad_gate_up(dgu [R, 2I],
xs [R, H])`` (dW_gate, dW_up, [E, I, H] each). Per config: median ms (CUDA events), TFLOP/s over the
real rows, the output's relative difference from the launchers' default config's, and whether
the timed runs left the first run's output bit for bit (determinism).

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

from tabby.ops.gemm import bf16 as gemm  # noqa: E402
from tabby.ops.gemm.bf16 import GemmConfig  # noqa: E402
from tabby_bench.shapes import SHAPES  # noqa: E402


def C(bm, bn, bk, w, s, group_m=8):
    return GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, GROUP_M=group_m)


# (name, config); None: the launchers' default_config, the reference of the other rows
VARIANTS = [("default", None), ("128x256x32/8w/5s", C(128, 256, 32, 8, 5)), ("128x256x64/8w/3s", C(128, 256, 64, 8, 3)),
            ("128x128x32/8w/4s", C(128, 128, 32, 8, 4)), ("128x128x64/4w/3s", C(128, 128, 64, 4, 3))]
TINY_VARIANTS = [("16x32x16/4w/2s", C(16, 32, 16, 4, 2, 2)), ("16x16x32/4w/2s", C(16, 16, 32, 4, 2, 2))]


def timed(fn, iters, warmup):
    if torch.cuda.is_available():
        return bench(fn, iters=iters, warmup=warmup)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def rel_diff(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def run_shape(name, E, H, I, rows, variants, iters, warmup, dev):
    R, _, _, start, count = even_schedule(rows, E, device=dev)
    real = int(count.sum())
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(n, m):
        return torch.randn(n, m, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    dys, hw, dgu, xs = rnd(R, H), rnd(R, I), rnd(R, 2 * I), rnd(R, H)
    flops = {"down": 2 * real * H * I, "gate_up": 2 * 2 * real * I * H}
    outs = {"down": (torch.empty(E, H, I, dtype=torch.bfloat16, device=dev),),
            "gate_up": tuple(torch.empty(E, I, H, dtype=torch.bfloat16, device=dev) for _ in range(2))}
    launch = {"down": lambda o, cfg: gemm.expert_wgrad(dys, hw, start, count, out=o[0], config=cfg),
              "gate_up": lambda o, cfg: gemm.expert_wgrad_gate_up(dgu, xs, start, count, out_gate=o[0], out_up=o[1],
                                                                  config=cfg)}
    ref, res = {}, []
    for vname, cfg in variants:
        c = cfg or gemm.default_config(gemm.KIND_WGRAD, I, None, M=H)  # (gate/up's default: the same at N >= 256)
        row = {"shape": name, "variant": vname, "config": [c.BM, c.BN, c.BK, c.num_warps, c.num_stages]}
        if cfg is None:
            row["variant"] = f"default {c.BM}x{c.BN}x{c.BK}/{c.num_warps}w/{c.num_stages}s"
        for kind in ("down", "gate_up"):
            o = outs[kind]
            try:
                launch[kind](o, cfg)  # compile; the output the checks read
                first = tuple(t.clone() for t in o)
                ref.setdefault(kind, first)
                ms = timed(lambda o=o, cfg=cfg, kind=kind: launch[kind](o, cfg), iters, warmup)
                row[kind] = {"ms": ms, "tflops": flops[kind] / ms / 1e9,
                             "rel_diff": max(rel_diff(f, r) for f, r in zip(first, ref[kind])),
                             "repeat_bitwise": all(torch.equal(t, f) for t, f in zip(o, first))}
            except Exception as e:  # noqa: BLE001 -- a config that does not fit is reported, not fatal
                row[kind] = {"ms": float("nan"), "tflops": float("nan"), "rel_diff": float("nan"),
                             "repeat_bitwise": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        d, u = row["down"], row["gate_up"]
        row["wgrad_ms"] = d["ms"] + u["ms"]
        print(f"{name:14s} {row['variant']:26s} down {d['ms']:7.3f} ms {d['tflops']:6.1f} TF/s  "
              f"gate_up {u['ms']:7.3f} ms {u['tflops']:6.1f} TF/s  sum {row['wgrad_ms']:7.3f} ms  "
              f"rel diff {d['rel_diff']:.1e} / {u['rel_diff']:.1e}  "
              f"repeat bitwise {d['repeat_bitwise']} / {u['repeat_bitwise']}"
              + "".join(f"  [{k}: {r['error']}]" for k, r in (("down", d), ("gate_up", u)) if "error" in r),
              flush=True)
        res.append(row)
    return {"shape": name, "E": E, "H": H, "I": I, "rows": real, "R": R, "rows_per_expert": real // E,
            "variants": res}


def markdown(meta, shapes):
    lines = [(f"# bf16 weight gradient tile configs ({meta['device']}, torch {meta['torch']}, "
              f"triton {meta['triton']}, {meta['time']})"), "",
             (f"T*k = {meta['rows']} routed rows spread evenly; {meta['programs']} programs (one per SM); TFLOP/s "
              "over the real rows; rel diff: from the default config's output; repeat bitwise: the timed runs left "
              "the first run's output."), "",
             "| shape | config | dW_down ms | TFLOP/s | dW_gate+up ms | TFLOP/s | wgrad ms | rel diff | repeat bitwise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        for r in s["variants"]:
            d, u = r["down"], r["gate_up"]
            lines.append(f"| {s['shape']} | {r['variant']} | {d['ms']:.3f} | {d['tflops']:.0f} | {u['ms']:.3f} | "
                         f"{u['tflops']:.0f} | {r['wgrad_ms']:.3f} | {max(d['rel_diff'], u['rel_diff']):.1e} | "
                         f"{d['repeat_bitwise'] and u['repeat_bitwise']} |")
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
    import triton
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
            "programs": gemm._wgrad_programs(torch.device(dev, 0) if cuda else torch.device("cpu")),
            "rows": 203 if a.tiny else a.rows,
            "torch": torch.__version__, "triton": triton.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("TABBY_GIT_COMMIT", "")}
    print(meta, flush=True)
    shapes = []
    if a.tiny:
        shapes.append(run_shape("tiny", 5, 48, 40, meta["rows"], TINY_VARIANTS, 1, 0, dev))
    else:
        for name in a.shapes.split(","):
            s = SHAPES[name]
            shapes.append(run_shape(name, s.E, s.H, s.I, a.rows, VARIANTS, a.iters, a.warmup, dev))
            torch.cuda.empty_cache()
    md = markdown(meta, shapes)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "wgrad_bench.json"), "w") as f:
            json.dump({"meta": meta, "shapes": shapes}, f, indent=1)
        with open(os.path.join(a.out, "wgrad_bench.md"), "w") as f:
            f.write(md)
    bad = [(s["shape"], r["variant"], k) for s in shapes for r in s["variants"] for k in ("down", "gate_up")
           if r[k]["repeat_bitwise"] is False]
    if bad:
        print(f"FAIL: an output changed between runs: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
