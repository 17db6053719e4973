"""Tabby: an expert-parallel Mixture-of-Experts layer for Hopper GPUs."""
from .reference import moe_reference
from .validate import MoEDims, MoEInputError, check_inputs

__all__ = ["moe_reference", "MoEDims", "MoEInputError", "check_inputs"]
