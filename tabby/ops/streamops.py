"""Stream memory operations: a CUDA stream waits for, or writes, a 32-bit word in GPU memory.

The forward megakernel's token pull (``MegaPlan.token_pull``) copies every peer's x with a
copy engine while the kernel computes: a side stream waits for the peer's "x published" flag,
copies, resets the flag and sets a counter the kernel polls. A kernel cannot do that wait on the
side stream: the persistent megakernel holds every SM slot, so a waiting or signalling launch
behind it could be starved. The driver's stream memory operations (``cuStreamWaitValue32``,
``cuStreamWriteValue32``; what NVSHMEM's on-stream signal ops use) run in the stream's front end
and take no SM. They are captured into CUDA graphs as memory-operation nodes. (The copy itself
is a plain ``copy_`` from the peer's symmetric memory, which the driver runs on a copy engine; a
copy within this GPU's own memory would be a kernel on the SMs: docs/performance.md, "Token pull".)

Reached through ctypes (libcuda), with the current stream's handle: no new dependency.
"""
from __future__ import annotations

import ctypes

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a system-wide memory fence before the write

_LIB = None


def _driver():
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc} (stream memory operations unsupported here?)")


def wait_geq(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    """Work queued on ``stream`` after this starts once the int32 at device address ``addr`` >= value."""
    _check(_driver().cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), addr, value, WAIT_GEQ),
           "cuStreamWaitValue32")


def write(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    """Write ``value`` to the int32 at device address ``addr`` once ``stream``'s earlier work is done
    (after a system-wide fence: whatever that work wrote is visible first)."""
    _check(_driver().cuStreamWriteValue32_v2(ctypes.c_void_p(stream.cuda_stream), addr, value, WRITE_DEFAULT),
           "cuStreamWriteValue32")
