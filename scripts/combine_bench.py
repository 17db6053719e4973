"""Time the combine (ops/combine.py) at the bench shapes' sizes for several block shapes and launch
orders, against a plain HBM copy of the same bytes (the ceiling). One GPU, ~10 s.

    python scripts/combine_bench.py

Every variant gives the same bits (checked here too); combine_k's defaults are the fastest measured
(docs/performance.md, "Combine").
"""
import torch
import triton.testing

from tabby.ops.combine import combine_k
from tabby_bench.shapes import SHAPES

VARIANTS = [  # (tokens, columns) per program, column blocks adjacent in launch order, warps
    ((16, 256), False, 4), ((16, 256), True, 4), ((8, 512), True, 4), ((4, 1024), True, 4),
    ((2, 2048), True, 8), ((32, 128), True, 4), ((16, 512), True, 8),
]


def main():
    dev = torch.device("cuda")
    print("| shape | T | variant | us | TB/s | bitwise |\n|---|---|---|---|---|---|")
    for name, T in (("qwen3-30b-a3b", 16384), ("qwen3.5-397b", 4096), ("kimi-k2", 4096)):
        s = SHAPES[name]
        rows = torch.randn(T * s.k, s.H, device=dev, dtype=torch.bfloat16)
        w = torch.rand(T, s.k, device=dev)
        nbytes = rows.numel() * 2 + T * s.H * 2 + w.numel() * 4
        copy_src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=dev)  # reads + writes = nbytes
        copy_dst = torch.empty_like(copy_src)
        us = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), return_mode="median") * 1e3
        print(f"| {name} | {T} | a copy moving the same bytes (ceiling) | {us:.1f} | {nbytes / us / 1e6:.2f} | |")
        ref = combine_k(rows, T, s.k, w=w)
        for block, cols_fast, warps in VARIANTS:
            fn = lambda: combine_k(rows, T, s.k, w=w, block=block, cols_fast=cols_fast, num_warps=warps)  # noqa: E731
            same = torch.equal(fn(), ref)
            us = triton.testing.do_bench(fn, return_mode="median") * 1e3
            print(f"| {name} | {T} | block {block} cols_fast={cols_fast} warps={warps} | {us:.1f} | "
                  f"{nbytes / us / 1e6:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
