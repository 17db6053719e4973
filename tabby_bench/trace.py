"""Reading the forward megakernel's ticket trace (``Probe(trace_events=N)``; ``tabby tune --trace``).

Layout (``tabby.ops.megakernel.protocol``): int64 [programs, TRACE_HEAD + 4 * events]. Per
program a header (tickets taken, globaltimer ns at its start and end, the cycle counter at its
start and end), then per ticket its kind and the cycle counter when taken, after its waits and
at its end.
"""
from __future__ import annotations

import torch

from tabby.ops.megakernel.protocol import TRACE_HEAD, TRACE_KINDS

HEAD = int(getattr(TRACE_HEAD, "value", TRACE_HEAD))


def trace_events(trace: torch.Tensor) -> list:
    """Per program, ((start_us, end_us, GHz, tickets), events) with events its recorded tickets as
    (kind name, taken, after waits, end) in microseconds from the first program's start; each
    program's cycles converted with its own clock rate (its cycles over its globaltimer span)."""
    t = trace.detach().cpu().double()
    P = t.shape[0]
    E = (t.shape[1] - HEAD) // 4
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
        for code, c_take, c_ready, c_end in t[p, HEAD:HEAD + 4 * n].reshape(n, 4).tolist():
            name = TRACE_KINDS[int(code)] if 0 <= int(code) < len(TRACE_KINDS) else f"code {int(code)}"
            evs.append((name, us(c_take), us(c_ready), us(c_end)))
        out.append(((start_us, (float(t[p, 2]) - t0) / 1e3, ghz, int(t[p, 0])), evs))
    return out


def summarize_trace(trace: torch.Tensor) -> dict:
    """Where the megakernel's programs spent their time, from a ``trace`` of one launch.

    Returns {"span_us", "start_ns", "end_ns", "clock_ghz", "programs", "tickets", "overflow",
    "kinds": {name: {"n", "wait_us", "work_us", "share", "work_share"}}, "between_us"}: per ticket
    kind the mean time from taking a ticket to the end of its waits and from there to its end, and
    the share of all programs' time spent in it (waits and work) and in its work; ``between_us`` is
    the mean gap from one ticket's end to the next one's take (the ticket atomic and the loop).
    """
    progs = trace_events(trace)
    E = (trace.shape[1] - HEAD) // 4
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
