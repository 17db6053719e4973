"""``tabby profile``: time every stage of Tabby's forward and backward (CUDA events between launches),
and read the megakernel's ticket trace.

It profiles the sync-free path (``MoEConfig(megakernel=False)``), whose stages are separate launches,
or with ``mega`` the default layer: the megakernel's forward is one launch (``fwd:megakernel``) between
the publish / schedule and the signal / combine launches; inside, it is split by ``tabby tune``'s
ablations and by its ticket trace (``MoEConfig.fwd_trace_events``; ``summarize_trace``, ``format_trace``,
``plot_trace`` below, used by ``tabby tune --trace``).

Events are recorded at the stage boundaries marked in ``tabby/functional/moe.py``; a stage's time
is the gap between its mark and the previous one, median over iterations; ``stages_ms`` is the
maximum over ranks, ``stages_ms_per_rank`` every rank's (a rank that waits for a slower peer shows
it in its signal+wait stage).
The iterations run back to back, as in ``tabby bench`` (the events are read after the last one):
a stage's time is then the GPU's, and a gap the GPU spends waiting for the host shows in the stage
whose launch came late. Recording events between launches adds a little time, so the sum is
slightly above the un-instrumented pass. With ``MoEConfig.fwd_peer_flags`` (the megakernel's
default) the forward's publish and peer waits run inside the count and megakernel launches: its
``publish+wait``, ``wait_x`` and ``signal+wait`` stages then hold no launch (near 0) and the
``schedule`` and ``megakernel`` stages include them (``scripts/timeline.py`` shows each kernel). ``fwd_only``: forward passes only (under autograd, as the
bench's forward), no backward in the loop.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from .functional.config import MoEConfig

from .functional import moe as moe_mod, steps as steps_mod
from .launch import launch
from .shapes import SHAPES, TINY

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


def profile_rank(rank, world, shape_name, T, iters, warmup, mega=False, fwd_only=False):
    """Per-stage medians on this rank: {stage: ms} (``mega``: the default config, the megakernel;
    ``fwd_only``: no backward)."""
    import torch.distributed as dist

    from . import bench

    shape = PROFILE_SHAPES[shape_name]
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    inp = bench.make_inputs(shape, T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    x, weights = inp.x, [inp.w_gate, inp.w_up, inp.w_down]
    timer = StageTimer()
    for it in range(warmup + iters):
        if it == warmup and torch.cuda.is_available():
            torch.cuda.synchronize()
        steps_mod.STAGE_TIMER = timer if it >= warmup else None
        y = moe_mod.moe(x, inp.topk_idx, inp.topk_weights, *weights, shared=inp.shared, group=group,
                        config=MoEConfig(megakernel=mega))
        if not fwd_only:
            y.backward(inp.dy)
        steps_mod.STAGE_TIMER = None
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


def run(shapes, tokens, eps, iters=10, warmup=3, out=None, mega=False, fwd_only=False) -> list:
    rows = []
    for shape in shapes:
        for T in tokens:
            for ep in eps:
                if ep > 1:
                    per_rank = launch(profile_rank, shape, T, iters, warmup, mega, fwd_only, nprocs=ep)
                else:
                    per_rank = profile_rank(0, 1, shape, T, iters, warmup, mega, fwd_only)
                stages = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
                rows.append(dict(shape=shape, tokens_per_gpu=T, ep=ep, megakernel=mega, fwd_only=fwd_only,
                                 stages_ms=stages, stages_ms_per_rank=per_rank))
                total = {p: sum(v for k, v in stages.items() if k.startswith(p)) for p in ("fwd", "bwd")}
                print(f"{shape} T={T} EP{ep}: fwd {total['fwd']:.3f} ms, bwd {total['bwd']:.3f} ms "
                      f"(sums of the slowest rank's stage times; per rank: the columns)", flush=True)
                for k, v in stages.items():
                    ranks = " ".join(f"{r[k]:9.3f}" for r in per_rank) if len(per_rank) > 1 else ""
                    print(f"    {k:28s} {v:9.3f} ms  {ranks}", flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(commit=os.environ.get("TABBY_GIT_COMMIT", "unknown"), rows=rows), f, indent=1)
    return rows


# --------------------------------------------------------------------------------------------
# The megakernel's ticket trace (layout: ops/megakernel_fwd.py, TRACE_HEAD)
# --------------------------------------------------------------------------------------------

def trace_events(trace: torch.Tensor) -> list:
    """Per program, its recorded tickets as (kind name, taken, after waits, end) in microseconds
    from the first program's start; each program's cycles converted with its own clock rate (its
    cycles over its globaltimer span). Also returns per program (start_us, end_us, GHz): a list of
    (program_span, events)."""
    from .ops.megakernel_fwd import TRACE_HEAD, TRACE_KINDS

    t = trace.detach().cpu().double()
    P, head = t.shape[0], TRACE_HEAD.value
    E = (t.shape[1] - head) // 4
    used = t[:, 0] > 0
    t0 = float(t[used, 1].min()) if used.any() else 0.0
    out = []
    for p in range(P):
        n = min(int(t[p, 0]), E)
        span_ns = max(float(t[p, 2] - t[p, 1]), 1.0)
        ghz = float(t[p, 4] - t[p, 3]) / span_ns
        rate = ghz if ghz > 0 else 1.0
        start_us = (float(t[p, 1]) - t0) / 1e3

        def us(c, p=p, rate=rate, start_us=start_us):
            return start_us + (c - float(t[p, 3])) / rate / 1e3

        evs = []
        for code, c_take, c_ready, c_end in t[p, head:head + 4 * n].reshape(n, 4).tolist():
            name = TRACE_KINDS[int(code)] if 0 <= int(code) < len(TRACE_KINDS) else f"code {int(code)}"
            evs.append((name, us(c_take), us(c_ready), us(c_end)))
        out.append(((start_us, (float(t[p, 2]) - t0) / 1e3, ghz, int(t[p, 0])), evs))
    return out


def summarize_trace(trace: torch.Tensor) -> dict:
    """Where the megakernel's programs spent their time, from a ``trace`` of one launch.

    Returns {"span_us", "clock_ghz", "programs", "tickets", "overflow", "kinds": {name: {"n", "wait_us",
    "work_us", "share", "work_share"}}, "between_us"}: per ticket kind the mean time from taking a
    ticket to the end of its waits and from there to its end, and the share of all programs' time
    spent in it (waits and work) and in its work; ``between_us`` is the mean gap from one ticket's
    end to the next one's take (the ticket atomic and the loop).
    """
    from .ops.megakernel_fwd import TRACE_HEAD

    progs = trace_events(trace)
    E = (trace.shape[1] - TRACE_HEAD.value) // 4
    total_us = sum(end - start for (start, end, _, n), _ in progs if n > 0)
    waits, works, gaps = {}, {}, []
    for _, evs in progs:
        for name, take, ready, end in evs:
            waits.setdefault(name, []).append(ready - take)
            works.setdefault(name, []).append(end - ready)
        gaps += [b[1] - a[3] for a, b in zip(evs, evs[1:])]
    kinds = {}
    for name in waits:
        w, k = waits[name], works[name]
        kinds[name] = dict(n=len(w), wait_us=sum(w) / len(w), work_us=sum(k) / len(k),
                           share=(sum(w) + sum(k)) / total_us if total_us else 0.0,
                           work_share=sum(k) / total_us if total_us else 0.0)
    live = [(start, end, ghz) for (start, end, ghz, n), _ in progs if n > 0]
    t = trace.detach().cpu()
    started = t[:, 0] > 0
    return dict(span_us=max(e for _, e, _ in live) - min(s for s, _, _ in live) if live else 0.0,
                # the GPU's globaltimer (ns) at the first program's start and the last one's end: compared
                # across ranks only as far as the GPUs' timers agree
                start_ns=int(t[started, 1].min()) if started.any() else 0,
                end_ns=int(t[started, 2].max()) if started.any() else 0,
                clock_ghz=sum(g for _, _, g in live) / len(live) if live else 0.0, programs=len(progs),
                tickets=sum(n for (_, _, _, n), _ in progs), overflow=sum(1 for (_, _, _, n), _ in progs if n > E),
                kinds=kinds, between_us=sum(gaps) / len(gaps) if gaps else 0.0)


def format_trace(summary: dict) -> str:
    """A small table of ``summarize_trace``'s result."""
    s = summary
    lines = [f"megakernel trace: {s['programs']} programs, {s['tickets']} tickets, span {s['span_us']:.1f} us, "
             f"clock {s['clock_ghz']:.2f} GHz, {s['between_us']:.2f} us between tickets"
             + (f", {s['overflow']} programs overflowed the trace" if s["overflow"] else ""),
             "| ticket | n | wait us | work us | share of program time (wait+work) | work share |",
             "|---|---|---|---|---|---|"]
    for name, k in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["share"]):
        lines.append(f"| {name} | {k['n']} | {k['wait_us']:.2f} | {k['work_us']:.2f} | {k['share']:.3f} | "
                     f"{k['work_share']:.3f} |")
    return "\n".join(lines)


TRACE_COLORS = {"fill": "tab:orange", "fill remote": "tab:red", "gate/up": "tab:blue", "down": "tab:green",
                "shared gate/up": "tab:purple", "shared down": "tab:pink", "empty": "lightgrey"}


def plot_trace(trace: torch.Tensor, path: str, title: str = "") -> None:
    """A timeline of one launch: a row per program, each ticket's work colored by kind, its waits grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    progs = trace_events(trace)
    fig, ax = plt.subplots(figsize=(14, max(4, len(progs) * 0.045)))
    for p, (_, evs) in enumerate(progs):
        waits = [(take, ready - take) for _, take, ready, _ in evs if ready > take]
        ax.broken_barh(waits, (p, 0.9), facecolors="0.75", linewidth=0)
        for kind in {e[0] for e in evs}:
            ax.broken_barh([(ready, end - ready) for name, _, ready, end in evs if name == kind], (p, 0.9),
                           facecolors=TRACE_COLORS.get(kind, "black"), linewidth=0)
    ax.set_xlabel("us from the first program's start")
    ax.set_ylabel("program")
    ax.set_ylim(0, len(progs))
    ax.set_title(title or "megakernel tickets")
    kinds = sorted({e[0] for _, evs in progs for e in evs})
    ax.legend(handles=[Patch(color=TRACE_COLORS.get(k, "black"), label=k) for k in kinds]
              + [Patch(color="0.75", label="waiting")], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
