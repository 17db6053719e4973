"""Does a copy run beside a persistent kernel that holds every SM? (session 15: the token pull's copy)

A Triton kernel fills every SM's thread slots (2 programs of 1024 threads per SM) and spins, bounded,
until a flag is set; a side stream, queued after the launch, copies N MB and then sets the flag with
a stream write. If the copy needs SMs it can only start once the spin gives up: the spin then
reports its whole budget. Copies tried: torch ``copy_`` (cudaMemcpyAsync) local and from the other
GPU (one process, peer access; torch runs that copy on the source GPU's stream: a push), and
driver copies on this GPU's stream (cuMemcpyBatchAsync with a copy engine asked for, and
cuMemcpyDtoDAsync). Session 15 (driver 580.159, 64 MB): every copy from this GPU's memory (torch,
batched, plain) and torch's copy from the other GPU waited for the spin (SM kernels); both driver
copies from the other GPU's allocation ran beside it (~0.19 ms, a copy engine).

    python3 scripts/diag_copy_engine.py [MB]
"""
import ctypes
import sys
import time

import torch
import triton
import triton.language as tl

from tabby.ops import streamops


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def _driver_copy(stream, dst, src, nbytes, batched):
    """cuMemcpyBatchAsync (CUDA 13's _v2, source order STREAM, flag PREFER_OVERLAP_WITH_COMPUTE: a
    copy engine asked for; honoured off Tegra from CUDA 13.1 on) or cuMemcpyDtoDAsync on ``stream``.
    Not capturable into a CUDA graph (the batched one: CUresult 900 under capture, session 15)."""
    lib = ctypes.CDLL("libcuda.so.1")
    h = ctypes.c_void_p(stream.cuda_stream)
    if not batched:
        fn = lib.cuMemcpyDtoDAsync_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        rc = fn(dst, src, nbytes, h)
    else:
        attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 1)
        d, s, n, idx = ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes), ctypes.c_size_t(0)
        rc = lib.cuMemcpyBatchAsync_v2(ctypes.byref(d), ctypes.byref(s), ctypes.byref(n), ctypes.c_size_t(1),
                                       ctypes.byref(attrs), ctypes.byref(idx), ctypes.c_size_t(1), h)
    if rc != 0:
        raise RuntimeError(f"driver copy failed with CUresult {rc}")


@triton.jit
def _spin(flag, out, max_iter):
    i = 0
    v = tl.load(flag, volatile=True)
    while (v < 1) & (i < max_iter):
        v = tl.load(flag, volatile=True)
        i += 1
    tl.store(out + tl.program_id(0), i)


def main():
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    n = mb << 20
    d0 = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(d0).multi_processor_count
    two = torch.cuda.device_count() > 1
    dst = torch.empty(n, dtype=torch.uint8, device=d0)
    srcs = {"local": torch.randint(0, 255, (n,), dtype=torch.uint8, device=d0)}
    if two:
        srcs["peer"] = torch.randint(0, 255, (n,), dtype=torch.uint8, device=torch.device("cuda", 1))
        torch.cuda.synchronize(1)
    flag = torch.zeros(1, dtype=torch.int32, device=d0)
    out = torch.zeros(2 * sms, dtype=torch.int32, device=d0)
    side = torch.cuda.Stream(device=d0)
    main_s = torch.cuda.current_stream(d0)
    max_iter = 2_000_000

    def do_copy(kind, src):
        if kind == "torch":
            dst.copy_(src)
        else:
            _driver_copy(torch.cuda.current_stream(d0), dst.data_ptr(), src.data_ptr(), n, kind == "batch")

    print(f"{sms} SMs, copy {mb} MB; spin budget {max_iter} polls")
    print("| copy | src | alone ms | GB/s | beside spin: spin polls (max) | wall ms | flag seen | bytes right |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for kind in ("torch", "batch", "dtod"):
        for where, src in srcs.items():
            try:
                with torch.cuda.stream(side):  # the copy alone
                    do_copy(kind, src)
                torch.cuda.synchronize(d0)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    e0.record()
                    for _ in range(5):
                        do_copy(kind, src)
                    e1.record()
                torch.cuda.synchronize(d0)
                alone = e0.elapsed_time(e1) / 5
                dst.zero_()
                flag.zero_()
                out.zero_()
                torch.cuda.synchronize(d0)
                side.wait_stream(main_s)  # the zeroing, not the spin (queued next)
                t0 = time.perf_counter()
                _spin[(2 * sms,)](flag, out, max_iter, num_warps=32)
                with torch.cuda.stream(side):
                    do_copy(kind, src)
                    streamops.write(side, flag.data_ptr(), 1)
                torch.cuda.synchronize(d0)
                wall = (time.perf_counter() - t0) * 1e3
                polls = int(out.max())
                right = bool(torch.equal(dst, src.to(d0)))
                print(f"| {kind} | {where} | {alone:.3f} | {n / alone / 1e6:.0f} | {polls} ({max_iter}) | {wall:.1f} | "
                      f"{polls < max_iter} | {right} |", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"| {kind} | {where} | error: {type(e).__name__}: {e} |", flush=True)


if __name__ == "__main__":
    main()
