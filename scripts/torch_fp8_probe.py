"""Why the torch-fp8 anchor is slow: torch._scaled_grouped_mm alone (FP8 rowwise and bf16 at two
shapes), then a torch.profiler table of the anchor's forward at qwen3-30b-a3b 16384 tokens (GPU only).

    PYTHONPATH=$PWD python3 scripts/torch_fp8_probe.py
"""
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tabby_bench.anchors.torch_fp8 import moe_torch_fp8

E4M3 = torch.float8_e4m3fn
dev = "cuda"
def ev(fn, n=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s = torch.cuda.Event(True); e = torch.cuda.Event(True)
    h0 = time.perf_counter(); s.record()
    for _ in range(n): fn()
    h1 = time.perf_counter(); e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n, (h1 - h0) * 1e3 / n
for (E, H, N, M) in ((128, 2048, 1536, 131072), (384, 7168, 4096, 131072)):
    a = torch.randn(M, H, device=dev).to(E4M3); sa = torch.ones(M, device=dev)
    w = torch.randn(E, N, H, device=dev).to(E4M3); sw = torch.ones(E, N, device=dev)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (M // E)
    for fast in (True, False):
        try:
            ms, hms = ev(lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast))
            print(f"_scaled_grouped_mm E={E} K={H} N={N} M={M} fast_accum={fast}: {ms:.3f} ms {2*M*H*N/ms/1e9:.0f} TFLOP/s host {hms:.3f} ms/call", flush=True)
        except Exception as ex:
            print("scaled_grouped_mm failed", type(ex).__name__, str(ex)[:300], flush=True)
    wb = torch.randn(E, N, H, device=dev).bfloat16(); ab = torch.randn(M, H, device=dev).bfloat16()
    ms, hms = ev(lambda: torch._grouped_mm(ab, wb.transpose(-2, -1), offs=offs))
    print(f"_grouped_mm bf16 E={E}: {ms:.3f} ms {2*M*H*N/ms/1e9:.0f} TFLOP/s host {hms:.3f}", flush=True)
    del a, w, wb, ab
# the anchor's forward, profiled (qwen3-30b-a3b at 16384 tokens)
T, k, E, H, I = 16384, 8, 128, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(T, H, device=dev, generator=g).bfloat16()
wts, idx = torch.softmax(torch.randn(T, E, device=dev, generator=g), -1).topk(k, -1)
ws = [(torch.randn(*s, device=dev, generator=g) * s[-1] ** -0.5).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]
for _ in range(2): moe_torch_fp8(x, idx, wts, *ws)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    moe_torch_fp8(x, idx, wts, *ws); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60), flush=True)
