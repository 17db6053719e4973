"""Are this machine's GPUs equally fast? Per GPU, one at a time: a sustained bf16 GEMM (TFLOP/s, with
the SM clock and power read after it) and an HBM copy (TB/s). A rank whose GPU is slower makes its
peers wait in every expert-parallel pass; this tells a slow GPU from a slow rank's work.

    python scripts/gpu_parity.py [--seconds 2]
"""
import argparse
import subprocess
import time

import torch


def _smi(i):
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu"
    out = subprocess.run(["nvidia-smi", "-i", str(i), f"--query-gpu={q}", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def _rate(fn, seconds):
    fn()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    print("| gpu | bf16 GEMM TFLOP/s | smi after GEMM (sm MHz, mem MHz, W, C) | HBM copy TB/s |")
    print("|---|---|---|---|")
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            n = 8192
            a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            c = torch.empty_like(a)
            tflops = _rate(lambda: torch.mm(a, b, out=c), args.seconds) * 2 * n ** 3 / 1e12
            smi = _smi(i)
            src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            tbs = _rate(lambda: dst.copy_(src), args.seconds) * 2 * src.numel() / 1e12
            print(f"| {i} | {tflops:.0f} | {smi} | {tbs:.2f} |", flush=True)
            del a, b, c, src, dst
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
