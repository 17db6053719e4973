"""Diagnostic (removed after its run): the transposing dgrads with every other block transposed
(half the transposer's shared-memory traffic a FLOP, as 256-row tiles sharing each block would
have; wrong values), against the full transposer and the cached copies, deepseek-v4-pro's and
kimi-k2's shapes, one process, ABBA order."""
import sys

import torch

sys.path.insert(0, "scripts")
from fp8_bench import bench, even_schedule  # noqa: E402

from tabby.ops import gemm_fp8, gemm_fp8_ws  # noqa: E402
from tabby.ops.fp8 import quantize_blocks, quantize_rows  # noqa: E402

for name, k, I in (("deepseek-v4-pro", 6, 3072), ("kimi-k2", 8, 2048)):
    T, E, H = 16384, 384, 7168
    R, te, nt, _, _ = even_schedule(T * k, E)
    dq, ds = quantize_rows(torch.randn(R, H, device="cuda", dtype=torch.bfloat16))
    gu = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(R, device="cuda")
    wd = quantize_blocks(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5)
    wd_t = gemm_fp8.transpose_blocks(*wd)
    fl = 2 * T * k * I * H
    dgu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device="cuda")
    hw = torch.empty(R, I, dtype=torch.bfloat16, device="cuda")
    dw = torch.empty(R, -(-I // 128), dtype=torch.float32, device="cuda")
    epi = (gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0), dw, dw.stride(0))
    st = wd[1].transpose(-2, -1).contiguous()
    runs = {"held": lambda: gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, *wd_t, gu, ws, te, nt)}
    for half in (False, True):
        runs[f"half={half}"] = (lambda h: lambda: gemm_fp8_ws.launch_bt(
            dq, ds, (wd[0],), st, te, nt, 128, gemm_fp8_ws.EPI_SWIGLU_BWD, epi, I, half=h))(half)
    res = {n: [] for n in runs}
    for order in (list(runs), list(reversed(runs))):
        for n in order:
            res[n].append(round(fl / bench(runs[n]) / 1e9))
    print(f"{name} down dgrad TFLOP/s (ABBA): " + "; ".join(f"{n} {v}" for n, v in res.items()), flush=True)
