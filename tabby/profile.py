"""``tabby profile``: time every stage of Tabby's forward and backward (CUDA events between launches).

It profiles the sync-free path (``MoEConfig(megakernel=False)``), whose stages are separate launches;
the megakernel's forward is one launch (``fwd:megakernel``), split by ``tabby tune``'s ablations.

Events are recorded at the stage boundaries marked in ``tabby/functional/moe.py``; a stage's time
is the gap between its mark and the previous one, median over iterations, maximum over ranks.
Recording events between launches adds a little time, so the sum is slightly above the
un-instrumented pass measured by ``tabby bench``.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from .functional.config import MoEConfig

from .functional import moe as moe_mod
from .launch import launch
from .shapes import SHAPES, TINY

PROFILE_SHAPES = {**SHAPES, TINY.name: TINY}


class StageTimer:
    """Marks on the current stream: CUDA events on the GPU, wall clock on the CPU."""

    def __init__(self):
        self.marks = []

    def mark(self, name):
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def stages(self) -> dict:
        """{stage: ms}: time from the previous mark of the same pass to this mark."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out, prev = {}, None
        for name, m in self.marks:
            if name.endswith(":start"):
                prev = m
                continue
            ms = prev.elapsed_time(m) if torch.cuda.is_available() else (m - prev) * 1e3
            out[name] = out.get(name, 0.0) + ms
            prev = m
        self.marks.clear()
        return out


def profile_rank(rank, world, shape_name, T, iters, warmup):
    """Per-stage medians on this rank: {stage: ms}."""
    import torch.distributed as dist

    from . import bench

    shape = PROFILE_SHAPES[shape_name]
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    inp = bench.make_inputs(shape, T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    x, weights = inp.x, [inp.w_gate, inp.w_up, inp.w_down]
    timer, samples = StageTimer(), []
    for it in range(warmup + iters):
        moe_mod.STAGE_TIMER = timer if it >= warmup else None
        y = moe_mod.moe(x, inp.topk_idx, inp.topk_weights, *weights, shared=inp.shared, group=group,
                        config=MoEConfig(megakernel=False))
        y.backward(inp.dy)
        moe_mod.STAGE_TIMER = None
        if it >= warmup:
            samples.append(timer.stages())
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    if world > 1:
        vals = torch.tensor(list(med.values()), dtype=torch.float64, device=dev)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        med = dict(zip(med, vals.tolist()))
    return med


def run(shapes, tokens, eps, iters=10, warmup=3, out=None) -> list:
    rows = []
    for shape in shapes:
        for T in tokens:
            for ep in eps:
                if ep > 1:
                    stages = launch(profile_rank, shape, T, iters, warmup, nprocs=ep)
                else:
                    stages = profile_rank(0, 1, shape, T, iters, warmup)
                rows.append(dict(shape=shape, tokens_per_gpu=T, ep=ep, stages_ms=stages))
                total = {p: sum(v for k, v in stages.items() if k.startswith(p)) for p in ("fwd", "bwd")}
                print(f"{shape} T={T} EP{ep}: fwd {total['fwd']:.3f} ms, bwd {total['bwd']:.3f} ms", flush=True)
                for k, v in stages.items():
                    print(f"    {k:28s} {v:9.3f} ms", flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(commit=os.environ.get("TABBY_GIT_COMMIT", "unknown"), rows=rows), f, indent=1)
    return rows
