"""``tabby profile``: time every stage of Tabby's forward and backward (CUDA events between launches).

It profiles the sync-free path (``MoEConfig(megakernel=False)``), whose stages are separate launches,
or with ``mega`` the default layer: the megakernel's forward is one launch (``fwd:megakernel``) between
the publish / schedule and the signal / combine launches; inside, ``tabby tune``'s ablations and
ticket trace (``trace.py``) split it.

The layer marks its stage boundaries on a ``Probe``'s stage timer (``tabby.functional.probe``); a
stage's time is the gap between its mark and the previous one, median over iterations;
``stages_ms`` is the maximum over ranks, ``stages_ms_per_rank`` every rank's (a rank that waits for
a slower peer shows it in its signal+wait stage). The iterations run back to back, as in ``tabby
bench`` (the events are read after the last one): a stage's time is then the GPU's, and a gap the
GPU spends waiting for the host shows in the stage whose launch came late. Recording events between
launches adds a little time, so the sum is slightly above the un-instrumented pass. Where the
megakernel's peer flags are set and waited for inside its kernels, the forward's ``publish+wait``,
``wait_x`` and ``signal+wait`` stages hold no launch (near 0) and the ``schedule`` and
``megakernel`` stages include them (``scripts/timeline.py`` shows each kernel). ``fwd_only``:
forward passes only (under autograd, as the bench's forward), no backward in the loop.
On the CPU (shape ``tiny``) the stages are wall-clock times of the Triton interpreter.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from .launch import launch
from .shapes import SHAPES, TINY, make_inputs, shape_named

PROFILE_SHAPES = {**SHAPES, TINY.name: TINY}


class StageTimer:
    """Marks on the current stream: CUDA events on the GPU, wall clock on the CPU."""

    def __init__(self):
        self.marks = []  # this iteration's (name, event)
        self.done = []  # closed iterations' marks

    def mark(self, name):
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def next_iteration(self):
        """Close this iteration's marks (read later by :meth:`iterations`, without a sync now)."""
        self.done.append(self.marks)
        self.marks = []

    def iterations(self) -> list:
        """[{stage: ms}] of every closed iteration (one device sync)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = [self._stages(m) for m in self.done]
        self.done = []
        return out

    @staticmethod
    def _stages(marks) -> dict:
        """{stage: ms}: time from the previous mark of the same pass to each mark."""
        out, prev = {}, None
        for name, m in marks:
            if name.endswith(":start"):
                prev = m
                continue
            ms = prev.elapsed_time(m) if torch.cuda.is_available() else (m - prev) * 1e3
            out[name] = out.get(name, 0.0) + ms
            prev = m
        return out


def profile_rank(rank, world, shape_name, T, iters, warmup, mega=False, fwd_only=False, precision="bf16"):
    """Per-stage medians on this rank: {stage: ms} (``mega``: the default config, the megakernel;
    ``fwd_only``: no backward; ``precision``: ``MoEConfig.precision``)."""
    import torch.distributed as dist

    from tabby.functional.config import MoEConfig
    from tabby.functional.moe import moe_with_probe
    from tabby.functional.probe import Probe

    from . import log
    from .impls import fp8_transposes_fit

    log.configure()
    shape = shape_named(shape_name, PROFILE_SHAPES)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    inp = make_inputs(shape, T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    x, weights = inp.x, [inp.w_gate, inp.w_up, inp.w_down]
    timer = StageTimer()
    # FP8: the weights' transposes cached where they fit, as the bench's tabby-fp8 row
    config = MoEConfig(megakernel=mega, precision=precision,
                       cache_fp8_transposes=precision != "fp8" or fp8_transposes_fit(x, *weights))
    for it in range(warmup + iters):
        if it == warmup and torch.cuda.is_available():
            torch.cuda.synchronize()
        probe = Probe(stage_timer=timer if it >= warmup else None)
        y = moe_with_probe(x, inp.topk_idx, inp.topk_weights, *weights, shared=inp.shared, group=group,
                           config=config, probe=probe)
        if not fwd_only:  # the gradients returned and dropped, as the bench's rows: accumulated into
            # .grad they would live through the next forward (deepseek-v4-pro's at EP1 do not fit beside it)
            torch.autograd.grad(y, inp.leaves(), inp.dy, allow_unused=True)
        if it >= warmup:
            timer.next_iteration()
    samples = timer.iterations()
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    per_rank = [med]
    if world > 1:  # every rank's medians: a stage slower on one rank (rank skew) shows as the peer's wait
        vals = torch.tensor(list(med.values()), dtype=torch.float64, device=dev)
        every = [torch.empty_like(vals) for _ in range(world)]
        dist.all_gather(every, vals)
        per_rank = [dict(zip(med, v.tolist())) for v in every]
    return per_rank


def run(shapes, tokens, eps, iters=10, warmup=3, out=None, mega=False, fwd_only=False, precision="bf16") -> list:
    from .records import git_commit

    rows = []
    for shape in shapes:
        for T in tokens:
            for ep in eps:
                if ep > 1:
                    per_rank = launch(profile_rank, shape, T, iters, warmup, mega, fwd_only, precision, nprocs=ep)
                else:
                    per_rank = profile_rank(0, 1, shape, T, iters, warmup, mega, fwd_only, precision)
                stages = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
                rows.append(dict(shape=shape, tokens_per_gpu=T, ep=ep, megakernel=mega, fwd_only=fwd_only,
                                 precision=precision, stages_ms=stages, stages_ms_per_rank=per_rank))
                total = {p: sum(v for k, v in stages.items() if k.startswith(p)) for p in ("fwd", "bwd")}
                print(f"{shape} T={T} EP{ep} {precision}: fwd {total['fwd']:.3f} ms, bwd {total['bwd']:.3f} ms "
                      f"(sums of the slowest rank's stage times; per rank: the columns)", flush=True)
                for k, v in stages.items():
                    ranks = " ".join(f"{r[k]:9.3f}" for r in per_rank) if len(per_rank) > 1 else ""
                    print(f"    {k:28s} {v:9.3f} ms  {ranks}", flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(commit=git_commit()[0], rows=rows), f, indent=1)
    return rows
