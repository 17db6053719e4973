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

After the stages, a table of the stages that run the routed GEMMs (:data:`STAGE_GEMMS`): their
TFLOP/s (:func:`gemm_flops`, R = T k routed rows a rank: every rank's at EP1, the mean over ranks
above), beside the floor's for the same GEMMs (bf16 ``torch._grouped_mm`` on the rank's routed rows,
as ``floor``; also for the FP8 stages) and the dense matmul's (``timing.dense_matmul``: bf16, FP8
for the FP8 stages). Floor and dense are measured on CUDA only (``-`` on the CPU).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from .launch import launch
from .shapes import SHAPES, TINY, make_inputs, shape_named
from .timing import dense_matmul, max_over_ranks, release_implementation, time_iterations

PROFILE_SHAPES = {**SHAPES, TINY.name: TINY}

# The GEMMs each stage runs (:func:`gemm_flops`' kinds); the megakernel's forward also runs the shared expert's
STAGE_GEMMS = {"fwd:gate_up": ("gate_up",), "fwd:down+push": ("down",),
               "fwd:megakernel": ("gate_up", "down", "shared"), "bwd:recompute": ("gate_up",),
               "bwd:down_dgrad+swiglu": ("down_dgrad",), "bwd:gate_up_dgrad+push": ("gate_up_dgrad",),
               "bwd:wgrad": ("wgrad_down", "wgrad_gate_up"), "bwd:wgrad_down": ("wgrad_down",),
               "bwd:wgrad_gate_up": ("wgrad_gate_up",)}


def gemm_flops(R: int, T: int, H: int, I: int, I_shared: int = 0) -> dict:
    """{GEMM kind: FLOPs} of one rank's layer: R routed rows, T tokens (the shared expert's, when
    I_shared > 0), hidden H, expert intermediate I."""
    flops = {"gate_up": 2 * R * H * 2 * I, "down": 2 * R * I * H, "down_dgrad": 2 * R * H * I,
             "gate_up_dgrad": 2 * R * 2 * I * H, "wgrad_down": 2 * R * H * I, "wgrad_gate_up": 2 * R * 2 * I * H}
    if I_shared:
        flops["shared"] = 2 * T * H * 2 * I_shared + 2 * T * I_shared * H
    return flops


def _each(*calls):
    """One call running ``calls`` in order; no output is kept (each is freed before the next runs)."""
    def run():
        for c in calls:
            c()
    return run


def floor_gemms(p) -> dict:
    """{GEMM kind: call} of the floor (``anchors.floor.FloorProblem`` ``p``): bf16 ``torch._grouped_mm``
    on its routed rows, grouped by local expert at ``p.offs`` (the weight gradients group the rows as
    K), with random operands where the floor's come from an earlier GEMM; "shared": the shared
    expert's dense matmuls on the rank's tokens. Run under ``torch.no_grad()``."""
    gm, offs = torch._grouped_mm, p.offs
    xg, dy, wg, wu, wd = p.xg, p.dyg, p.w_gate, p.w_up, p.w_down
    g, u, h = (torch.randn(xg.shape[0], wg.shape[1], device=xg.device, dtype=xg.dtype) for _ in range(3))
    calls = {"gate_up": _each(lambda: gm(xg, wg.mT, offs=offs), lambda: gm(xg, wu.mT, offs=offs)),
             "down": lambda: gm(h, wd.mT, offs=offs),
             "down_dgrad": lambda: gm(dy, wd, offs=offs),
             "gate_up_dgrad": _each(lambda: gm(g, wg, offs=offs), lambda: gm(u, wu, offs=offs)),
             "wgrad_down": lambda: gm(dy.t(), h, offs=offs),
             "wgrad_gate_up": _each(lambda: gm(g.t(), xg, offs=offs), lambda: gm(u.t(), xg, offs=offs))}
    if p.shared is not None:
        x, (sg, su, sd) = p.x, p.shared
        hs = torch.randn(x.shape[0], sg.shape[0], device=x.device, dtype=x.dtype)
        calls["shared"] = _each(lambda: x @ sg.t(), lambda: x @ su.t(), lambda: hs @ sd.t())
    return calls


def floor_gemm_ms(inp, group, kinds, warmup, iters) -> dict:
    """{GEMM kind: ms} of the floor's GEMMs of ``kinds`` (:func:`floor_gemms`) on this rank's routed
    rows, median of ``iters`` after ``warmup`` (CUDA events), max over ranks. Collective."""
    from .anchors.floor import prepare_floor

    p = prepare_floor(inp.x, inp.topk_idx, inp.w_gate, inp.w_up, inp.w_down, inp.shared, group,
                      generator=inp.generator)
    with torch.no_grad():
        ms = {kind: statistics.median(time_iterations(call, warmup, iters))
              for kind, call in floor_gemms(p).items() if kind in kinds}
    return dict(zip(ms, max_over_ranks(list(ms.values()))))


def gemm_rows(stages, flops, floor_ms, dense, precision) -> list:
    """A dict per stage of ``stages`` ({stage: ms}) that runs GEMMs (:data:`STAGE_GEMMS`): its GEMMs'
    FLOPs and TFLOP/s; the floor's ms and TFLOP/s for the same GEMMs and the stage's ms over them
    (``x_floor``); the dense matmul's TFLOP/s (FP8 for the stages whose GEMMs run in FP8) and the
    stage's fraction of it (``of_dense``). Floor and dense fields None where not measured."""
    rows = []
    for stage, ms in stages.items():
        kinds = [g for g in STAGE_GEMMS.get(stage, ()) if g in flops]
        if not kinds:
            continue
        flop = sum(flops[g] for g in kinds)
        tflops = flop / ms / 1e9
        fl = sum(floor_ms[g] for g in kinds) if floor_ms else None
        fp8 = precision == "fp8" or (precision == "fp8-forward" and stage.startswith("fwd:"))
        d = dense["fp8_tflops" if fp8 else "tflops"] if dense else None
        rows.append(dict(stage=stage, gemms=kinds, flop=flop, ms=ms, tflops=tflops, floor_ms=fl,
                         floor_tflops=flop / fl / 1e9 if fl else None, x_floor=ms / fl if fl else None,
                         dense_tflops=d, of_dense=tflops / d if d else None))
    return rows


def format_gemms(rows, R, dense) -> str:
    """The table of :func:`gemm_rows` ("-": not measured) under a line saying what it compares (R:
    the routed rows a rank of the FLOP model)."""
    cols = (("ms", "ms", 9, ".3f"), ("TFLOP/s", "tflops", 9, ".4g"), ("floor ms", "floor_ms", 9, ".3f"),
            ("floor TFLOP/s", "floor_tflops", 13, ".4g"), ("x floor", "x_floor", 8, ".2f"),
            ("dense TFLOP/s", "dense_tflops", 13, ".4g"), ("of dense", "of_dense", 8, ".3f"))
    compared = (f"floor: bf16 torch._grouped_mm on the same rows (the FP8 stages too); dense: bf16 matmul "
                f"{dense['m']}^3 (the FP8 stages: FP8)" if dense else "floor, dense: - (measured on CUDA only)")
    lines = [f"    GEMM stages (R = T k = {R} routed rows a rank); {compared}",
             f"    {'stage':28s}" + "".join(f" {name:>{w}s}" for name, _, w, _ in cols)]
    for r in rows:
        lines.append(f"    {r['stage']:28s}" + "".join(
            f" {'-' if r[key] is None else format(r[key], spec):>{w}s}" for _, key, w, spec in cols))
    return "\n".join(lines)


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
    """(every rank's per-stage medians [{stage: ms}], the floor's {GEMM kind: ms} of the stages'
    GEMMs (:func:`floor_gemm_ms`), ``timing.dense_matmul``'s figures (this rank's)); the last two
    None on the CPU. ``mega``: the default config, the megakernel; ``fwd_only``: no backward;
    ``precision``: ``MoEConfig.precision``."""
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
    if not torch.cuda.is_available():
        return per_rank, None, None
    del y
    release_implementation()  # the layer's workspaces and buffers, before the floor's operands
    kinds = {g for stage in med for g in STAGE_GEMMS.get(stage, ())}
    return per_rank, floor_gemm_ms(inp, group, kinds, warmup, iters), dense_matmul(warmup=warmup, iters=iters)


def run(shapes, tokens, eps, iters=10, warmup=3, out=None, mega=False, fwd_only=False, precision="bf16") -> list:
    from .records import git_commit

    rows = []
    for shape in shapes:
        for T in tokens:
            for ep in eps:
                if ep > 1:
                    per_rank, floor_ms, dense = launch(profile_rank, shape, T, iters, warmup, mega, fwd_only,
                                                       precision, nprocs=ep)
                else:
                    per_rank, floor_ms, dense = profile_rank(0, 1, shape, T, iters, warmup, mega, fwd_only, precision)
                stages = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
                dims = shape_named(shape, PROFILE_SHAPES)
                flops = gemm_flops(T * dims.k, T, dims.H, dims.I, dims.I_shared)
                gemms = gemm_rows(stages, flops, floor_ms, dense, precision)
                rows.append(dict(shape=shape, tokens_per_gpu=T, ep=ep, megakernel=mega, fwd_only=fwd_only,
                                 precision=precision, stages_ms=stages, stages_ms_per_rank=per_rank, gemms=gemms))
                total = {p: sum(v for k, v in stages.items() if k.startswith(p)) for p in ("fwd", "bwd")}
                print(f"{shape} T={T} EP{ep} {precision}: fwd {total['fwd']:.3f} ms, bwd {total['bwd']:.3f} ms "
                      f"(sums of the slowest rank's stage times; per rank: the columns)", flush=True)
                for k, v in stages.items():
                    ranks = " ".join(f"{r[k]:9.3f}" for r in per_rank) if len(per_rank) > 1 else ""
                    print(f"    {k:28s} {v:9.3f} ms  {ranks}", flush=True)
                print(format_gemms(gemms, T * dims.k, dense), flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(commit=git_commit()[0], rows=rows), f, indent=1)
    return rows
