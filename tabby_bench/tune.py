"""``tabby tune``: time the forward of the megakernel's variants against the sync-free path and the floor.

A variant is ``floor``, ``sync-free`` or ``mega`` with knobs after a colon, comma separated:
``C`` comm programs (``fwd_comm_programs``), ``P`` prefetch, ``R`` ring rows, ``N`` persistent
programs, ``L`` down lag, ``S`` fill split, ``M`` group of row tiles, ``B`` down tile columns,
``U`` gate/up tile columns, ``T`` TMA operand loads (0 off), ``K`` pipeline stages, ``Z`` keep rows
for the backward (0: recompute), ``W`` columns per fill step, ``Q`` half-height tiles (0 off), ``V``
warps per program, ``E`` experts padded to a multiple of E row tiles (1: none), ``J`` pipeline
stages of a fill's column loop, ``Y`` routed tile height (``tile_m``; also ``sync-free:Y=64``),
``D`` column tiles per down ticket, ``X`` next ticket taken in the release's shadow (0: after
it), ``G`` a ticket's polls in one round trip (0: one after the other), ``O`` x published beside
the schedule (0: one after the other), ``F`` a fill's address tables loaded whole (0: an entry
per row), ``I`` per-tile fill counters when rows are kept (0: per ring slot), ``H`` the pass's
peer flags set and waited for inside the kernels (0: signal/wait launches), ``LR`` gate/up reads
this rank's rows from x, the fills copy only other ranks' (0: every row filled), ``ET`` the next
ticket taken before a GEMM's epilogue (1: on), ``PT`` the peers' x pulled whole by a copy engine, no
fills (1: on), ``A`` ablation (1: no row copies, 2: no routed GEMM math, 4:
pushes into the own buffer; the output is then wrong and not checked). Example:
``mega:C=16,R=4096``. Every non-ablated variant's output is compared with the sync-free path's
(bitwise without a shared expert). Forward times: CUDA events per iteration, maximum over ranks,
median; "host ms": the host's time per call with calls enqueued back to back (a pass whose host
time reaches its GPU time is bound by the host).
"""
from __future__ import annotations

import json
import os
import statistics

import torch

from .launch import launch
from .shapes import SHAPES

DEFAULT_VARIANTS = ["floor", "sync-free", "mega", "mega:M=2", "mega:M=4", "mega:B=128", "mega:U=64,B=128",
                    "mega:M=4,B=128", "mega:R=8192", "mega:A=1", "mega:A=2"]
_KNOBS = {"C": "fwd_comm_programs", "P": "fwd_prefetch", "R": "ring_rows", "N": "fwd_programs", "L": "fwd_down_lag",
          "S": "fwd_fill_split", "M": "fwd_group_m", "B": "fwd_down_bn",
          "U": "fwd_gate_up_bn", "A": "fwd_ablate", "T": "fwd_tma", "Y": "tile_m",
          "K": "fwd_num_stages", "Z": "fwd_save_for_backward", "W": "fwd_pull_cols", "Q": "fwd_half_tiles",
          "V": "fwd_num_warps", "D": "fwd_down_cols", "E": "fwd_align_tiles", "J": "fwd_fill_stages",
          "X": "fwd_ticket_ahead", "G": "fwd_poll_together",
          "O": "overlap_publish", "F": "fwd_fill_table", "I": "fwd_tile_ready",
          "H": "fwd_peer_flags", "LR": "fwd_local_rows", "ET": "fwd_early_ticket",
          "PT": "fwd_pull_tokens"}


def parse_variant(spec: str) -> tuple[str, dict]:
    """'mega:C=16,R=4096' -> ('mega', {'fwd_comm_programs': 16, 'ring_rows': 4096})."""
    kind, _, rest = spec.partition(":")
    if kind not in ("floor", "sync-free", "mega"):
        raise ValueError(f"unknown variant kind {kind!r} in {spec!r}: floor, sync-free or mega")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        if key not in _KNOBS or not val.lstrip("-").isdigit():
            raise ValueError(f"bad knob {item!r} in {spec!r}; knobs: {', '.join(f'{k}=<int>' for k in _KNOBS)}")
        knobs[_KNOBS[key]] = int(val)
    if (kind == "floor" and knobs) or (kind == "sync-free" and set(knobs) - {"tile_m"}):
        raise ValueError(f"knobs apply to mega variants only (sync-free takes Y, the tile height): {spec!r}")
    return kind, knobs


def _median_ms(run, warmup, iters):
    """(GPU ms: median over iterations of the max over ranks; host ms per call, max over ranks), from
    the same back-to-back timed calls (no sync between them): a pass whose host time reaches its GPU
    time is bound by the host."""
    from .bench import max_over_ranks, time_iterations_and_host

    times, host = time_iterations_and_host(run, warmup, iters)
    per_iter = max_over_ranks(times + [host])  # one collective for both
    return statistics.median(per_iter[:-1]), per_iter[-1]


def _trace_variant(run_cfg, cfg, events, plot_path=None, title=""):
    """Run ``cfg`` twice more with a trace of ``events`` tickets per program; the second run's summary
    (this rank), and its timeline drawn to ``plot_path`` when given."""
    import dataclasses

    from . import profile
    from .ops import megakernel_fwd

    traced = dataclasses.replace(cfg, fwd_trace_events=events)
    # Twice, and the second run's trace: the first call compiles the traced kernel while the GPU
    # idles (the timeline of such a first call, dcadf79 at qwen3.5-397b, shows every program
    # waiting ~240 us on slow first fills; whether warm launches do too is what a warm trace shows).
    for _ in range(2):
        megakernel_fwd.LAST_TRACE = None
        run_cfg(traced)
        torch.cuda.synchronize()
    if plot_path:
        profile.plot_trace(megakernel_fwd.LAST_TRACE, plot_path, title)
    return profile.summarize_trace(megakernel_fwd.LAST_TRACE)


def tune_rank(rank, world, shape_name, T, variants, warmup, iters, trace_events=0, plot_dir=None, grad=False):
    """[{variant, ms, check}] for one (shape, T, EP) on this rank (ms already max over ranks).

    grad: time the tabby variants as the bench times its forward, under autograd with inputs that
    require grad (the megakernel then also keeps what the backward needs); else without autograd."""
    import torch.distributed as dist

    import tabby

    from . import bench
    from .functional.config import MoEConfig

    dev = torch.device("cuda", torch.cuda.current_device())
    inp = bench.make_inputs(SHAPES[shape_name], T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    keep = (lambda t: t) if grad else (lambda t: t.detach())
    args = (keep(inp.x), inp.topk_idx, keep(inp.topk_weights), keep(inp.w_gate), keep(inp.w_up), keep(inp.w_down))
    shared = tuple(keep(t) for t in inp.shared) if inp.shared else None
    with torch.no_grad():
        base = tabby.moe(*args, shared=shared, group=group, config=MoEConfig(megakernel=False))
    rows = []
    for spec in variants:
        kind, knobs = parse_variant(spec)
        check = None
        try:
            if kind == "floor":
                run = bench.IMPLS["floor"].prepare(inp, group).run_fwd
            else:
                cfg = MoEConfig(megakernel=kind == "mega", **knobs)

                def run(cfg=cfg):
                    with torch.set_grad_enabled(grad):
                        return tabby.moe(*args, shared=shared, group=group, config=cfg)

                if not knobs.get("fwd_ablate"):
                    y = run().detach()
                    # bitwise equal (True) or the relative error (a shared expert or another tile
                    # height may sum in another order)
                    check = True if torch.equal(y, base) else float((y.float() - base.float()).norm()
                                                                    / base.float().norm())
            ms, host = _median_ms(run, warmup, iters)
            tabby.check_errors()
            rows.append(dict(variant=spec, ms=ms, host_ms=host, check=check))
            if trace_events and kind == "mega":
                plot = None
                if plot_dir:
                    # no '=' in file names: the device tool's transfer refuses them ("mega:R=8192" -> "mega_R8192")
                    tag = "".join(ch if ch.isalnum() or ch == "-" else "_" for ch in spec.replace("=", ""))
                    plot = os.path.join(plot_dir, f"trace-{shape_name}-{T}-ep{world}-{tag}-rank{rank}.png")
                summary = _trace_variant(run, cfg, trace_events, plot,
                                         f"{shape_name} T={T} EP{world} {spec}: rank {rank}")
                every = [summary]
                if world > 1:  # every rank's: a rank whose kernel runs longer makes its peers wait
                    every = [None] * world
                    dist.all_gather_object(every, summary)
                rows[-1]["trace"] = every
        except Exception as e:  # noqa: BLE001 -- one bad variant must not lose the others
            rows.append(dict(variant=spec, ms=None, check=None, error=f"{type(e).__name__}: {e}"[:300]))
        if rank == 0:
            r = rows[-1]
            print(f"  {shape_name} T={T} EP{world} {spec:22s} "
                  + (f"{r['ms']:8.3f} ms  check={r['check']}" if r["ms"] is not None else r["error"]), flush=True)
            if r.get("trace"):
                from .profile import format_trace

                t0 = min(tr["start_ns"] for tr in r["trace"])
                for rk, tr in enumerate(r["trace"]):
                    print(f"rank {rk}: starts {(tr['start_ns'] - t0) / 1e3:.1f} us after the first rank's "
                          f"(globaltimer), ends {(tr['end_ns'] - t0) / 1e3:.1f} us; " + format_trace(tr), flush=True)
    return rows


def best_mega_variant(results: list) -> str | None:
    """The knob string of the mega variant (not ablated, correct everywhere) with the lowest
    geometric mean of its time over the sync-free path's across every run in ``results``; None
    when no such variant ran everywhere. ``TABBY_MEGA_VARIANT`` takes it (the bench's tabby)."""
    import math

    from .bench import TOLERANCE  # not at the top: the bench imports this module while it loads

    scores = {}
    for res in results:
        ref = {r["variant"]: r for r in res["rows"]}.get("sync-free")
        if not ref or ref["ms"] is None:
            return None
        for r in res["rows"]:
            kind, knobs = parse_variant(r["variant"])
            correct = r["check"] is True or (isinstance(r["check"], float) and r["check"] <= TOLERANCE["bf16"])
            ok = kind == "mega" and not knobs.get("fwd_ablate") and r["ms"] is not None and correct
            scores.setdefault(r["variant"], []).append(math.log(r["ms"] / ref["ms"]) if ok else None)
    runs = len(results)
    good = {v: sum(x) / runs for v, x in scores.items() if len(x) == runs and None not in x}
    if not good:
        return None
    return min(good, key=good.get).partition(":")[2]


def run(shapes, tokens, eps, variants=None, warmup=3, iters=10, out=None, best_out=None, trace=0,
        grad=False) -> list:
    variants = variants or DEFAULT_VARIANTS
    for v in variants:
        parse_variant(v)  # fail before starting any process
    if not torch.cuda.is_available():
        raise SystemExit("tabby tune times GPU kernels: it needs a GPU")
    results = []
    plot_dir = (os.path.dirname(out) or ".") if out and trace else None  # timelines beside the JSON
    if plot_dir:
        os.makedirs(plot_dir, exist_ok=True)
    for shape in shapes:
        for T in tokens:
            for ep in eps:
                rows = (launch(tune_rank, shape, T, variants, warmup, iters, trace, plot_dir, grad, nprocs=ep)
                        if ep > 1 else tune_rank(0, 1, shape, T, variants, warmup, iters, trace, plot_dir, grad))
                results.append(dict(shape=shape, tokens_per_gpu=T, ep=ep, rows=rows))
                ref = {r["variant"]: r["ms"] for r in rows}
                print(f"\n| {shape} T={T} EP{ep}{' (autograd)' if grad else ''} | ms | host ms | x floor | x sync-free | check |\n"
                      f"|---|---|---|---|---|---|")
                for r in rows:
                    if r["ms"] is None:
                        print(f"| {r['variant']} | error | | | | {r['error']} |")
                        continue
                    xf = f"{r['ms'] / ref['floor']:.2f}" if ref.get("floor") else ""
                    xs = f"{r['ms'] / ref['sync-free']:.2f}" if ref.get("sync-free") else ""
                    print(f"| {r['variant']} | {r['ms']:.3f} | {r['host_ms']:.3f} | {xf} | {xs} | {r['check']} |")
                print(flush=True)
                if out:
                    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
                    with open(out, "w") as f:
                        json.dump(dict(commit=os.environ.get("TABBY_GIT_COMMIT", "unknown"), grad=grad, results=results,
                                       best_mega_variant=best_mega_variant(results)), f, indent=1)
    best = best_mega_variant(results)
    print(f"best mega variant over {len(results)} run(s), by geometric mean vs sync-free: "
          f"{('mega:' + best if best else 'mega (the defaults)') if best is not None else 'none'}", flush=True)
    if best_out and best is not None:
        with open(best_out, "w") as f:
            f.write(best + "\n")
    return results
