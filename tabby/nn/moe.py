"""``MoE``: a router, Tabby's routed experts and an optional shared expert, as one ``nn.Module``.

The router covers the common token-choice schemes:

* Mixtral / Qwen-MoE: softmax scores, top-k, optional renormalisation of the k weights;
* DeepSeek-V3: sigmoid scores, group-limited routing (``n_group`` groups of experts, the tokens'
  top-k chosen within the ``topk_group`` groups of highest score, a group's score being the sum of
  its two best), renormalisation, a routed scaling factor, and the auxiliary-loss-free load
  balancing: a per-expert bias added to the scores for the *choice* only (the weights come from
  the scores without it), moved outside autograd after each step by ``update_bias`` towards
  balance: ``bias += speed * sign(mean load - load)``.

Scores are computed in fp32 (the gate's weight is cast per call). The shared expert runs inside
Tabby's kernel, unless it has a sigmoid gate (Qwen2-MoE: ``sigmoid(x w) * shared(x)``), which
plain PyTorch computes beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..functional.config import MoEConfig
from ..validate import MoEInputError
from .experts import Experts, group_rank_size


@dataclass
class RouterStats:
    """What a ``MoE`` forward reports about its routing.

    load:        [E] fp32, routed slots per expert in this call (this rank's tokens), no gradient.
    expert_bias: [E] fp32, the load-balancing bias the choice used (None without it).
    aux_loss:    the auxiliary load-balancing loss (a scalar with gradient through the router),
                 ``aux_loss_coef * E * sum_e f_e * P_e`` with ``f_e`` the fraction of slots routed
                 to expert e and ``P_e`` its mean normalised score; None when ``aux_loss_coef`` is 0.
    """

    load: torch.Tensor
    expert_bias: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def route(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax", norm_topk_prob: bool = False,
          routed_scaling_factor: float = 1.0, n_group: int | None = None, topk_group: int | None = None,
          expert_bias: torch.Tensor | None = None):
    """Token-choice top-k routing of ``logits [T, E]`` (any float dtype; computed in fp32).

    Returns (topk_idx [T, k] int64, topk_weights [T, k] fp32, scores [T, E] fp32). The choice
    ranks ``scores + expert_bias`` (restricted to the ``topk_group`` best of ``n_group`` groups
    when given); the weights are the chosen experts' ``scores``, renormalised to sum 1 when
    ``norm_topk_prob``, then times ``routed_scaling_factor``.
    """
    logits = logits.float()
    if score_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise MoEInputError(f"score_func={score_func!r}: must be 'softmax' or 'sigmoid'")
    choice = scores if expert_bias is None else scores + expert_bias
    T, E = scores.shape
    if n_group is not None and n_group > 1:
        if topk_group is None or not 1 <= topk_group <= n_group:
            raise MoEInputError(f"topk_group={topk_group!r}: must be in [1, n_group={n_group}]")
        if E % n_group or E // n_group < 2:
            raise MoEInputError(f"n_group={n_group} must divide the {E} experts into groups of at least 2")
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    topk_idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return topk_idx, weights, scores


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] fp32: routed slots per expert (device ops only; counts are exact in fp32 below 2^24)."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.float32, device=flat.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))


class MoE(nn.Module):
    """Router + routed experts (Tabby) + optional shared expert. ``forward(x [..., H])`` returns
    ``(y [..., H], RouterStats)``.

    Args:
        hidden, intermediate: model width ``H`` and routed expert width ``I``.
        num_experts: experts of the layer (all ranks); each of the ``W`` ranks of ``group`` holds
            ``num_experts / W`` of them (``self.experts``, a ``tabby.nn.Experts``).
        top_k: experts per token.
        score_func: "softmax" or "sigmoid".
        norm_topk_prob: renormalise the k weights to sum 1.
        routed_scaling_factor: multiplies the routed weights (DeepSeek-V3: 2.5).
        n_group, topk_group: group-limited routing (DeepSeek-V3: 8 and 4); None: off.
        load_balance_speed: the auxiliary-loss-free bias's step (DeepSeek-V3: 1e-3); None: no bias.
        aux_loss_coef: weight of the auxiliary loss in ``RouterStats.aux_loss``; 0: none.
        shared_intermediate: the shared expert's width ``I_s`` (None or 0: no shared expert).
        shared_gate: a sigmoid gate on the shared expert's output (Qwen2-MoE).
        layout: the routed experts' parameter layout ("fused" or "separate", see ``Experts``).
        group, config: the expert-parallel group and ``tabby.MoEConfig``, as for ``tabby.moe``.
        init_std, dtype, device: parameter init and placement (the gate is kept in fp32).

    Training with the load-balancing bias: call ``update_bias()`` after each optimizer step (or
    every few); it uses the loads accumulated by the training forwards since the last update
    (``tokens_per_expert``), summed over ``load_group`` (e.g. the data-parallel group) if given.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 score_func: str = "softmax", norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                 n_group: int | None = None, topk_group: int | None = None,
                 load_balance_speed: float | None = None, aux_loss_coef: float = 0.0,
                 shared_intermediate: int | None = None, shared_gate: bool = False, layout: str = "fused",
                 group=None, config: MoEConfig | None = None, init_std: float | None = 0.02,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        rank, world = group_rank_size(group)
        if num_experts % world:
            raise MoEInputError(f"num_experts={num_experts} is not a multiple of the group's {world} ranks")
        if not 1 <= top_k <= num_experts:
            raise MoEInputError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score_func not in ("softmax", "sigmoid"):
            raise MoEInputError(f"score_func={score_func!r}: must be 'softmax' or 'sigmoid'")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        self.load_balance_speed, self.aux_loss_coef = load_balance_speed, aux_loss_coef
        self.init_std = init_std
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32, device=device)
        self.experts = Experts(num_experts // world, hidden, intermediate, layout=layout, group=group,
                               config=config, skip_invalid=False, init_std=init_std, dtype=dtype, device=device)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if load_balance_speed is not None else None)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32, device=device),
                             persistent=False)
        self.shared_intermediate = shared_intermediate or 0
        if self.shared_intermediate:
            Is, kw = self.shared_intermediate, dict(dtype=dtype, device=device)
            self.shared_gate_proj = nn.Parameter(torch.empty(Is, hidden, **kw))
            self.shared_up_proj = nn.Parameter(torch.empty(Is, hidden, **kw))
            self.shared_down_proj = nn.Parameter(torch.empty(hidden, Is, **kw))
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
                                   if shared_gate and self.shared_intermediate else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(self.hidden)
            self.gate.weight.normal_(0.0, std)
            self.experts.reset_parameters()
            if self.shared_intermediate:
                for p in (self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj):
                    p.normal_(0.0, self.init_std if self.init_std is not None else 1.0 / math.sqrt(p.shape[-1]))
            if self.shared_expert_gate is not None:
                self.shared_expert_gate.weight.normal_(0.0, std)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def shared_weights(self):
        if not self.shared_intermediate:
            return None
        return self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        logits = F.linear(x2.float(), self.gate.weight.float())
        topk_idx, topk_weights, scores = route(
            logits, self.top_k, score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group, topk_group=self.topk_group,
            expert_bias=self.expert_bias)
        with torch.no_grad():
            load = expert_load(topk_idx, self.num_experts)
            if self.training and self.expert_bias is not None:
                self.tokens_per_expert.add_(load)
        shared = self.shared_weights()
        in_kernel = shared if self.shared_expert_gate is None else None
        y = self.experts(x2, topk_idx, topk_weights, shared=in_kernel)
        if shared is not None and self.shared_expert_gate is not None:
            sg, su, sd = shared
            xs = x2.to(sg.dtype)
            ys = F.linear(F.silu(F.linear(xs, sg)) * F.linear(xs, su), sd)
            y = y + (torch.sigmoid(self.shared_expert_gate(xs)) * ys).to(y.dtype)
        aux = None
        if self.aux_loss_coef:
            f = load / load.sum()
            p = scores / scores.sum(dim=-1, keepdim=True) if self.score_func == "sigmoid" else scores
            aux = self.aux_loss_coef * self.num_experts * (f * p.mean(dim=0)).sum()
        stats = RouterStats(load=load, expert_bias=self.expert_bias, aux_loss=aux)
        return y.reshape(shape), stats

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None, load_group=None, center: bool = False) -> None:
        """One step of the auxiliary-loss-free balancing: ``expert_bias += speed * sign(mean - load)``
        (``center``: minus the step's mean, as torchtitan does). ``load`` defaults to the loads
        accumulated by training forwards since the last update (then reset); ``load_group``: a
        process group whose ranks' loads are summed first (an all_reduce)."""
        if self.expert_bias is None:
            raise MoEInputError("update_bias: this MoE has no load-balancing bias (load_balance_speed=None)")
        if load is None:
            load = self.tokens_per_expert.clone()
            self.tokens_per_expert.zero_()
        load = load.float()
        if load_group is not None:
            import torch.distributed as dist

            dist.all_reduce(load, group=load_group)
        delta = self.load_balance_speed * torch.sign(load.mean() - load)
        if center:
            delta = delta - delta.mean()
        self.expert_bias.add_(delta)
