"""The layer's forward + backward on the CPU (Triton interpreter): live tensor bytes and bits.

    python scripts/cpu_memory.py peak            # peak live bytes above the inputs, one rank, per config
    python scripts/cpu_memory.py bits OUT.pt     # y and every gradient of a set of cases (1-2 ranks)
    python scripts/cpu_memory.py compare A.pt B.pt

``peak`` counts bytes the way the bench's ``peak_mem_gb`` does on the GPU (max allocated during
forward + backward minus what was allocated before), from a ``TorchDispatchMode`` that records the
storage of every tensor an aten op returns and a weakref finalizer on it (storages keep their Python
object while they live), so a storage counts from its allocation until its last reference goes.
The registered operator's internals are one dispatch each (``torch.ops.tabby.moe``, ``moe_backward``):
only its outputs show there.
Run ``bits`` with two checkouts on PYTHONPATH (e.g. main and a branch) and ``compare`` the files:
every tensor must be ``torch.equal``.
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tabby  # (selects the interpreter on a machine without a GPU)
from tabby.functional import heuristics
from tabby.functional.config import MoEConfig, Tuning

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(tabby.__file__))), "tests"))
from harness import make_problem, run_ranks

SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
_orig_gemm_config = heuristics.gemm_config
heuristics.gemm_config = lambda kind, N, K, tile_m: _orig_gemm_config(kind, N, K, tile_m).with_(BN=16, BK=16)


def mega(save=True, **tuning):
    return MoEConfig(megakernel=True, save_for_backward=save,
                     tuning=Tuning(**{**SMALL, "ring_rows": 64, "programs": 3, **tuning}))


SYNC_FREE = MoEConfig(megakernel=False, tuning=Tuning(**SMALL))


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive now (those made under the mode), and their high point."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, []

    def _free(self, key):
        self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A new storage only: not an in-place op's (copy_, zero_) nor one an input has (views); set_
        # makes the interpreter's views of a launch's arguments
        if func.__name__.split(".")[0].endswith("_"):
            return out
        ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                s = t.untyped_storage()
                key = s.data_ptr()
                if key not in self.live and s.nbytes() > 0:
                    self.live[key] = (s.nbytes(), tuple(t.shape), t.dtype, func.__name__)
                    self.now += s.nbytes()
                    weakref.finalize(s, self._free, key)
                    if self.now > self.peak:
                        self.peak = self.now
                        self.at_peak = sorted(self.live.values(), key=lambda v: -v[0])
        return out


def one_rank(cfg, T=48, H=112, I=32, E=8, k=4, seed=3, op=False, route="random"):
    """Peak live bytes of a second forward + backward (the first made the workspace and plan)."""
    from tabby.functional import custom_op

    x, idx, wts, ws, _, dy = make_problem(1, T, H, I, E, k, seed=seed, route=route)
    fn = custom_op.moe if op else tabby.moe
    leaves = [t.clone().requires_grad_(True) for t in (x, wts, *ws)]

    def step():
        y = fn(leaves[0], idx, leaves[1], *leaves[2:], config=cfg)
        return torch.autograd.grad(y, leaves, dy)

    step()
    mode = LiveBytes()
    with mode:
        grads = step()
    del grads
    return mode


def cases():
    """name -> (W, T, H, I, E_local, k, shared, route, config, registered operator)."""
    c = {}
    for W in (1, 2):
        c[f"sync-free-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random", SYNC_FREE, False)
        c[f"mega-save-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random", mega(), False)
        c[f"mega-recompute-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random", mega(save=False), False)
        c[f"mega-local-rows-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random",
                                       mega(tma=True, local_rows=True, align_tiles=2), False)
        c[f"mega-token-pull-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, W == 1, "random",
                                       mega(tma=True, align_tiles=2, pull_tokens=True), False)
        c[f"op-mega-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random", mega(), True)
        c[f"op-token-pull-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, False, "random",
                                     mega(tma=True, group_m=2, pull_tokens=True), True)
        c[f"op-sync-free-ep{W}"] = (W, 13, 32, 24, 4 // W, 3, True, "random", SYNC_FREE, True)
    c["mega-save-one-expert-ep2"] = (2, 13, 32, 24, 2, 3, False, "one_expert", mega(), False)
    c["sync-free-one-rank-ep2"] = (2, 13, 32, 24, 2, 3, False, "one_rank", SYNC_FREE, False)
    return c


def run_case(W, T, H, I, E_local, k, shared, route, cfg, op):
    from tabby.functional import custom_op

    fn = custom_op.moe if op else tabby.moe
    x, idx, wts, ws, sh, dy = make_problem(W, T, H, I, E_local, k, shared=shared, seed=11, route=route)

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        leaves = [x[rows].clone(), wts[rows].clone(), *(w[r * E_local:(r + 1) * E_local].clone() for w in ws),
                  *(w.clone() for w in (sh or ()))]
        for t in leaves:
            t.requires_grad_(True)
        y = fn(leaves[0], idx[rows], leaves[1], *leaves[2:5], shared=leaves[5:] or None,
               group=group if W > 1 else None, config=cfg)
        y.backward(dy[rows])
        return [y.detach()] + [t.grad for t in leaves]

    res = run_ranks(W, rank_fn) if W > 1 else [rank_fn(0, None)]
    return [t for r in res for t in r]


def main():
    what = sys.argv[1]
    if what == "peak":
        for name, cfg, op in [("sync-free", SYNC_FREE, False), ("megakernel, save", mega(), False),
                              ("megakernel, recompute", mega(save=False), False),
                              ("megakernel, token pull", mega(tma=True, align_tiles=2, pull_tokens=True,
                                                              local_rows=True), False),
                              ("registered op, megakernel", mega(), True),
                              ("registered op, token pull", mega(tma=True, align_tiles=2, pull_tokens=True,
                                                                 local_rows=True), True)]:
            m = one_rank(cfg, op=op)
            print(f"{name:28s} peak {m.peak:9d} B above the inputs; live at the peak (bytes, shape, dtype, op):")
            for v in m.at_peak[:10]:
                print(f"    {v[0]:8d} {str(v[1]):14s} {str(v[2]):15s} {v[3]}")
    elif what == "bits":
        out = {}
        for name, case in cases().items():
            out[name] = run_case(*case)
            print(name, "done", flush=True)
        torch.save(out, sys.argv[2])
    elif what == "compare":
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        bad = 0
        for name in a:
            same = len(a[name]) == len(b[name]) and all(torch.equal(p, q) for p, q in zip(a[name], b[name]))
            bad += not same
            print(f"{name:28s} {'bitwise equal' if same else 'DIFFERENT'} ({len(a[name])} tensors)")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
