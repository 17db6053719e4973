"""Tabby: an expert-parallel Mixture-of-Experts layer for Hopper GPUs.

On a machine without a usable GPU, importing tabby selects Triton's interpreter, so that the layer
runs on CPU tensors (slowly; see tabby/_runtime.py).
"""
# The package's version; pyproject.toml reads it from here.
__version__ = "0.2.0"

# First: chooses compiled or interpreted kernels before any @triton.jit function is defined.
from . import _runtime  # noqa: E402,F401  isort: skip
from .activation import Activation  # noqa: E402
from .functional.config import MoEConfig, Tuning  # noqa: E402
from .functional.moe import check_errors, moe  # noqa: E402
from .functional.workspace import TabbyDeviceError, free_workspaces  # noqa: E402
from .reference import moe_reference  # noqa: E402
from .reference_fp8 import moe_reference_fp8  # noqa: E402
from .validate import MoEDims, MoEInputError, TabbyMemoryError, check_inputs  # noqa: E402
from . import nn  # noqa: E402

__all__ = ["moe", "moe_reference", "moe_reference_fp8", "MoEConfig", "Tuning", "Activation", "check_errors",
           "free_workspaces", "MoEInputError", "TabbyDeviceError", "TabbyMemoryError", "MoEDims", "check_inputs", "nn",
           "__version__"]
