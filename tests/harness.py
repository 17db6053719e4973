"""CPU harness: ranks of an expert-parallel group as threads of one process.

Each rank's kernels run under the Triton interpreter on CPU tensors; the ranks' launches run
concurrently in their threads, so a spin-wait in one sees the atomics of another, and pointer
tables hold the addresses of the other ranks' CPU buffers (DESIGN.md, "Testing without a GPU").
"""
from __future__ import annotations

import threading

import torch

from tabby.functional.moe import ThreadRank
from tabby.functional.workspace import ThreadGroup


def run_ranks(W: int, fn, timeout: float = 600.0):
    """Run ``fn(rank, group)`` in W threads with one ``ThreadGroup``; returns the results by rank."""
    tg = ThreadGroup(W)
    results, errors = [None] * W, []

    def body(r):
        try:
            results[r] = fn(r, ThreadRank(tg, r))
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(W)]
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


def make_problem(W, T, H, I, E_local, k, shared=False, seed=0, dtype=torch.bfloat16, route="random"):
    """Global inputs for W ranks: x [W*T, H], idx [W*T, k], weights, expert weights [W*E_local, ...]."""
    g = torch.Generator().manual_seed(seed)
    E = W * E_local
    x = torch.randn(W * T, H, generator=g).to(dtype)
    if route == "random":
        vals, idx = torch.randn(W * T, E, generator=g).topk(k, dim=1)
    elif route == "one_expert":  # every (token, k) of every rank to expert 0 (ids repeat within a row)
        idx = torch.zeros(W * T, k, dtype=torch.int64)
        vals = torch.randn(W * T, k, generator=g)
    elif route == "one_rank":  # every token to the experts of the last rank
        vals, idx = torch.randn(W * T, E_local, generator=g).topk(min(k, E_local), dim=1)
        idx = idx + (W - 1) * E_local
        vals, idx = vals[:, :k], idx[:, :k]
    else:
        raise ValueError(route)
    wts = torch.softmax(vals, dim=1)
    s = lambda *sz: (torch.randn(*sz, generator=g) / sz[-1] ** 0.5).to(dtype)
    ws = (s(E, I, H), s(E, I, H), s(E, H, I))
    sh = (s(24, H), s(24, H), s(H, 24)) if shared else None
    dy = torch.randn(W * T, H, generator=g).to(dtype)
    return x, idx, wts, ws, sh, dy


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _patch_interpreter_for_threads():
    """Let interpreted kernels of several threads share CPU memory safely.

    After a launch, triton 3.6's interpreter copies every argument's whole storage back from its
    host copy. For a CPU tensor the host copy *is* the storage, so this copies memory onto itself;
    harmless alone, but it races with other ranks' threads writing the same storage (a peer's
    flag or pushed rows land, then are overwritten by the stale self-copy). Skip self-copies.
    """
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor, "_tabby_patched", False):
        return
    orig = interpreter.GridExecutor._restore_args_dev

    def restore(self, args_dev, args_hst, kwargs, kwargs_hst):
        keep = [(d, h) for d, h in zip(args_dev, args_hst)
                if not (hasattr(d, "data_ptr") and hasattr(h, "data_ptr")
                        and d.untyped_storage().data_ptr() == h.untyped_storage().data_ptr())]
        kw = {k: v for k, v in kwargs.items()
              if not (hasattr(v, "data_ptr") and v.untyped_storage().data_ptr()
                      == kwargs_hst[k].untyped_storage().data_ptr())}
        orig(self, [d for d, _ in keep], [h for _, h in keep], kw, {k: kwargs_hst[k] for k in kw})

    interpreter.GridExecutor._restore_args_dev = restore

    # The interpreter patches triton.language while a kernel runs and restores it afterwards, so
    # launches from several threads must not overlap: one lock around every launch. (Waits in the
    # CPU harness poll from the host between launches; see tabby.functional.moe._wait.)
    call = interpreter.GridExecutor.__call__
    lock = threading.RLock()

    def locked_call(self, *args, **kwargs):
        with lock:
            return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = locked_call
    interpreter.GridExecutor._tabby_patched = True


_patch_interpreter_for_threads()
