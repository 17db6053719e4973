#!/usr/bin/env python3
"""The FP8 weight pass against a device-to-device copy (the goal: at least 80% of the copy's
bandwidth): per optimizer step Tabby's FP8 layer reads each bf16 weight once and writes both E4M3
orientations and their 128x128 block scales (``functional.fp8.fp8_layer_weights``, transposes
held). One GPU, each bench shape's experts of one rank (``NAME@epN``), a new weight version per
timed call, the copy of the same bf16 weights timed in the same run, medians.

    PYTHONPATH=. python3 scripts/quant_bandwidth.py --shapes kimi-k2@ep8,gpt-oss-120b@ep8 --out DIR

Bytes counted: the pass reads 2 a parameter and writes 2 (two E4M3 copies) plus the scales; the
copy reads 2 and writes 2. Writes DIR/quant-bandwidth.json and .md (machine, commit, date, rows).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from tabby.functional import fp8
from tabby_bench.records import write_script_table
from tabby_bench.shapes import make_inputs, shape_named
from tabby_bench.timing import time_iterations


def pass_bytes(weights) -> int:
    """Bytes the weight pass moves: bf16 read, two E4M3 writes, two fp32 scale writes per 128x128 block."""
    n = sum(w.numel() for w in weights)
    blocks = sum(w.shape[0] * -(-w.shape[1] // 128) * -(-w.shape[2] // 128) for w in weights)
    return 2 * n + 2 * n + 2 * 4 * blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="kimi-k2@ep8,glm-5@ep8,deepseek-v4-pro@ep8,qwen3.5-397b@ep8,gpt-oss-120b@ep8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rows = []
    for name in a.shapes.split(","):
        inp = make_inputs(shape_named(name), 128, 1, 0, "cuda")
        weights = tuple(w.detach() for w in (inp.w_gate, inp.w_up, inp.w_down))
        copies = tuple(torch.empty_like(w) for w in weights)

        def quantize():
            for w in weights:  # a new version, as after an optimizer step: the pass runs again
                torch.autograd.graph.increment_version(w)
            fp8.fp8_layer_weights(*weights, transposed=True)

        def copy():
            for c, w in zip(copies, weights):
                c.copy_(w)

        q_ms = statistics.median(time_iterations(quantize, 2, a.iters))
        c_ms = statistics.median(time_iterations(copy, 2, a.iters))
        qb, cb = pass_bytes(weights), 4 * sum(w.numel() for w in weights)
        row = dict(shape=name, params=sum(w.numel() for w in weights), pass_ms=q_ms, pass_gbs=qb / q_ms / 1e6,
                   copy_ms=c_ms, copy_gbs=cb / c_ms / 1e6)
        row["pass_vs_copy"] = row["pass_gbs"] / row["copy_gbs"]
        rows.append(row)
        print(f"{name:<22} {row['params'] / 1e9:6.2f} B params  pass {q_ms:7.3f} ms {row['pass_gbs']:7.0f} GB/s  "
              f"copy {c_ms:7.3f} ms {row['copy_gbs']:7.0f} GB/s  {row['pass_vs_copy']:.2f}x the copy", flush=True)
        del inp, weights, copies
        fp8.clear_weight_cache()
        torch.cuda.empty_cache()
    write_script_table(a.out, "quant-bandwidth", "the FP8 weight pass against a copy", rows, [
        ("shape", lambda r: r["shape"]), ("parameters", lambda r: f"{r['params'] / 1e9:.2f} B"),
        ("pass ms", lambda r: f"{r['pass_ms']:.3f}"), ("pass GB/s", lambda r: f"{r['pass_gbs']:.0f}"),
        ("copy ms", lambda r: f"{r['copy_ms']:.3f}"), ("copy GB/s", lambda r: f"{r['copy_gbs']:.0f}"),
        ("pass / copy", lambda r: f"{r['pass_vs_copy']:.2f}")], vars(a))

if __name__ == "__main__":
    main()
