"""``tabby tune``: time the forward of Tabby's variants against each other and the floor (GPU).

A variant is ``floor``, ``sync-free`` or ``mega``, with fields after a colon, comma separated:
any field of ``tabby.Tuning`` (``mega:group_m=2,tma=0``, ``sync-free:dispatch_rows=64``; booleans
as 0/1), ``save_for_backward=0`` (``MoEConfig``: the megakernel keeps only its ring, the backward
recomputes), and ``ablate=N`` (``Probe``, mega only: 1 no row copies, 2 no routed GEMM math, 4
pushes into the own buffer; measurement only, the output is then wrong and not checked).

Every other variant's output is compared with the sync-free path's defaults (bitwise without a
shared expert, else the relative error). Forward times: CUDA events per iteration, maximum over
ranks, median; "host ms": the host's time per call with calls enqueued back to back (a pass whose
host time reaches its GPU time is bound by the host). ``--trace N`` runs each mega variant again
with a ticket trace of N tickets per program and prints where its programs spent their time.
The best mega variant (geometric mean of its time over the sync-free path's, over every run)
is printed as the ``--tuning`` text of ``tabby bench``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import torch

from .check import TOLERANCE
from .launch import launch
from .shapes import SHAPES, make_inputs
from .timing import median_ms

DEFAULT_VARIANTS = ["floor", "sync-free", "mega", "mega:group_m=2", "mega:group_m=4", "mega:ring_rows=8192",
                    "mega:tma=0", "mega:save_for_backward=0", "mega:ablate=1", "mega:ablate=2"]
KINDS = ("floor", "sync-free", "mega")


@dataclass(frozen=True)
class Variant:
    spec: str
    kind: str  # floor, sync-free or mega
    config: object | None  # the MoEConfig (None: the floor)
    ablate: int = 0  # Probe.ablate

    @property
    def tuning_text(self) -> str:
        return self.config.tuning.describe() if self.config is not None else ""


def parse_variant(spec: str) -> Variant:
    """'mega:group_m=2,tma=0' -> Variant('mega', MoEConfig(megakernel=True, tuning=Tuning(group_m=2, tma=False))).
    Raises ValueError naming the variant."""
    from tabby.functional.config import MoEConfig, Tuning
    from tabby.validate import MoEInputError

    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown variant kind {kind!r} in {spec!r}: {', '.join(KINDS)}")
    items = [s.strip() for s in rest.split(",") if s.strip()]
    if kind == "floor":
        if items:
            raise ValueError(f"the floor takes no fields: {spec!r}")
        return Variant(spec, kind, None)
    ablate, keep, tuning = 0, True, []
    for item in items:
        name, _, value = item.partition("=")
        if name in ("ablate", "save_for_backward"):
            if kind != "mega":
                raise ValueError(f"{name} applies to mega variants only: {spec!r}")
            if not value.isdigit():
                raise ValueError(f"{item!r} in {spec!r}: {name} takes a non-negative integer")
            if name == "ablate":
                ablate = int(value)
            else:
                keep = bool(int(value))
        else:
            tuning.append(item)
    try:
        config = MoEConfig(megakernel=kind == "mega", save_for_backward=keep, tuning=Tuning.parse(",".join(tuning)))
    except MoEInputError as e:
        names = ", ".join(f.name for f in fields(Tuning))
        raise ValueError(f"{spec!r}: {e} (fields: {names}, save_for_backward, ablate)") from None
    return Variant(spec, kind, config, ablate)


def _check(y, base):
    """True when bitwise equal, else the relative error (a shared expert or another tile height may
    sum in another order)."""
    if torch.equal(y, base):
        return True
    return float((y.float() - base.float()).norm() / base.float().norm())


def _trace_variant(run, events, ablate=0, plot_path=None, title=""):
    """Run ``run(probe)`` twice more with a trace of ``events`` tickets per program (and ``ablate``);
    the second run's
    summary (this rank), and its timeline drawn to ``plot_path`` when given. Twice: the first call
    compiles the traced kernel while the GPU idles; the second shows a warm launch."""
    from tabby.functional.probe import Probe

    from . import trace

    probe = None
    for _ in range(2):
        probe = Probe(trace_events=events, ablate=ablate)
        run(probe)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if plot_path:
        trace.plot_trace(probe.trace, plot_path, title)
    return trace.summarize_trace(probe.trace)


def tune_rank(rank, world, shape_name, T, variants, warmup, iters, trace_events=0, plot_dir=None, grad=False):
    """[{variant, ms, host_ms, check}] for one (shape, T, EP) on this rank (ms already max over ranks).

    grad: time the tabby variants as the bench times its forward, under autograd with inputs that
    require grad (the megakernel then also keeps what the backward needs); else without autograd."""
    import torch.distributed as dist

    import tabby
    from tabby.functional.config import MoEConfig
    from tabby.functional.moe import moe_with_probe
    from tabby.functional.probe import Probe

    from . import log
    from .impls import IMPLS
    from .trace import format_trace

    log.configure()
    dev = torch.device("cuda", torch.cuda.current_device())
    inp = make_inputs(SHAPES[shape_name], T, world, rank, dev)
    group = dist.group.WORLD if world > 1 else None
    keep = (lambda t: t) if grad else (lambda t: t.detach())
    args = (keep(inp.x), inp.topk_idx, keep(inp.topk_weights), keep(inp.w_gate), keep(inp.w_up), keep(inp.w_down))
    shared = tuple(keep(t) for t in inp.shared) if inp.shared else None
    with torch.no_grad():
        base = tabby.moe(*args, shared=shared, group=group, config=MoEConfig(megakernel=False))
    rows = []
    for spec in variants:
        v = parse_variant(spec)
        check = None
        try:
            if v.kind == "floor":
                run = IMPLS["floor"].prepare(inp, group).run_fwd
            else:
                def call(probe=None, v=v):
                    with torch.set_grad_enabled(grad):
                        if probe is None and not v.ablate:  # what a user runs
                            return tabby.moe(*args, shared=shared, group=group, config=v.config)
                        return moe_with_probe(*args, shared=shared, group=group, config=v.config,
                                              probe=probe or Probe(ablate=v.ablate))

                run = call
                if not v.ablate:
                    check = _check(run().detach(), base)
            ms, host = median_ms(run, warmup, iters)
            tabby.check_errors()
            rows.append(dict(variant=spec, ms=ms, host_ms=host, check=check))
            if trace_events and v.kind == "mega":
                plot = None
                if plot_dir:
                    # no '=' or ',' in file names ("mega:group_m=2" -> "mega_group_m2")
                    tag = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in spec.replace("=", ""))
                    plot = os.path.join(plot_dir, f"trace-{shape_name}-{T}-ep{world}-{tag}-rank{rank}.png")
                summary = _trace_variant(call, trace_events, v.ablate, plot,
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
            print(f"  {shape_name} T={T} EP{world} {spec:28s} "
                  + (f"{r['ms']:8.3f} ms  check={r['check']}" if r["ms"] is not None else r["error"]), flush=True)
            if r.get("trace"):
                t0 = min(tr["start_ns"] for tr in r["trace"])
                for rk, tr in enumerate(r["trace"]):
                    print(f"rank {rk}: starts {(tr['start_ns'] - t0) / 1e3:.1f} us after the first rank's "
                          f"(globaltimer), ends {(tr['end_ns'] - t0) / 1e3:.1f} us; " + format_trace(tr), flush=True)
    return rows


def best_mega_variant(results: list) -> str | None:
    """The Tuning text (``tabby bench --tuning``) of the mega variant, not ablated, keeping its rows
    for the backward and correct everywhere, with the lowest geometric mean of its time over the
    sync-free path's across every run in ``results``; "" when that is the defaults, None when no
    such variant ran everywhere."""
    scores = {}
    for res in results:
        ref = {r["variant"]: r for r in res["rows"]}.get("sync-free")
        if not ref or ref["ms"] is None:
            return None
        for r in res["rows"]:
            v = parse_variant(r["variant"])
            correct = r["check"] is True or (isinstance(r["check"], float) and r["check"] <= TOLERANCE["bf16"])
            ok = (v.kind == "mega" and not v.ablate and v.config.save_for_backward and r["ms"] is not None
                  and correct)
            scores.setdefault(r["variant"], []).append(math.log(r["ms"] / ref["ms"]) if ok else None)
    runs = len(results)
    good = {spec: sum(x) / runs for spec, x in scores.items() if len(x) == runs and None not in x}
    if not good:
        return None
    return parse_variant(min(good, key=good.get)).tuning_text


def format_rows(shape, T, ep, grad, rows) -> str:
    ref = {r["variant"]: r["ms"] for r in rows}
    lines = [f"| {shape} T={T} EP{ep}{' (autograd)' if grad else ''} | ms | host ms | x floor | x sync-free | check |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['variant']} | error | | | | {r['error']} |")
            continue
        xf = f"{r['ms'] / ref['floor']:.2f}" if ref.get("floor") else ""
        xs = f"{r['ms'] / ref['sync-free']:.2f}" if ref.get("sync-free") else ""
        lines.append(f"| {r['variant']} | {r['ms']:.3f} | {r['host_ms']:.3f} | {xf} | {xs} | {r['check']} |")
    return "\n".join(lines)


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
                print("\n" + format_rows(shape, T, ep, grad, rows) + "\n", flush=True)
                if out:
                    from .records import git_commit

                    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
                    with open(out, "w") as f:
                        json.dump(dict(commit=git_commit()[0], grad=grad, results=results,
                                       best_mega_variant=best_mega_variant(results)), f, indent=1)
    best = best_mega_variant(results)
    if best is None:
        print("best mega variant: none ran correctly everywhere", flush=True)
    else:
        print(f"best mega variant over {len(results)} run(s), by geometric mean vs sync-free: "
              f"{'the defaults' if best == '' else best!r} (tabby bench --tuning {best!r})", flush=True)
    if best_out and best is not None:
        with open(best_out, "w") as f:
            f.write(best + "\n")
    return results
