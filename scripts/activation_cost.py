#!/usr/bin/env python3
"""What an experts' activation costs against plain SwiGLU (issue: at most 3% of the layer's time):
the layer's forward and forward + backward at bench shapes with each ``tabby.Activation`` kind, one
GPU, the kinds interleaved round by round (so that clock drift falls on all alike), medians.

    PYTHONPATH=. python3 scripts/activation_cost.py --shapes qwen3-30b-a3b@ep8,gpt-oss-120b@ep8 --out DIR

Writes DIR/activation-cost.json and .md (machine, commit, date, every median).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from datetime import datetime, timezone

import torch

import tabby
from tabby.activation import Activation
from tabby_bench.shapes import make_inputs, shape_named
from tabby_bench.timing import time_iterations

KINDS = {"swiglu": Activation(), "swiglu-clamp": Activation("swiglu-clamp", limit=10.0),
         "swiglu-clamp-out": Activation("swiglu-clamp-out", limit=7.0),
         "gpt-oss": Activation("gpt-oss", limit=7.0, alpha=1.702), "geglu": Activation("geglu")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b@ep8,gpt-oss-120b@ep8,kimi-k2@ep8")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    commit = os.environ.get("TABBY_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for name in a.shapes.split(","):
        shape = shape_named(name)
        inp = make_inputs(shape, a.tokens, 1, 0, "cuda")
        for precision in a.precisions.split(","):
            for pass_ in ("fwd", "fwd+bwd"):
                times = {k: [] for k in KINDS}
                for _ in range(a.rounds):
                    for kind, act in KINDS.items():
                        cfg = tabby.MoEConfig(activation=act, precision=precision)

                        def run(cfg=cfg):
                            y = tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down,
                                          config=cfg)
                            if pass_ == "fwd+bwd":
                                torch.autograd.backward(y, inp.dy)

                        times[kind] += time_iterations(run, 2, a.iters)
                base = statistics.median(times["swiglu"])
                for kind in KINDS:
                    ms = statistics.median(times[kind])
                    rows.append(dict(shape=name, tokens=a.tokens, precision=precision, pass_=pass_, kind=kind,
                                     activation=str(KINDS[kind]), ms=ms, vs_swiglu=ms / base))
                    print(f"{name:<18} {precision:<5} {pass_:<8} {kind:<17} {ms:8.3f} ms  {ms / base:6.3f}x swiglu",
                          flush=True)
                for t in inp.leaves():
                    t.grad = None
        del inp
        torch.cuda.empty_cache()
    head = dict(machine=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), argv=vars(a))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "activation-cost.json"), "w") as f:
        json.dump(dict(head, rows=rows), f, indent=1)
    with open(os.path.join(a.out, "activation-cost.md"), "w") as f:
        f.write(f"# the experts' activations against SwiGLU: {head['machine']}, commit {commit}, {head['date']}\n\n"
                "| shape | T | precision | pass | activation | ms | x SwiGLU |\n|---|--:|---|---|---|--:|--:|\n")
        for r in rows:
            f.write(f"| {r['shape']} | {r['tokens']} | {r['precision']} | {r['pass_']} | {r['activation']} | "
                    f"{r['ms']:.3f} | {r['vs_swiglu']:.3f} |\n")


if __name__ == "__main__":
    main()
