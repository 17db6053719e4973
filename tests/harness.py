"""CPU harness: ranks of an expert-parallel group as threads of one process.

Each rank's kernels run under the Triton interpreter on CPU tensors; the ranks' launches run
concurrently in their threads, so a spin-wait in one sees the atomics of another, and pointer
tables hold the addresses of the other ranks' CPU buffers (docs/design.md, "Testing without a GPU").
"""
from __future__ import annotations


import torch

from tabby.functional.threads import ThreadGroup, ThreadRank, patch_interpreter_for_threads, run_ranks  # noqa: F401


# The GPU tests' cases (test_moe_gpu.py, test_fp8_cases_gpu.py): each bench shape's true H, I and k
# with a small expert count per rank, and the odd ones (T = 333, k = 1, every row to one expert,
# every token to the last rank's experts, most of them empty).
# name: (T per rank, H, I, E_local, k, shared, route)
GPU_CASES = {
    "kimi-k2": (256, 7168, 2048, 8, 8, False, "random"),
    "glm-5": (256, 6144, 2048, 8, 8, False, "random"),
    "qwen3.5-397b": (256, 4096, 1024, 16, 10, False, "random"),
    "deepseek-v4-pro": (256, 7168, 3072, 8, 6, False, "random"),
    "qwen3-30b-a3b": (512, 2048, 768, 16, 8, True, "random"),
    "gpt-oss-120b": (256, 2880, 2880, 8, 4, False, "random"),
    "odd-T": (333, 2048, 768, 16, 8, False, "random"),
    "k1": (300, 2048, 768, 16, 1, False, "random"),
    "one-expert": (200, 2048, 768, 16, 4, False, "one_expert"),
    "one-rank-empty-experts": (200, 2048, 768, 16, 2, False, "one_rank"),
}


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


patch_interpreter_for_threads()
