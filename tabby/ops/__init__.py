"""Raw Triton kernels (the ``ops`` layer): each role a ``@triton.jit`` function plus a thin launcher.

``INTERPRET``: whether the kernels run under Triton's interpreter on CPU tensors, decided once in
tabby/_runtime.py before any kernel is defined; a few primitives take a fallback path there (see
sync.py and gemm.py). ``check_device(device)`` raises ``MoEInputError`` for tensors the kernels
cannot run on in this process (CPU tensors with the interpreter off).
"""
from .._runtime import INTERPRET, check_device

__all__ = ["INTERPRET", "check_device"]
