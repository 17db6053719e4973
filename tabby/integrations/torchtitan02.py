"""Tabby as the routed experts of torchtitan 0.2.x, the releases that import with torch 2.11
(torchtitan 0.3.0 needs a newer torch; its integration is ``torchtitan.py``, through 0.3.0's
``@override``, which 0.2.x does not have).

torchtitan 0.2.x computes a sparse block in ``torchtitan.models.moe.MoE.forward``: its router
(``TokenChoiceTopKRouter``: scores, top-k expert ids, tokens per expert), a reorder of the routed
rows, ``GroupedExperts`` with parameters ``w1 [E, F, D]`` (gate), ``w3 [E, F, D]`` (up) and
``w2 [E, D, F]`` (down): Tabby's ``w_gate``, ``w_up`` and ``w_down`` exactly; the shared experts;
the scores applied after the experts (``score_before_experts=False``, Qwen3's) and a sum over k.
``apply(model)`` gives each ``MoE`` module of a model a forward that keeps the router, its
load-balancing count (``tokens_per_expert``) and the shared experts, and runs the reorder, the routed
experts, the scores and the sum as one ``torch.ops.tabby.moe`` call. The parameters and checkpoint
keys (``...moe.experts.w1`` etc.) are unchanged.

Limits: one rank (the experts as plain tensors; torchtitan 0.2.x's expert parallelism shards them
as DTensors, refused with a clear error: use 0.3.0's override, or ``tabby.moe`` with a process group);
``score_before_experts=True`` (DeepSeek-V3's and Llama 4's recipes in 0.2.x: the score scales the
experts' input, not their output) is refused, as Tabby's layer weights the outputs. Tabby computes
in bf16 (as ``GroupedExperts`` does); the output is cast back to the input's dtype.
"""
from __future__ import annotations

import types

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.moe import MoE

from ..functional import moe as layer
from ..validate import MoEInputError

__all__ = ["apply", "tabby_moe_forward"]


def apply(model: torch.nn.Module, config: str = "") -> torch.nn.Module:
    """Route every ``MoE`` module of ``model`` through Tabby (``config``: a ``tabby.MoEConfig`` text,
    ``tabby.functional.moe.config_string``; "": the defaults). Returns the model."""
    found = 0
    for m in model.modules():
        if isinstance(m, MoE):
            if m.score_before_experts:
                raise MoEInputError("torchtitan MoE with score_before_experts=True: Tabby weights the experts' "
                                    "outputs by the router scores, not their inputs")
            m.forward = types.MethodType(tabby_moe_forward, m)
            m.tabby_config = config
            found += 1
    if not found:
        raise MoEInputError(f"{type(model).__name__} has no torchtitan.models.moe.MoE module")
    return model


def tabby_moe_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` with the routed experts on Tabby: x [B, L, D] -> [B, L, D]."""
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    top_scores, expert_ids, num_tokens_per_expert = self.router(x, self.expert_bias)
    with torch.no_grad():  # the load-balancing count, as torchtitan keeps it
        self.tokens_per_expert.add_(num_tokens_per_expert)
    ex = self.experts
    if any(isinstance(w, DTensor) for w in (ex.w1, ex.w2, ex.w3)):
        raise MoEInputError("torchtitan 0.2.x's expert parallelism (DTensor experts) is not supported through "
                            "Tabby: use torchtitan 0.3.0's override, or tabby.moe with the expert-parallel group")
    bf16 = torch.bfloat16
    w_gate, w_up, w_down = (w if w.dtype == bf16 else w.to(bf16) for w in (ex.w1, ex.w3, ex.w2))
    xin = x if x.dtype == bf16 else x.to(bf16)
    y = layer.moe(xin, expert_ids, top_scores, w_gate, w_up, w_down, config=self.tabby_config).to(x.dtype)
    if self.shared_experts is not None:
        y = self.shared_experts(x) + y
    return y.reshape(bs, slen, dim)
