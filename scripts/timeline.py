"""Kernel timeline of Tabby's forward (under autograd, as the bench times it) on every rank.

    python3 scripts/timeline.py --shape qwen3-30b-a3b --tokens 16384 --ep 2 --out $OUT/res/timeline.json

torch.profiler (CUPTI) records every kernel and copy of a few back-to-back forwards; for the middle
one it prints, per rank, each launch's start (from the forward's first), its GPU time and the idle
gap before it on its stream. What the stage profile (CUDA events between launches) cannot show:
how much of a small stage is the kernel and how much the gap around it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabby_bench.launch import launch  # noqa: E402
from tabby_bench.shapes import SHAPES, make_inputs  # noqa: E402


def _rank(rank, world, shape_name, T, n_fwd, megakernel, tuning, precision):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import tabby
    from tabby.functional.config import MoEConfig, Tuning

    dev = torch.device("cuda", torch.cuda.current_device())
    inp = make_inputs(SHAPES[shape_name], T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    cfg = MoEConfig(megakernel=megakernel, tuning=Tuning.parse(tuning), precision=precision)

    def fwd():
        return tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down,
                         shared=inp.shared, group=group, config=cfg)

    for _ in range(5):
        fwd()
    torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_fwd):
            fwd()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        kernels.append(dict(name=e.name[:60], start_us=e.time_range.start, dur_us=e.time_range.end - e.time_range.start))
    kernels.sort(key=lambda r: r["start_us"])
    every = [None] * world
    if world > 1:
        dist.all_gather_object(every, kernels)
    else:
        every = [kernels]
    return every  # launch() returns rank 0's: every rank's kernels


def per_forward(kernels, n_fwd):
    """Split the sorted kernels into forwards at the megakernel-or-combine boundary: a forward ends
    with its combine (the last kernel named like it)."""
    ends = [i for i, r in enumerate(kernels) if "combine" in r["name"]]
    if len(ends) < n_fwd:
        return [kernels]
    out, lo = [], 0
    for i in ends[:n_fwd]:
        out.append(kernels[lo:i + 1])
        lo = i + 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--ep", type=int, default=None, help="EP size (default: every GPU)")
    ap.add_argument("--n-fwd", type=int, default=5)
    ap.add_argument("--megakernel", type=int, default=1, help="1: the forward megakernel, 0: the sync-free path")
    ap.add_argument("--tuning", default="", help="a tabby Tuning, e.g. 'group_m=2,tma=0' (default: the heuristics)")
    ap.add_argument("--precision", default="bf16", help="MoEConfig.precision (fp8 needs --megakernel 0)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.ep = a.ep or torch.cuda.device_count()
    per_rank = launch(_rank, a.shape, a.tokens, a.n_fwd, bool(a.megakernel), a.tuning, a.precision, nprocs=a.ep)
    result = dict(shape=a.shape, tokens=a.tokens, ep=a.ep, megakernel=bool(a.megakernel), tuning=a.tuning,
                  precision=a.precision,
                  commit=os.environ.get("TABBY_GIT_COMMIT", "unknown"), ranks=[])
    for rank, kernels in enumerate(per_rank):
        fwds = per_forward(kernels, a.n_fwd)
        mid = fwds[len(fwds) // 2]
        t0 = mid[0]["start_us"]
        rows, prev_end = [], None
        for r in mid:
            gap = 0.0 if prev_end is None else r["start_us"] - prev_end
            rows.append(dict(name=r["name"], at_us=r["start_us"] - t0, dur_us=r["dur_us"], gap_us=gap))
            prev_end = max(prev_end or 0, r["start_us"] + r["dur_us"])
        span = [f[-1]["start_us"] + f[-1]["dur_us"] - f[0]["start_us"] for f in fwds]
        period = [fwds[i + 1][0]["start_us"] - fwds[i][0]["start_us"] for i in range(len(fwds) - 1)]
        result["ranks"].append(dict(rank=rank, rows=rows, span_us=span, period_us=period))
        print(f"\n## rank {rank}: forward spans (us) {[round(s, 1) for s in span]}, periods {[round(p, 1) for p in period]}")
        print("| at us | GPU us | gap before | kernel |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['at_us']:.1f} | {r['dur_us']:.1f} | {r['gap_us']:.1f} | {r['name']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
