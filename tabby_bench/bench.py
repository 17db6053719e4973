"""``tabby bench``: correctness and speed of every MoE implementation on the benchmark shapes.

On GPUs, for each (shape, tokens per GPU, EP size, implementation) every rank builds fresh random
inputs (its own seed), checks the implementation against the fp32 reference (forward values and,
for fwd+bwd, dx, d topk_weights and the weight gradients; relative Frobenius error, tolerance 2e-2
for bf16 rows and 8e-2 for FP8 rows), then times the forward (autograd enabled) and forward+backward with CUDA events: each
iteration's time is the maximum over all ranks, the reported time the median over iterations.
By default every timed call starts from a new weight version, as after an optimizer step
(``impls.LayerRun``: the FP8 rows quantize their weights on every call; :data:`WEIGHTS_NOTE`;
``Config.weights`` "fixed" keeps one version, :data:`FIXED_WEIGHTS_NOTE`), and a row's peak memory
counts what it derives from the weights (Tabby's FP8 weight copies are dropped before each timed pass).
The floor is timed first and again after a shape's other implementations; its figure is the mean
of the two (``records.bracket_floor``: the GPU's clock drifts down under sustained load).
TFLOP/s counts 6*T*k*H*I (+ 6*T*H*I_shared) for the forward and three times that for fwd+bwd
(docs/design.md "Measuring"). Ratios: to the compute-only floor of the same (shape, T, EP, pass),
and the speedup over the fastest correct anchor of the row's precision (torch-a2a, torch-symm; for
FP8 rows torch-fp8).

A failure (exception) of one implementation is recorded as ``correct: false, error: "..."`` and
the run goes on; ranks agree on failures after every step so collectives stay in lockstep.
Implementations flagged ``isolate`` (torch-symm: NVSHMEM fixes the process's symmetric-memory
backend) run in worker processes of their own.

Without a GPU the command is the CPU demonstration of ``cpu_demo.py`` instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .anchors.torch_symm import release_buffers
from .check import DTYPES, TOLERANCE, forward_only, within
from .impls import IMPLS, register_tabby
from .launch import LaunchError, launch, under_torchrun  # importing it keeps NVLink multicast off
from .records import (append_history, base_record, bracket_floor, default_out_dir, file_stem, finalize, format_table,
                      header_line, machine_info, plot, progress_line, read_jsonl)
from .shapes import Inputs, make_inputs
from .timing import (attempt, dense_line, dense_matmul, free_memory, max_over_ranks, release_implementation,
                     time_iterations_and_host)


WEIGHTS_NOTE = ("Every timed call starts from a new weight version (as after an optimizer step): the FP8 rows "
                "quantize their weights on every call, and their peaks count the FP8 weight copies.")
FIXED_WEIGHTS_NOTE = ("The weights keep one version over the timed calls (as microbatches between optimizer steps): "
                      "tabby-fp8 reuses its FP8 weight copies; torch-fp8 quantizes its weights on every call.")
WEIGHT_POLICIES = {"new": "new version per timed call", "fixed": "one version over the timed calls"}


@dataclass
class Config:
    shapes: list
    tokens: list
    eps: list
    impls: list
    passes: list
    dtype: str = "bf16"
    warmup: int = 5
    iters: int = 20
    check: bool = True
    out: str | None = None  # None: default_out_dir()
    tag: str = ""
    tuning: str = ""  # Tuning.parse() text for the tabby rows ("" : the heuristics)
    history: str | None = None  # append the records to this history file
    weights: str = "new"  # "new": each timed call from a new weight version; "fixed": one version (WEIGHT_POLICIES)
    partial: str | None = None  # every record also appended here as it is measured (set by run)


def measure(impl, inp: Inputs, group, cfg: Config, timed: bool) -> list:
    """Check and time one implementation on prepared inputs: one record per pass (same on all ranks)."""
    recs = {p: base_record(impl, inp.shape, inp.T, inp.ep, p, cfg.dtype) for p in cfg.passes}

    def fail(msg):
        for r in recs.values():
            r["error"], r["correct"] = msg, False
        return list(recs.values())

    prepared, err = attempt(impl.prepare, inp, group)
    if err:
        return fail(err)
    if hasattr(prepared, "new_weights"):
        prepared.new_weights = cfg.weights == "new"
    if cfg.check:
        errors, err = attempt(prepared.check, "fwd+bwd" in cfg.passes)
        free_memory()
        if err:
            return fail(err)
        for p, r in recs.items():
            r["errors"] = errors if p == "fwd+bwd" else forward_only(errors)
            r["correct"] = within(r["errors"], r["tolerance"])
    if not timed:
        return _noted(impl, recs)
    for p, r in recs.items():
        run = prepared.run_fwdbwd if p == "fwd+bwd" else prepared.run_fwd

        def timed_run(run=run):
            free_memory()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times, host_ms = time_iterations_and_host(run, cfg.warmup, cfg.iters)
            if hasattr(prepared, "raise_device_errors"):
                prepared.raise_device_errors()
            return times, (torch.cuda.max_memory_allocated() - base) / 1e9, host_ms

        t_start = time.time()
        res, err = attempt(timed_run)
        r["t_start"], r["t_end"] = t_start, time.time()  # epoch seconds: the device's clock log aligns by them
        if err:
            r["error"], r["correct"] = err, False
            continue
        times, peak, host_ms = res
        per_iter = max_over_ranks(times + [peak, host_ms])
        r["ms"] = statistics.median(per_iter[:-2])
        r["peak_mem_gb"], r["host_ms"] = per_iter[-2:]
        r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        r["ms_min"] = min(per_iter[:-2])
        r["ms_iters"] = per_iter[:-2]  # in call order: a clock that drops under load shows as a trend
    del prepared
    return _noted(impl, recs)


def _noted(impl, recs: dict) -> list:
    """The records, each with the implementation's note (how it ran), where it has one."""
    if getattr(impl, "note", None) is not None:
        for r in recs.values():
            r["note"] = impl.note()
    return list(recs.values())


# ----------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------


def phases(cfg: Config) -> list:
    """Groups of implementations that share worker processes: the others first, then each isolated one."""
    normal = [n for n in cfg.impls if not IMPLS[n].isolate]
    return ([normal] if normal else []) + [[n] for n in cfg.impls if IMPLS[n].isolate]


def plan_measurements(cfg: Config) -> list:
    """Every (shape, T, ep, impl, pass) in run order."""
    return [(shape, T, ep, name, p) for names in phases(cfg) for shape in cfg.shapes for T in cfg.tokens
            for ep in cfg.eps for name in names for p in cfg.passes]


class _Sink:
    """Rank 0 appends records to a JSON-lines file and prints one progress line per record."""

    def __init__(self, path, start, total, rank, partial=None):
        self.path, self.i, self.total, self.rank, self.partial = path, start, total, rank, partial
        self.t_last = time.monotonic()  # progress lines show the seconds each measurement took

    def emit(self, rec: dict) -> None:
        self.i += 1
        if self.rank != 0:
            return
        for path in filter(None, (self.path, self.partial)):  # the partial file survives a run killed midway
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        now = time.monotonic()
        took, self.t_last = now - self.t_last, now
        print(f"[{self.i}/{self.total}] {progress_line(rec)}  (+{took:.1f} s)", flush=True)

    def note(self, obj: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(obj) + "\n")


_GROUPS: dict = {}


def ep_group(ep: int, rank: int, world: int):
    """The process group of this rank's EP instance (None for EP1); ranks [i*ep, (i+1)*ep) form one."""
    if ep == 1:
        return None
    import torch.distributed as dist

    if ep == world:
        return dist.group.WORLD
    if ep not in _GROUPS:
        mine = None
        for start in range(0, world, ep):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                mine = g
        _GROUPS[ep] = mine
    return _GROUPS[ep]


def gpu_worker(rank: int, world: int, cfg: Config, impl_names: list, path: str, start: int, total: int,
               with_dense: bool) -> None:
    """Run ``impl_names`` over the configured grid on this rank (spawned by :func:`launch`)."""
    from tabby.functional.config import Tuning

    if cfg.tuning:
        register_tabby(Tuning.parse(cfg.tuning))
    sink = _Sink(path, start, total, rank, cfg.partial)
    device = torch.device("cuda", torch.cuda.current_device())
    if with_dense:
        dense, err = attempt(dense_matmul)
        sink.note({"kind": "dense", "result": dense, "error": err})
        if rank == 0 and dense:
            print(dense_line(dense), flush=True)
    impls = [IMPLS[n] for n in impl_names]
    for shape in cfg.shapes:
        for T in cfg.tokens:
            for ep in cfg.eps:
                problem = None
                if world % ep or shape.E % ep:
                    problem = f"EP{ep} needs the world size ({world}) and E ({shape.E}) to be multiples of it"
                group = None
                if problem is None:
                    group, problem = attempt(ep_group, ep, rank, world)
                inp = None
                if problem is None:
                    inp, problem = attempt(make_inputs, shape, T, ep, rank, device, DTYPES[cfg.dtype])
                held = None  # the floor's records, until it is timed again after the others
                for n, impl in enumerate(impls):
                    if problem is not None:
                        recs = [dict(base_record(impl, shape, T, ep, p, cfg.dtype), error=problem, correct=False)
                                for p in cfg.passes]
                    else:
                        recs = measure(impl, inp, group, cfg, timed=True)
                        release_implementation()
                        if impl.name == "floor" and n < len(impls) - 1:
                            held = recs
                            continue
                    for r in recs:
                        sink.emit(r)
                if held is not None:
                    again = measure(IMPLS["floor"], inp, group, dataclasses.replace(cfg, check=False), timed=True)
                    release_implementation()
                    for r in bracket_floor(held, again):
                        sink.emit(r)
                del inp
                release_buffers()
                free_memory()


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def _run_phases(cfg: Config, tmp: str) -> tuple:
    """Run the grid (spawned workers, or this process under torchrun); return (records, dense)."""
    plan = plan_measurements(cfg)
    total = len(plan)
    per = len(cfg.shapes) * len(cfg.tokens) * len(cfg.eps) * len(cfg.passes)
    records, dense, start = [], None, 0
    for k, names in enumerate(phases(cfg)):
        path = os.path.join(tmp, f"phase{k}.jsonl")
        args = (cfg, names, path, start, total, k == 0)
        err = None
        try:
            launch(gpu_worker, *args)
            if under_torchrun():
                import torch.distributed as dist

                dist.barrier()
        except LaunchError as e:
            err = str(e)
            print(f"worker processes failed while running {', '.join(names)}:\n{err}", file=sys.stderr, flush=True)
        recs, notes = read_jsonl(path)
        for n in notes:
            if n["kind"] == "dense" and n.get("result"):
                dense = n["result"]
        done = {(r["shape"], r["tokens_per_gpu"], r["ep"], r["impl"], r["pass"]) for r in recs}
        for shape, T, ep, name, p in plan:
            if name in names and (shape.name, T, ep, name, p) not in done:
                tail = err.strip().splitlines()[-1] if err else "no result"
                recs.append(dict(base_record(IMPLS[name], shape, T, ep, p, cfg.dtype), correct=False,
                                 error=f"worker processes failed before this measurement: {tail}"))
        records += recs
        start += per * len(names)
    return records, dense


def run_notes(cfg: Config, records: list) -> list:
    """Lines for the results' header: the weight policy where FP8 rows ran, how each row with a
    note ran (torch-fp8: whether its quantization was fused)."""
    note = WEIGHTS_NOTE if cfg.weights == "new" else FIXED_WEIGHTS_NOTE
    notes = [note] if any(getattr(IMPLS.get(n), "precision", "") == "fp8" for n in cfg.impls) else []
    shapes: dict = {}  # (impl, note) -> the shapes it ran with that note, in order
    for r in records:
        if r.get("note"):
            shapes.setdefault((r["impl"], r["note"]), {})[r["shape"]] = None
    impls = [name for name, _ in shapes]
    # an implementation that ran with several notes says which shapes each covers
    return notes + [f"{name}: {note} ({', '.join(s)})" if impls.count(name) > 1 else f"{name}: {note}"
                    for (name, note), s in shapes.items()]


def run(cfg: Config) -> dict:
    """Run the benchmark; returns the result dict (also written under ``cfg.out`` by rank 0)."""
    if not torch.cuda.is_available():
        from . import cpu_demo

        return cpu_demo.run(cfg)
    out = cfg.out or default_out_dir()
    os.makedirs(out, exist_ok=True)
    cfg = dataclasses.replace(cfg, partial=os.path.join(out, "partial-records.jsonl"))
    with tempfile.TemporaryDirectory(prefix="tabby-bench-") as tmp:
        records, dense = _run_phases(cfg, tmp)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return {}
    finalize(records)
    info = machine_info()
    result = dict(schema="tabby-bench/1", mode="gpu", **info,
                  config=dict(shapes=[s.name for s in cfg.shapes], tokens=cfg.tokens, ep=cfg.eps, impls=cfg.impls,
                              passes=cfg.passes, dtype=cfg.dtype, warmup=cfg.warmup, iters=cfg.iters, check=cfg.check,
                              tolerance=TOLERANCE[cfg.dtype], tuning=cfg.tuning, weights=WEIGHT_POLICIES[cfg.weights]),
                  dense_matmul=dense, dense_matmul_tflops=dense["tflops"] if dense else None, records=records)
    stem = os.path.join(out, file_stem(info, cfg.tag))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if os.path.exists(cfg.partial):  # the complete JSON supersedes it
        os.remove(cfg.partial)
    header = f"# tabby bench: {info['machine']}\n\n{header_line(info)}\n\n"
    if cfg.tuning:
        header += f"tabby rows with Tuning({cfg.tuning})\n\n"
    notes = run_notes(cfg, records)
    header += "".join(n + "\n\n" for n in notes)
    if dense:
        header += dense_line(dense) + "\n\n"
    table = format_table(records)
    with open(stem + ".md", "w") as f:
        f.write(header + table + "\n")
    files = [stem + ".json", stem + ".md"]
    if plot(records, result["dense_matmul_tflops"], stem + ".png"):
        files.append(stem + ".png")
    print()
    print("\n".join(notes + [table]))
    print("\nwrote " + ", ".join(files), flush=True)
    if cfg.history:
        n = append_history(stem + ".json", cfg.history)
        print(f"appended {n} records to {cfg.history}", flush=True)
    return result
