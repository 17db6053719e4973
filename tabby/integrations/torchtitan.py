"""Tabby as the routed experts of torchtitan (0.3.0), through torchtitan's ``@override`` mechanism.

torchtitan's MoE (``torchtitan.models.common.moe``) computes its routed experts in
``RoutedExperts``: a token dispatcher (``LocalTokenDispatcher`` at EP 1, all-to-all / DeepEP /
HybridEP / MinimalAsyncEP at EP > 1) around ``GroupedExperts`` with parameters
``w1_EFD [E, F, D]`` (gate), ``w3_EFD [E, F, D]`` (up) and ``w2_EDF [E, D, F]`` (down): Tabby's
``w_gate``, ``w_up`` and ``w_down`` exactly. The override here replaces each
``RoutedExperts.Config`` of the model with ``TabbyRoutedExperts.Config``, whose module keeps the
``inner_experts`` submodule (so the parameters, and the checkpoint keys
``...routed_experts.inner_experts.w1_EFD`` etc., are unchanged) and runs dispatch, the three GEMMs,
the score weighting and the combine as one ``torch.ops.tabby.moe`` call. Activate it with::

    --override.imports tabby.integrations.torchtitan.tabby_routed_experts
    # or, with a Tabby config string (``tabby.functional.moe.config_string(MoEConfig(...))``):
    --override.imports 'tabby.integrations.torchtitan.tabby_routed_experts={"config": "..."}'

or in Python: ``OverrideConfig(imports=["tabby.integrations.torchtitan.tabby_routed_experts"])``.

Token dispatcher: the Tabby module has none (Tabby dispatches itself), so the overridden config
carries ``token_dispatcher=None``. At EP > 1 torchtitan's CUDA-graph check
(``Trainer.Config._validate_cuda_graphs``, run again after the overrides) walks the model's
``LocalTokenDispatcher.Config`` nodes and refuses every host-syncing one; with the override the
routed experts hold none, so the check passes. (torchtitan also runs that check in
``Trainer.Config.__post_init__``, before any override: a configuration whose *original*
dispatcher is host-syncing at EP > 1 is refused there, before this override runs; pick a
sync-free dispatcher in the base config (e.g. ``comm_backend="minimal_async_ep"``), which the
override then replaces.)

Expert parallelism: torchtitan shards ``w1_EFD``/``w3_EFD``/``w2_EDF`` over the ``ep`` mesh on
dim 0 and runs ``RoutedExperts.forward`` inside ``local_map`` (plain local tensors: this rank's
tokens, the router's global expert ids). The module takes the local shards (``to_local``) and
passes the ``ep`` mesh's process group to Tabby (found in ``parallelize``). Tensor parallelism of
the experts (hidden dimension sharded) is not supported: Tabby needs whole experts.

Tabby computes in bf16 (as torchtitan's ``GroupedExperts`` does: it casts inputs and weights to
bf16); the output is cast back to the input's dtype.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from ..functional import moe as layer

__all__ = ["OVERRIDE", "TabbyRoutedExperts", "tabby_routed_experts"]

OVERRIDE = "tabby.integrations.torchtitan.tabby_routed_experts"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TabbyRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose dispatch + experts + combine is one ``torch.ops.tabby.moe`` call.
    Same forward contract (``x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
    num_local_tokens_per_expert_E -> out_BLD``) and the same parameters (``inner_experts.*``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        token_dispatcher: LocalTokenDispatcher.Config | None = None
        """Unused (Tabby dispatches itself); None, so that torchtitan's CUDA-graph check finds no
        host-syncing dispatcher."""
        tabby_config: str = ""
        """``tabby.functional.moe.config_string(MoEConfig)`` ("" : the defaults)."""

    def __init__(self, config: Config):
        # RoutedExperts.__init__ would build the dispatcher; build only the experts.
        super(RoutedExperts, self).__init__()
        self.inner_experts = config.inner_experts.build()
        self.token_dispatcher = None
        self.tabby_config = config.tabby_config
        self.tabby_group_name = ""

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor | None = None) -> torch.Tensor:
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        bf16 = torch.bfloat16
        ex = self.inner_experts
        w_gate, w_up, w_down = (_local(w).to(bf16) for w in (ex.w1_EFD, ex.w3_EFD, ex.w2_EDF))
        x_TD = x_BLD.reshape(B * L, D).to(bf16)
        idx = topk_expert_ids_BLK.reshape(B * L, K)
        scores = topk_scores_BLK.reshape(B * L, K).to(torch.float32)
        y = layer.moe(x_TD, idx, scores, w_gate, w_up, w_down, group=self.tabby_group_name,
                          config=self.tabby_config)
        return y.to(x_BLD.dtype).view(B, -1, D)

    def parallelize(self, parallel_dims) -> None:
        """Parallelize the experts' weights (torchtitan's sharding configs), and take the ``ep``
        mesh's process group as Tabby's expert-parallel group."""
        super(RoutedExperts, self).parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        if ep_mesh is not None and ep_mesh.size() > 1:
            self.tabby_group_name = layer.group_name(ep_mesh.get_group())


@override(target=RoutedExperts.Config, description="Tabby: dispatch + routed experts + combine in one op")
def tabby_routed_experts(cfg: RoutedExperts.Config, *, config: str = "") -> TabbyRoutedExperts.Config:
    """Replace a ``RoutedExperts.Config`` by ``TabbyRoutedExperts.Config`` (fields copied: experts,
    sharding and init configs; the dispatcher dropped). ``config``: a Tabby config string."""
    if isinstance(cfg, TabbyRoutedExperts.Config):
        return dataclasses.replace(cfg, tabby_config=config)
    return derive(cfg, TabbyRoutedExperts.Config, token_dispatcher=None, tabby_config=config)


def apply(model_config, config: str = "") -> list[str]:
    """Apply the override to a model config tree without a trainer (tests, scripts): the same
    path as ``--override.imports`` (``config``: a Tabby config string, "" for the defaults).
    Returns torchtitan's log lines of the replacements."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    entry = (OVERRIDE, {"config": config}) if config else OVERRIDE
    return apply_overrides(OverrideConfig(imports=[entry]), model_config)
