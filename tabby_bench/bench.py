"""``tabby bench``: correctness and speed of every MoE implementation on the DESIGN.md shapes.

For each (shape, tokens per GPU, EP size, implementation) every rank builds fresh random inputs
(its own seed), checks the implementation against the fp32 reference (forward values and, for
fwd+bwd, dx, d topk_weights and the weight gradients; relative Frobenius error, tolerance 2e-2
for bf16), then times the forward (autograd enabled) and forward+backward with CUDA events: each
iteration's time is the maximum over all ranks, the reported time the median over iterations.
The floor is timed first and again after a shape's other implementations; its figure is the mean
of the two (``bracket_floor``: the GPU's clock drifts down under sustained load).
TFLOP/s counts 6*T*k*H*I (+ 6*T*H*I_shared) for the forward and three times that for fwd+bwd
(DESIGN.md "Measuring"). Ratios: to the compute-only floor of the same (shape, T, EP, pass), and
the speedup over the fastest correct anchor (torch-a2a, torch-symm).

Implementations live in :data:`IMPLS`; :func:`register` adds one. An implementation's
``prepare(inputs, group)`` runs outside timing and returns an object with ``run_fwd()``,
``run_fwdbwd()`` and ``check(with_grads) -> {name: relative error}``. ``tabby.moe`` (same
signature as ``moe_reference`` plus ``config=None``) is registered as "tabby" when it exists;
modules named in the environment variable TABBY_BENCH_PLUGINS are imported and may register more.

A failure (exception) of one implementation is recorded as ``correct: false, error: "..."`` and
the run goes on; ranks agree on failures after every step so collectives stay in lockstep.
Implementations flagged ``isolate`` (torch-symm: NVSHMEM fixes the process's symmetric-memory
backend) run in worker processes of their own.

Without a GPU: the TINY shape on the CPU, single process and EP2 over gloo, errors only.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from .anchors.floor import ErrorSums, expert_fp32, floor_errors, floor_forward, floor_fwdbwd, prepare_floor
from .anchors.torch_a2a import dispatch_rows, moe_torch_a2a, return_rows, route_plan
from .anchors.torch_symm import moe_torch_symm, release_buffers
from .launch import LaunchError, launch, under_torchrun  # importing it keeps NVLink multicast off
from .reference import combine_k, moe_reference
from .shapes import TINY, Shape, make_routing, make_weights

PASSES = ("fwd", "fwd+bwd")
ANCHORS = ("torch-a2a", "torch-symm")
TOLERANCE = {"bf16": 2e-2}
DTYPES = {"bf16": torch.bfloat16}
CPU_TOKENS = 64


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """One rank's layer inputs; x, topk_weights, the weights (and shared) are leaves requiring grad."""

    shape: Shape
    T: int
    ep: int
    x: torch.Tensor  # [T, H]
    topk_idx: torch.Tensor  # [T, k] int64 global expert ids
    topk_weights: torch.Tensor  # [T, k] fp32
    w_gate: torch.Tensor  # [E_local, I, H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [E_local, H, I]
    shared: tuple | None
    dy: torch.Tensor  # [T, H] output gradient for fwd+bwd
    generator: torch.Generator

    def args(self):
        return (self.x, self.topk_idx, self.topk_weights, self.w_gate, self.w_up, self.w_down, self.shared)

    def leaves(self):
        return [self.x, self.topk_weights, self.w_gate, self.w_up, self.w_down, *(self.shared or ())]


def input_seed(shape: Shape, T: int, ep: int, rank: int) -> int:
    """Deterministic per (shape, T, EP, rank): every implementation sees the same inputs, ranks differ."""
    return (zlib.crc32(f"{shape.name}/{T}/{ep}".encode()) + 1_000_003 * rank) % (2 ** 63)


def make_inputs(shape: Shape, T: int, ep: int, rank: int, device, dtype=torch.bfloat16) -> Inputs:
    """Fresh random inputs (never zeros) for this rank: E_local = E // ep experts, x ~ N(0, 1)."""
    gen = torch.Generator(device=device).manual_seed(input_seed(shape, T, ep, rank))
    x = torch.randn(T, shape.H, generator=gen, device=device).to(dtype)
    idx, tw = make_routing(T, shape.E, shape.k, generator=gen, device=device)
    (wg, wu, wd), sh = make_weights(shape, shape.E // ep, dtype=dtype, device=device, generator=gen)
    dy = torch.randn(T, shape.H, generator=gen, device=device).to(dtype)
    inp = Inputs(shape, T, ep, x, idx, tw, wg, wu, wd, sh, dy, gen)
    for t in inp.leaves():
        t.requires_grad_(True)
    return inp


def flops(shape: Shape, T: int, pass_: str) -> float:
    """MoE-layer FLOPs per GPU: 6*T*k*H*I (+ 6*T*H*I_shared) forward, 3x that forward+backward."""
    f = 6.0 * T * shape.k * shape.H * shape.I + 6.0 * T * shape.H * shape.I_shared
    return f * (3 if pass_ == "fwd+bwd" else 1)


# ----------------------------------------------------------------------------------------------
# The fp32 reference check, memory-frugal
# ----------------------------------------------------------------------------------------------

def layer_errors(fn, inp: Inputs, group, with_grads: bool) -> dict:
    """Relative errors of ``fn`` (moe_reference's signature) against fp32, summed over all ranks.

    The forward is compared with :func:`moe_reference` itself (run without autograd). The
    gradients come from a per-expert fp32 computation that upcasts one expert at a time (autograd
    through moe_reference would keep fp32 copies of every expert: 68 GB for kimi-k2 at EP1): the
    rows are routed like torch-a2a routes them and each expert's output is cross-checked against
    moe_reference's forward, so a routing mistake cannot hide.
    """
    y = fn(*inp.args(), group=group)
    grads = (torch.autograd.grad(y, inp.leaves(), inp.dy, allow_unused=True, materialize_grads=True)
             if with_grads else None)
    y = y.detach()
    errs = ErrorSums()
    with torch.no_grad():
        y_ref = moe_reference(*(t.detach() if t is not None else None for t in inp.args()[:6]),
                              shared=tuple(w.detach() for w in inp.shared) if inp.shared else None, group=group)
        errs.add("y", y, y_ref)
        if with_grads:
            _reference_grads(inp, grads, group, errs, y_ref)
    del y, grads, y_ref
    return errs.relative()


def _reference_grads(inp: Inputs, grads, group, errs: ErrorSums, y_ref) -> None:
    x, idx, tw, wg, wu, wd = (t.detach() for t in inp.args()[:6])
    T, k = idx.shape
    H = x.shape[1]
    plan = route_plan(idx, wg.shape[0], group)
    xg = dispatch_rows(x[plan.tok], plan, group)
    dyg = dispatch_rows(inp.dy[plan.tok], plan, group)
    wsg = dispatch_rows(tw.reshape(-1)[plan.perm].float()[:, None].contiguous(), plan, group)[:, 0]
    M = xg.shape[0]
    yg = torch.empty(M, H, dtype=torch.float32, device=x.device)
    dxg = torch.empty_like(yg)
    dtwg = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    start = 0
    for e, m in enumerate(plan.offs.tolist()):
        sl = slice(start, m)
        ye, dxe, dwge, dwue, dwde = expert_fp32(xg[sl], wsg[sl, None] * dyg[sl].float(), wg[e], wu[e], wd[e])
        yg[sl], dxg[sl] = ye, dxe
        dtwg[sl, 0] = (dyg[sl].float() * ye).sum(1)
        errs.add("dw_gate", grads[2][e], dwge)
        errs.add("dw_up", grads[3][e], dwue)
        errs.add("dw_down", grads[4][e], dwde)
        start = m
    del xg, dyg, wsg

    def back(rows_grouped, width):
        rows = return_rows(rows_grouped, plan, group)
        rep = torch.empty(T * k, width, dtype=rows.dtype, device=rows.device)
        rep[plan.perm] = rows
        return rep.view(T, k, width)

    y_f32 = combine_k(back(yg, H), tw, torch.float32)  # sum_k w * y_e in k order
    del yg
    dx = back(dxg, H).sum(1)
    del dxg
    errs.add("dtopk_weights", grads[1], back(dtwg, 1)[..., 0])
    if inp.shared is not None:
        sh = tuple(w.detach() for w in inp.shared)
        ys, dxs, dsg, dsu, dsd = expert_fp32(x, inp.dy, *sh)
        y_f32 = y_f32 + ys
        dx = dx + dxs
        for name, g, r in (("dshared_gate", grads[5], dsg), ("dshared_up", grads[6], dsu),
                           ("dshared_down", grads[7], dsd)):
            errs.add(name, g, r)
    errs.add("dx", grads[0], dx)
    # Self-check: the per-expert path must reproduce moe_reference's forward (bf16-rounded there).
    drift = ((y_f32 - y_ref.float()).norm() / y_ref.float().norm().clamp_min(1e-30)).item()
    if not drift < 1e-2:
        raise RuntimeError(f"reference self-check failed: per-expert fp32 forward differs from moe_reference by "
                           f"{drift:.3g} (relative); the gradient reference cannot be trusted")


# ----------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------

class LayerRun:
    """A prepared layer implementation: ``fn(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group=)``."""

    def __init__(self, fn, inp: Inputs, group, device_errors=None):
        self.fn, self.inp, self.group, self.device_errors = fn, inp, group, device_errors

    def run_fwd(self):
        self.fn(*self.inp.args(), group=self.group)  # graph built, then dropped

    def run_fwdbwd(self):
        y = self.fn(*self.inp.args(), group=self.group)
        torch.autograd.grad(y, self.inp.leaves(), self.inp.dy, allow_unused=True)  # returned, not accumulated

    def check(self, with_grads: bool) -> dict:
        errors = layer_errors(self.fn, self.inp, self.group, with_grads)
        self.raise_device_errors()
        return errors

    def raise_device_errors(self) -> None:
        """Raise what the layer recorded on the device (a timed-out bounded wait, a bad expert id):
        its outputs, and any time measured with it, are invalid (a wait that gave up returns early)."""
        if self.device_errors is not None:
            self.device_errors()


@dataclass
class LayerImpl:
    """An implementation with moe_reference's signature."""

    name: str
    fn: object
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False  # run in worker processes of its own
    kwargs: dict = field(default_factory=dict)
    in_default: bool = True
    # Without a GPU, does EP>1 across gloo processes work? (Tabby's needs GPU symmetric memory;
    # its multi-rank CPU coverage is the thread harness of tests/test_moe_cpu.py.)
    cpu_multiprocess: bool = True  # measured when --impls is not given
    device_errors: object = None  # raises if the layer recorded an error on the device (host sync)

    def prepare(self, inp: Inputs, group):
        fn = self.fn if not self.kwargs else (lambda *a, **kw: self.fn(*a, **kw, **self.kwargs))
        return LayerRun(fn, inp, group, self.device_errors)


class FloorRun:
    def __init__(self, problem):
        self.p = problem

    def run_fwd(self):
        floor_forward(self.p)

    def run_fwdbwd(self):
        floor_fwdbwd(self.p)

    def check(self, with_grads: bool) -> dict:
        return floor_errors(self.p, with_grads)


@dataclass
class FloorImpl:
    """The compute-only floor; its routing (a collective) happens in prepare, outside timing."""

    name: str = "floor"
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False

    def prepare(self, inp: Inputs, group):
        return FloorRun(prepare_floor(inp.x, inp.topk_idx, inp.w_gate, inp.w_up, inp.w_down, inp.shared, group,
                                      generator=inp.generator))


@dataclass
class BrokenImpl:
    """Stands for an implementation whose import failed, so the failure shows up in the results."""

    name: str
    reason: str
    anchor: bool = False
    supports_cpu: bool = True
    isolate: bool = False
    in_default: bool = True

    def prepare(self, inp, group):
        raise RuntimeError(self.reason)


IMPLS: dict = {}


def register(impl) -> None:
    """Add (or replace) an implementation under ``impl.name``."""
    IMPLS[impl.name] = impl


def register_layer(name: str, fn, **kw) -> None:
    """Register a function with moe_reference's signature (``group=`` keyword) as ``name``."""
    register(LayerImpl(name, fn, **kw))


def find_tabby_layer():
    """``tabby.moe`` (a function, or a module holding ``moe``) if it exists, else None."""
    import importlib

    import tabby

    obj = getattr(tabby, "moe", None)
    if obj is None:
        try:
            obj = importlib.import_module("tabby.moe")
        except ModuleNotFoundError as e:
            if e.name == "tabby.moe":
                return None
            raise
    if isinstance(obj, types.ModuleType):
        obj = getattr(obj, "moe", None)
    return obj if callable(obj) else None


def register_tabby() -> None:
    """Register the Tabby layer as "tabby" when the package provides it (a failing import is recorded)."""
    try:
        fn = find_tabby_layer()
    except Exception as e:  # noqa: BLE001 -- a broken tabby.moe must not stop the anchors
        register(BrokenImpl("tabby", f"importing tabby.moe failed: {type(e).__name__}: {e}"))
        return
    if fn is not None:
        # "tabby": the default config, i.e. the forward megakernel; TABBY_MEGA_VARIANT (`tabby tune`
        # knob syntax, e.g. "M=2,T=0") overrides its knobs. "tabby-sync-free": the separate launches.
        from .functional.config import MoEConfig
        from .functional.moe import check_errors
        from .tune import parse_variant

        register_layer("tabby-sync-free", functools.partial(fn, config=MoEConfig(megakernel=False)),
                       supports_cpu=True, cpu_multiprocess=False, device_errors=check_errors)
        try:
            _, knobs = parse_variant("mega:" + os.environ.get("TABBY_MEGA_VARIANT", ""))
        except ValueError as e:
            register(BrokenImpl("tabby", f"TABBY_MEGA_VARIANT: {e}"))
            return
        cfg = MoEConfig(megakernel=True, **knobs)
        register_layer("tabby", functools.partial(fn, config=cfg) if knobs else fn, supports_cpu=True,
                       cpu_multiprocess=False, device_errors=check_errors)


def load_plugins() -> None:
    """Import the modules named in TABBY_BENCH_PLUGINS (comma list); they call :func:`register`.

    Workers are spawned and import this module afresh, so registrations must happen at import
    time of some module: this variable is how to add implementations beyond the built-in ones.
    """
    import importlib

    for name in filter(None, (n.strip() for n in os.environ.get("TABBY_BENCH_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- show up as a failed implementation, not a crash
            register(BrokenImpl(name, f"importing plugin {name} failed: {type(e).__name__}: {e}"))


register(FloorImpl())
register_layer("torch-a2a", moe_torch_a2a, anchor=True)
register_layer("torch-symm", moe_torch_symm, anchor=True, supports_cpu=False, isolate=True)
register_tabby()
load_plugins()


# ----------------------------------------------------------------------------------------------
# Collective helpers
# ----------------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def agree(err: str | None) -> str | None:
    """Every rank learns whether any rank failed; returns the first failure's message (or None)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return err
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, err)
    for r, m in enumerate(msgs):
        if m:
            return m if r == dist.get_rank() else f"[rank {r}] {m}"
    return None


def _fmt(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 2000 else msg[:2000] + " ..."


def attempt(fn, *args):
    """Run fn on every rank, then agree: (result or None, error message or None) identical on all ranks."""
    try:
        res, err = fn(*args), None
    except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
        res, err = None, _fmt(e)
    err = agree(err)
    if err is not None:
        res = None
        free_memory()
    return res, err


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_timed(run, calls: list):
    """``run`` wrapped to append each call's host (Python + launch) seconds to ``calls``. With calls
    back to back and no sync between them, a pass whose host time per call reaches its GPU time is
    bound by the host (the GPU waits for launches)."""
    def timed():
        t0 = time.perf_counter()
        out = run()
        calls.append(time.perf_counter() - t0)
        return out

    return timed


def time_iterations(run, warmup: int, iters: int) -> list:
    """Per-iteration milliseconds on this rank (CUDA events), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    dist = _dist()
    if dist is not None:
        dist.barrier(device_ids=[torch.cuda.current_device()])
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def time_iterations_and_host(run, warmup: int, iters: int) -> tuple:
    """(``time_iterations``'s per-iteration ms, the host's ms per timed call), from the same calls."""
    calls = []
    times = time_iterations(host_timed(run, calls), warmup, iters)
    return times, sum(calls[warmup:]) * 1e3 / iters


def max_over_ranks(values: list) -> list:
    """Element-wise maximum of a per-rank list over all ranks."""
    dist = _dist()
    if dist is None:
        return values
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def dense_matmul(n: int = 8192, warmup: int = 3, iters: int = 10) -> dict:
    """The dense bf16 matmul anchor: n x n x n, median of ``iters`` (on this rank's GPU)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(time_iterations(lambda: a @ b, warmup, iters))
    del a, b
    return {"m": n, "n": n, "k": n, "ms": ms, "tflops": 2.0 * n ** 3 / (ms * 1e-3) / 1e12}


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

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
    out: str = "bench/results"
    tag: str = ""


def base_record(impl, shape: Shape, T: int, ep: int, pass_: str, dtype: str) -> dict:
    return dict(impl=impl.name if not isinstance(impl, str) else impl, shape=shape.name, E=shape.E, H=shape.H,
                I=shape.I, k=shape.k, I_shared=shape.I_shared, ep=ep, tokens_per_gpu=T, dtype=dtype, **{"pass": pass_},
                ms=None, tflops=None, flops=flops(shape, T, pass_), correct=None, errors={}, tolerance=TOLERANCE[dtype],
                ratio_to_floor=None, speedup_vs_best_anchor=None, peak_mem_gb=None, host_ms=None, error=None)


def _forward_only(errors: dict) -> dict:
    return {k: v for k, v in errors.items() if not k.startswith("d")}


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
    if cfg.check:
        errors, err = attempt(prepared.check, "fwd+bwd" in cfg.passes)
        free_memory()
        if err:
            return fail(err)
        tol = TOLERANCE[cfg.dtype]
        for p, r in recs.items():
            r["errors"] = errors if p == "fwd+bwd" else _forward_only(errors)
            r["correct"] = bool(r["errors"]) and all(v <= tol for v in r["errors"].values())
    if not timed:
        return list(recs.values())
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

        res, err = attempt(timed_run)
        if err:
            r["error"], r["correct"] = err, False
            continue
        times, peak, host_ms = res
        per_iter = max_over_ranks(times + [peak, host_ms])
        r["ms"] = statistics.median(per_iter[:-2])
        r["peak_mem_gb"], r["host_ms"] = per_iter[-2:]
        r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        r["ms_min"] = min(per_iter[:-2])
    del prepared
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

    def __init__(self, path, start, total, rank):
        self.path, self.i, self.total, self.rank = path, start, total, rank
        self.t_last = time.monotonic()  # progress lines show the seconds each measurement took

    def emit(self, rec: dict) -> None:
        self.i += 1
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        # A flat copy beside the results, so a run killed at a time limit keeps what it measured.
        partial = os.environ.get("TABBY_BENCH_PARTIAL")
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps(rec) + "\n")
        now = time.monotonic()
        took, self.t_last = now - self.t_last, now
        print(f"[{self.i}/{self.total}] {progress_line(rec)}  (+{took:.1f} s)", flush=True)

    def note(self, obj: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(obj) + "\n")


def progress_line(r: dict) -> str:
    head = f"{r['shape']} T={r['tokens_per_gpu']} EP{r['ep']} {r['pass']:<7} {r['impl']}:"
    parts = []
    if r.get("ms") is not None:
        parts.append(f"{r['ms']:.3f} ms  {r['tflops']:.1f} TFLOP/s  peak {r['peak_mem_gb']:.1f} GB")
    if r.get("correct") is not None:
        worst = max(r["errors"].values()) if r["errors"] else float("nan")
        parts.append(("correct" if r["correct"] else "WRONG") + f" (max rel err {worst:.2e})")
    if r.get("error"):
        msg = r["error"].splitlines()[0][:300]
        parts.append(msg if msg.startswith("skipped") else "ERROR " + msg)
    return head + " " + "  ".join(parts)


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
    sink = _Sink(path, start, total, rank)
    device = torch.device("cuda", torch.cuda.current_device())
    if with_dense:
        dense, err = attempt(dense_matmul)
        sink.note({"kind": "dense", "result": dense, "error": err})
        if rank == 0 and dense:
            print(f"dense bf16 matmul {dense['m']}^3: {dense['ms']:.3f} ms, {dense['tflops']:.1f} TFLOP/s", flush=True)
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
                        free_memory()
                        if impl.name == "floor" and n < len(impls) - 1:
                            held = recs
                            continue
                    for r in recs:
                        sink.emit(r)
                if held is not None:
                    again = measure(IMPLS["floor"], inp, group, dataclasses.replace(cfg, check=False), timed=True)
                    free_memory()
                    for r in bracket_floor(held, again):
                        sink.emit(r)
                del inp
                release_buffers()
                free_memory()


CPU_RANKS = 2


def cpu_measurements(cfg: Config) -> int:
    """Records CPU mode writes: every impl at EP1 and EP2, plus the reference itself at EP2."""
    return (2 * len(cfg.impls) + 1) * len(cfg.passes)


def cpu_worker(rank: int, world: int, cfg: Config, path: str) -> None:
    """CPU mode: TINY shape, EP1 (each process alone) and EP2 over gloo; errors only, no timings."""
    import torch.distributed as dist

    shape, T, tol = TINY, CPU_TOKENS, TOLERANCE[cfg.dtype]
    sink = _Sink(path, 0, cpu_measurements(cfg), rank)
    for ep in (1, world):
        group = None if ep == 1 else dist.group.WORLD
        inp = make_inputs(shape, T, ep, rank, torch.device("cpu"), DTYPES[cfg.dtype])
        if ep > 1:  # the reference itself: EP result vs one process holding every token and expert
            for p, errors in zip(cfg.passes, _ep_vs_single(inp, group, cfg.passes)):
                sink.emit(dict(base_record("reference", shape, T, ep, p, cfg.dtype), errors=errors,
                               correct=all(v <= tol for v in errors.values())))
        for name in cfg.impls:
            impl = IMPLS[name]
            cpu_ok = impl.supports_cpu and (ep == 1 or getattr(impl, "cpu_multiprocess", True))
            if cpu_ok:
                recs = measure(impl, inp, group, cfg, timed=False)
            elif impl.supports_cpu:
                recs = [dict(base_record(impl, shape, T, ep, p, cfg.dtype),
                             error="skipped: EP>1 across processes needs GPUs (CPU: tests/test_moe_cpu.py)")
                        for p in cfg.passes]
            else:
                recs = [dict(base_record(impl, shape, T, ep, p, cfg.dtype), error="skipped: needs a GPU")
                        for p in cfg.passes]
            for r in recs:
                sink.emit(r)


def _ep_vs_single(inp: Inputs, group, passes) -> list:
    """The reference itself: EP over ``group`` vs one process on every rank's tokens and experts."""
    import torch.distributed as dist

    W = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def gather(t):
        out = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(out, t.detach().contiguous(), group=group)
        return out

    xs, idxs, tws, dys = gather(inp.x), gather(inp.topk_idx), gather(inp.topk_weights), gather(inp.dy)
    ws = [torch.cat(gather(w)) for w in (inp.w_gate, inp.w_up, inp.w_down)]
    sh = tuple(w.detach() for w in inp.shared) if inp.shared else None
    y_ep = moe_reference(*inp.args(), group=group)
    g_ep = torch.autograd.grad(y_ep, inp.leaves(), inp.dy)
    # One process over all tokens. Each rank has its own shared expert (own seed), so the single
    # process applies this rank's to every token and only this rank's rows are compared; the
    # shared-expert weight gradients are not comparable and are left out.
    xa = torch.cat(xs).requires_grad_(True)
    twa = torch.cat(tws).requires_grad_(True)
    wa = [w.requires_grad_(True) for w in ws]
    sha = tuple(w.clone().requires_grad_(True) for w in sh) if sh else None
    y1 = moe_reference(xa, torch.cat(idxs), twa, *wa, shared=sha)
    g1 = torch.autograd.grad(y1, [xa, twa, *wa, *(sha or ())], torch.cat(dys))
    T, E_local = inp.T, inp.w_gate.shape[0]
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * E_local, (rank + 1) * E_local)
    errs = ErrorSums()
    errs.add("y", y_ep, y1[rows])
    names = ["dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down"]
    picks = [g1[0][rows], g1[1][rows], g1[2][experts], g1[3][experts], g1[4][experts]]
    for n, a, b in zip(names, g_ep[:5], picks):
        errs.add(n, a, b)
    all_errs = errs.relative()
    return [all_errs if p == "fwd+bwd" else _forward_only(all_errs) for p in passes]


# ----------------------------------------------------------------------------------------------
# Driver, results
# ----------------------------------------------------------------------------------------------

def bracket_floor(first: list, last: list) -> list:
    """The floor's records with ``ms`` the mean of its time measured first and last among a shape's
    implementations (``ms_first``, ``ms_last``; per pass).

    Why: under sustained load the GPU's clock drops; in one minute of `tabby tune` (2 x H200,
    2026-11-30) the floor's forward went from 2.145 to 2.321 ms at qwen3-30b-a3b 16384. Timed only
    first, the floor would be measured on the coolest GPU and every other implementation on a
    warmer one; timed before and after them, its figure is the floor at mid-run."""
    for r, r2 in zip(first, last):
        r["ms_first"], r["ms_last"] = r["ms"], r2["ms"]
        if r["ms"] is None or r2["ms"] is None:
            continue
        r["ms"] = (r["ms"] + r2["ms"]) / 2
        r["ms_min"] = min(r["ms_min"], r2["ms_min"])
        r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        r["peak_mem_gb"] = max(r["peak_mem_gb"], r2["peak_mem_gb"])
    return first


def finalize(records: list) -> None:
    """Fill ratio_to_floor and speedup_vs_best_anchor (in place)."""
    def key(r):
        return (r["shape"], r["tokens_per_gpu"], r["ep"], r["pass"])

    floor, best = {}, {}
    for r in records:
        if r["ms"] is None or r["correct"] is False:
            continue
        if r["impl"] == "floor":
            floor[key(r)] = r["ms"]
        if r["impl"] in ANCHORS:
            best[key(r)] = min(best.get(key(r), math.inf), r["ms"])
    for r in records:
        if r["ms"] is None:
            continue
        if key(r) in floor:
            r["ratio_to_floor"] = r["ms"] / floor[key(r)]
        if key(r) in best:
            r["speedup_vs_best_anchor"] = best[key(r)] / r["ms"]


def _cell(v, fmt):
    return "-" if v is None else format(v, fmt)


def format_table(records: list) -> str:
    """A readable table (markdown pipes, aligned): one row per record. "host ms": the host's time per
    call (Python and launches); where it reaches "ms" the pass waited for the host, not the GPU."""
    head = ["shape", "T/GPU", "EP", "pass", "impl", "ms", "host ms", "TFLOP/s", "x floor", "vs anchor", "correct"]
    rows = []
    for r in records:
        ok = "error" if r.get("error") and r["correct"] is False and not r["errors"] else (
            "-" if r["correct"] is None else ("yes" if r["correct"] else "NO"))
        if r.get("error", "") and str(r.get("error")).startswith("skipped"):
            ok = "skipped"
        rows.append([r["shape"], str(r["tokens_per_gpu"]), str(r["ep"]), r["pass"], r["impl"],
                     _cell(r["ms"], ".3f"), _cell(r.get("host_ms"), ".3f"), _cell(r["tflops"], ".1f"),
                     _cell(r["ratio_to_floor"], ".2f"),
                     _cell(r["speedup_vs_best_anchor"], ".2f"), ok])
    width = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    right = {1, 2, 5, 6, 7, 8, 9}

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, width))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(width)) + "|"
    return "\n".join([line(head), sep] + [line(row) for row in rows])


def format_errors(records: list) -> str:
    """Per-record maximum relative error and the failing quantities (CPU mode's table)."""
    lines = []
    for r in records:
        worst = max(r["errors"].items(), key=lambda kv: kv[1]) if r["errors"] else None
        status = "skipped" if str(r.get("error") or "").startswith("skipped") else (
            "-" if r["correct"] is None else ("ok" if r["correct"] else "FAIL"))
        detail = f"max rel err {worst[1]:.2e} ({worst[0]})" if worst else (r.get("error") or "")
        lines.append(f"  {r['impl']:<12} EP{r['ep']} {r['pass']:<7} {status:<7} {detail}")
    return "\n".join(lines)


def git_commit() -> tuple:
    """(commit, dirty); TABBY_GIT_COMMIT names it where the tree has no .git (the device machine)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("TABBY_GIT_COMMIT"):
        return os.environ["TABBY_GIT_COMMIT"], None
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown", None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), (bool(dirty.stdout.strip()) if dirty.returncode == 0 else None)
    except Exception:  # noqa: BLE001 -- no git: still write results
        return "unknown", None


def machine_info() -> dict:
    import triton

    host = socket.gethostname()
    if torch.cuda.is_available():
        name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
        machine = f"{name} x {count} / {host}"
    else:
        name, count, machine = None, 0, f"CPU / {host}"
    commit, dirty = git_commit()
    return dict(machine=machine, hostname=host, gpu_name=name, gpu_count=count, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, git_commit=commit, git_dirty=dirty,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), argv=list(sys.argv),
                env={k: v for k, v in os.environ.items() if k.startswith("TABBY_")})


def file_stem(info: dict, tag: str) -> str:
    if info["gpu_count"]:
        import re

        m = re.search(r"\b([a-z]+\d+[a-z]*)\b", info["gpu_name"].lower())
        kind = f"{info['gpu_count']}x{m.group(1) if m else 'gpu'}"
    else:
        kind = "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    parts = ["bench", kind] + ([tag] if tag else []) + [stamp]
    return "-".join(parts)


def plot(records: list, dense_tflops, path: str) -> bool:
    """Bar chart of TFLOP/s per impl, grouped by shape (and EP), one panel per (pass, T). False if no data."""
    timed = [r for r in records if r["tflops"] is not None]
    if not timed:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pass"], r["tokens_per_gpu"]) for r in timed}, key=lambda pt: (PASSES.index(pt[0]), pt[1]))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    multi_ep = len({r["ep"] for r in timed}) > 1
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len({r['shape'] for r in timed}) * (
        1 + multi_ep)), 3.6 * len(panels)), squeeze=False)
    for ax, (p, T) in zip(axes[:, 0], panels):
        rs = [r for r in timed if r["pass"] == p and r["tokens_per_gpu"] == T]
        groups = list(dict.fromkeys((r["shape"], r["ep"]) for r in rs))
        width = 0.8 / max(1, len(impls))
        for j, name in enumerate(impls):
            xs, hs, bad = [], [], []
            for i, g in enumerate(groups):
                r = next((r for r in rs if (r["shape"], r["ep"]) == g and r["impl"] == name), None)
                if r is not None:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    hs.append(r["tflops"])
                    bad.append(r["correct"] is False)
            bars = ax.bar(xs, hs, width, label=name)
            for b, wrong in zip(bars, bad):
                if wrong:
                    b.set_hatch("//")
        if dense_tflops:
            ax.axhline(dense_tflops, color="gray", linestyle="--", linewidth=1, label="dense bf16 matmul")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{s}\nEP{e}" if multi_ep else s for s, e in groups], fontsize=8)
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{p}, {T} tokens/GPU (hatched: failed the correctness check)", fontsize=10)
        ax.legend(fontsize=7, ncol=min(len(impls) + 1, 5), loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _read_jsonl(path: str):
    recs, notes = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                obj = json.loads(line)
                (notes if obj.get("kind") else recs).append(obj)
    return recs, notes


def _run_phases(cfg: Config, tmp: str) -> tuple:
    """GPU mode: run the grid (spawned workers, or this process under torchrun); return (records, dense)."""
    plan = plan_measurements(cfg)
    total = len(plan)
    per = len(cfg.shapes) * len(cfg.tokens) * len(cfg.eps) * len(cfg.passes)
    records, dense, start = [], None, 0
    for k, names in enumerate(phases(cfg)):
        path = os.path.join(tmp, f"phase{k}.jsonl")
        args = (cfg, names, path, start, total, k == 0)
        err = None
        try:
            if under_torchrun():
                import torch.distributed as dist

                launch(gpu_worker, *args)
                dist.barrier()
            else:
                launch(gpu_worker, *args)
        except LaunchError as e:
            err = str(e)
            print(f"worker processes failed while running {', '.join(names)}:\n{err}", file=sys.stderr, flush=True)
        recs, notes = _read_jsonl(path)
        for n in notes:
            if n["kind"] == "dense" and n.get("result"):
                dense = n["result"]
        done = {(r["shape"], r["tokens_per_gpu"], r["ep"], r["impl"], r["pass"]) for r in recs}
        for shape, T, ep, name, p in plan:
            if name in names and (shape.name, T, ep, name, p) not in done:
                tail = err.strip().splitlines()[-1] if err else "no result"
                recs.append(dict(base_record(name, shape, T, ep, p, cfg.dtype), correct=False,
                                 error=f"worker processes failed before this measurement: {tail}"))
        records += recs
        start += per * len(names)
    return records, dense


def run(cfg: Config) -> dict:
    """Run the benchmark; returns the result dict (also written under ``cfg.out`` by rank 0)."""
    gpu = torch.cuda.is_available()
    os.makedirs(cfg.out, exist_ok=True)
    partial = os.path.join(cfg.out, "partial-records.jsonl")
    os.environ["TABBY_BENCH_PARTIAL"] = partial  # inherited by the spawned workers
    with tempfile.TemporaryDirectory(prefix="tabby-bench-") as tmp:
        if gpu:
            records, dense = _run_phases(cfg, tmp)
        else:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # lets "tabby" run on CPU tensors in the workers
            path = os.path.join(tmp, "cpu.jsonl")
            launch(cpu_worker, cfg, path, nprocs=CPU_RANKS, cpu=True)
            records, _ = _read_jsonl(path)
            dense = None
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return {}
    finalize(records)
    info = machine_info()
    result = dict(schema="tabby-bench/1", mode="gpu" if gpu else "cpu", **info,
                  config=dict(shapes=[s.name for s in cfg.shapes] if gpu else [TINY.name],
                              tokens=cfg.tokens if gpu else [CPU_TOKENS], ep=cfg.eps if gpu else [1, CPU_RANKS],
                              impls=cfg.impls,
                              passes=cfg.passes, dtype=cfg.dtype, warmup=cfg.warmup, iters=cfg.iters, check=cfg.check,
                              tolerance=TOLERANCE[cfg.dtype]),
                  dense_matmul=dense, dense_matmul_tflops=dense["tflops"] if dense else None, records=records)
    os.makedirs(cfg.out, exist_ok=True)
    stem = os.path.join(cfg.out, file_stem(info, cfg.tag))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if os.path.exists(partial):  # the complete JSON supersedes it
        os.remove(partial)
    header = (f"# tabby bench: {info['machine']}\n\ntorch {info['torch']}, triton {info['triton']}, commit "
              f"{info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}, {info['date']}\n\n")
    if dense:
        header += f"dense bf16 matmul {dense['m']}^3: {dense['tflops']:.1f} TFLOP/s\n\n"
    table = format_table(records)
    with open(stem + ".md", "w") as f:
        f.write(header + table + "\n")
    files = [stem + ".json", stem + ".md"]
    if plot(records, result["dense_matmul_tflops"], stem + ".png"):
        files.append(stem + ".png")
    print()
    if gpu:
        print(table)
    else:
        print("CPU mode (no GPU found): TINY shape, single process and EP2 over gloo, errors vs the fp32 reference.")
        print(format_errors(records))
        print("Timings need a GPU: no times were measured (ms is null in the JSON).")
    print("\nwrote " + ", ".join(files), flush=True)
    return result
