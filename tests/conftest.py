"""Without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here,
before the test modules import ``tabby.ops``.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_gpu = torch.cuda.is_available()
