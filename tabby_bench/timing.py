"""Timing and the collectives that keep ranks in lockstep, shared by ``bench``, ``tune`` and ``profile``.

Every helper works in one process (no process group) and across the ranks of the default group:
times are per rank, and ``max_over_ranks`` turns them into the figure a pass takes (the slowest
rank's: its peers wait for it).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch


def dist_or_none():
    """``torch.distributed`` when a default process group exists, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def agree(err: str | None) -> str | None:
    """Every rank learns whether any rank failed; returns the first failure's message (or None)."""
    dist = dist_or_none()
    if dist is None or dist.get_world_size() == 1:
        return err
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, err)
    for r, m in enumerate(msgs):
        if m:
            return m if r == dist.get_rank() else f"[rank {r}] {m}"
    return None


def error_text(e: BaseException, limit: int = 2000) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < limit else msg[:limit] + " ..."


def attempt(fn, *args):
    """Run fn on every rank, then agree: (result or None, error message or None) identical on all ranks."""
    try:
        res, err = fn(*args), None
    except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
        res, err = None, error_text(e)
    err = agree(err)
    if err is not None:
        res = None
        free_memory()
    return res, err


def free_memory() -> None:
    """Drop Tabby's cached FP8 weight copies (they live as long as their weights, which a shape's
    implementations share: otherwise one row's copies would sit in the next row's memory), then
    unreachable objects and the caching allocator's free blocks."""
    from tabby.functional.fp8 import clear_weight_cache

    clear_weight_cache()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_implementation() -> None:
    """Free what one implementation held before the next is measured: Tabby's cached workspaces
    (symmetric buffers, rings, plans), then what :func:`free_memory` frees. Collective with several
    ranks: every rank calls it at the same point of the loop."""
    import tabby

    tabby.free_workspaces()
    free_memory()


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
    dist = dist_or_none()
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
    dist = dist_or_none()
    if dist is None:
        return values
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def median_ms(run, warmup: int, iters: int) -> tuple:
    """(GPU ms: median over iterations of the max over ranks; host ms per call, max over ranks), from
    the same back-to-back timed calls (no sync between them)."""
    times, host = time_iterations_and_host(run, warmup, iters)
    per_iter = max_over_ranks(times + [host])  # one collective for both
    return statistics.median(per_iter[:-1]), per_iter[-1]


def dense_matmul(n: int = 8192, warmup: int = 3, iters: int = 10) -> dict:
    """The dense matmul anchors: n x n x n in bf16 (``ms``, ``tflops``) and in FP8 E4M3 with bf16
    output (``torch._scaled_mm``, per-tensor scales: ``fp8_ms``, ``fp8_tflops``; None where the GPU
    or torch has no FP8 matmul), median of ``iters`` (on this rank's GPU)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(time_iterations(lambda: a @ b, warmup, iters))
    fp8_ms = None
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as _scaled_mm needs
        one = torch.ones((), device="cuda")
        fp8_ms = statistics.median(time_iterations(
            lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), warmup, iters))
        del a8, b8
    except (RuntimeError, AttributeError, TypeError):  # no FP8 tensor cores (before sm_89) or no _scaled_mm
        pass
    del a, b
    flop = 2.0 * n ** 3
    return {"m": n, "n": n, "k": n, "ms": ms, "tflops": flop / (ms * 1e-3) / 1e12, "fp8_ms": fp8_ms,
            "fp8_tflops": flop / (fp8_ms * 1e-3) / 1e12 if fp8_ms else None}


def dense_line(dense: dict) -> str:
    """``dense bf16 matmul 8192^3: 790.1 TFLOP/s; FP8 1402.3`` (FP8 where measured)."""
    line = f"dense bf16 matmul {dense['m']}^3: {dense['tflops']:.1f} TFLOP/s"
    if dense.get("fp8_tflops"):
        line += f"; FP8 (E4M3, torch._scaled_mm) {dense['fp8_tflops']:.1f} TFLOP/s"
    return line
