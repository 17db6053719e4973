"""Raw Triton kernels (the ``ops`` layer): each role a ``@triton.jit`` function plus a thin launcher."""
import os

# Under TRITON_INTERPRET=1 (CPU tests) kernels run on CPU tensors; a few primitives take a
# fallback path there (see sync.py and gemm.py).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
