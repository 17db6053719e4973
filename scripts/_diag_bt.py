"""Diagnostic: the transposing dgrad's producer modes at deepseek-v4-pro's down dgrad."""
import sys, torch
sys.path.insert(0, "scripts")
from fp8_bench import bench, even_schedule
from tabby.ops import gemm_fp8, gemm_fp8_ws
from tabby.ops.fp8 import quantize_blocks, quantize_rows
T, k, E, H, I = 16384, 6, 384, 7168, 3072
R, te, nt, start, count = even_schedule(T * k, E)
dq, ds = quantize_rows(torch.randn(R, H, device="cuda", dtype=torch.bfloat16))
gu = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
ws = torch.rand(R, device="cuda")
wd = quantize_blocks(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5)
wd_t = gemm_fp8.transpose_blocks(*wd)
fl = 2 * T * k * I * H
print("held", fl / bench(lambda: gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, *wd_t, gu, ws, te, nt)) / 1e9, flush=True)
dgu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device="cuda")
hw = torch.empty(R, I, dtype=torch.bfloat16, device="cuda")
dw = torch.empty(R, -(-I // 128), dtype=torch.float32, device="cuda")
epi = (gu, gu.stride(0), ws, dgu, dgu.stride(0), hw, hw.stride(0), dw, dw.stride(0))
wd_st = wd[1].transpose(-2, -1).contiguous()
ref = gemm_fp8.down_dgrad_swiglu_fp8(dq, ds, *wd_t, gu, ws, te, nt)
for mode in (0, 1, 2, 3):
    for lag, stages in ((1, 4), (2, 4)):
        try:
            t = bench(lambda: gemm_fp8_ws.launch_bt(dq, ds, (wd[0],), wd_st, te, nt, 128, gemm_fp8_ws.EPI_SWIGLU_BWD, epi, I,
                                                   stages=stages, lag=lag, mode=mode))
            same = torch.equal(dgu, ref[0])
            print(f"mode {mode} lag {lag} stages {stages}: {fl / t / 1e9:.0f} TFLOP/s, bitwise {same}", flush=True)
        except Exception as e:
            print(f"mode {mode} lag {lag}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
