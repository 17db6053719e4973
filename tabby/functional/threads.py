"""Simulated ranks: an expert-parallel group whose ranks are threads of one process.

On a machine without GPUs the layer runs under the Triton interpreter on CPU tensors. Running
each rank in its own thread, with a ``ThreadGroup`` standing in for the process group, lets a
spin-wait of one rank see the atomics of another and pointer tables hold the other ranks' CPU
buffers, so the whole expert-parallel protocol runs as it does across GPUs::

    def rank_fn(rank, group):
        return tabby.moe(x[rank], idx[rank], w[rank], *experts[rank], group=group)

    ys = run_ranks(2, rank_fn)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


class ThreadGroup:
    """Stands in for a process group: ``world_size`` threads, one per rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._values: dict = {}  # each rank's value of the exchange in progress
        self.raw: dict = {}  # each rank's symmetric bytes (Workspace.peer_buffer)

    def exchange(self, rank: int, value, timeout_s: float | None = None) -> list:
        """Every rank's ``value`` in rank order, once every rank has given its own (a collective).
        A rank that does not join within ``timeout_s`` breaks the group's barrier: every rank waiting
        in it raises ``threading.BrokenBarrierError``, and the group cannot be used after that."""
        self._values[rank] = value
        self._barrier.wait(timeout_s)
        out = [self._values[r] for r in range(self.world_size)]
        self._barrier.wait(timeout_s)
        return out


@dataclass(frozen=True)
class ThreadRank:
    """The ``group`` argument of ``tabby.moe`` for rank ``rank`` of a ``ThreadGroup``."""

    group: ThreadGroup
    rank: int


def run_ranks(world_size: int, fn, timeout: float = 600.0):
    """Run ``fn(rank, group)`` in ``world_size`` threads sharing one ``ThreadGroup``; returns the
    results by rank, or raises the first rank's error (``TimeoutError`` if a rank never returns)."""
    patch_interpreter_for_threads()
    tg = ThreadGroup(world_size)
    results, errors = [None] * world_size, []

    def body(r):
        try:
            results[r] = fn(r, ThreadRank(tg, r))
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank did not finish within {timeout} s")
    if errors:
        r, e = errors[0]
        raise RuntimeError(f"rank {r} failed: {e!r}") from e
    return results


def patch_interpreter_for_threads() -> None:
    """Let interpreted kernels of several threads share CPU memory safely (idempotent).

    After a launch, triton 3.6's interpreter copies every argument's whole storage back from its
    host copy. For a CPU tensor the host copy *is* the storage, so this copies memory onto itself:
    harmless alone, but it races with other ranks' threads writing the same storage (a peer's flag
    or pushed rows land, then are overwritten by the stale self-copy). Self-copies are skipped.
    The interpreter also patches triton.language while a kernel runs, so launches from several
    threads must not overlap: one lock around every launch (waits across ranks poll from the host
    between launches, ``steps._wait``).
    """
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor, "_tabby_patched", False):
        return
    orig = interpreter.GridExecutor._restore_args_dev

    def same_storage(d, h):
        return (hasattr(d, "data_ptr") and hasattr(h, "data_ptr")
                and d.untyped_storage().data_ptr() == h.untyped_storage().data_ptr())

    def restore(self, args_dev, args_hst, kwargs, kwargs_hst):
        keep = [(d, h) for d, h in zip(args_dev, args_hst) if not same_storage(d, h)]
        kw = {k: v for k, v in kwargs.items() if not same_storage(v, kwargs_hst[k])}
        orig(self, [d for d, _ in keep], [h for _, h in keep], kw, {k: kwargs_hst[k] for k in kw})

    interpreter.GridExecutor._restore_args_dev = restore
    call = interpreter.GridExecutor.__call__
    lock = threading.RLock()

    def locked_call(self, *args, **kwargs):
        with lock:
            return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = locked_call
    interpreter.GridExecutor._tabby_patched = True
