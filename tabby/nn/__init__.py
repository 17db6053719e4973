"""Tabby as ``nn.Module``s: ``Experts`` (the routed SwiGLU experts of one expert-parallel rank),
``MoE`` (router + experts + shared expert, returning ``RouterStats``) and the weight converters of
``tabby.nn.convert`` (transformers' and torchtitan's layouts, any EP rank and size)."""
from . import convert
from .experts import Experts, skip_invalid_ids, split_gate_up
from .moe import MoE, RouterStats, expert_load, route

__all__ = ["Experts", "MoE", "RouterStats", "route", "expert_load", "skip_invalid_ids", "split_gate_up",
           "convert"]
