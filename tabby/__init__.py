"""Tabby: an expert-parallel Mixture-of-Experts layer for Hopper GPUs."""
from .functional.config import MoEConfig
from .functional.moe import check_errors, moe
from .functional.workspace import TabbyDeviceError
from .reference import moe_reference
from .validate import MoEDims, MoEInputError, check_inputs

__all__ = ["moe", "MoEConfig", "check_errors", "TabbyDeviceError", "moe_reference", "MoEDims", "MoEInputError",
           "check_inputs"]
