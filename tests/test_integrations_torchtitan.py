"""The torchtitan backend (tabby.integrations.torchtitan): a tiny torchtitan MoE (8 experts, dim 64,
hidden 32, top-2) with its routed experts overridden by Tabby through torchtitan's own override
machinery gives torchtitan's output and gradients (bf16 tolerance) and the same state_dict keys.
Skipped where torchtitan is not installed."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

import tabby.integrations.torchtitan as tabby_tt

E, D, F, K = 8, 64, 32, 2


def _config(score_func: str = "softmax", route_norm: bool = False):
    return make_moe_config(
        num_experts=E,
        router=make_router_config(dim=D, num_experts=E, gate_param_init={}, top_k=K, score_func=score_func,
                                  route_norm=route_norm),
        routed_experts=make_routed_experts_config(dim=D, hidden_dim=F, num_experts=E, top_k=K, param_init={},
                                                  comm_backend="standard"),
    )


def _models(score_func="softmax", route_norm=False):
    cfg = _config(score_func, route_norm)
    ref = copy.deepcopy(cfg).build()
    lines = tabby_tt.apply(cfg)
    assert len(lines) == 1 and "TabbyRoutedExperts" in lines[0], lines
    assert isinstance(cfg.routed_experts, tabby_tt.TabbyRoutedExperts.Config)
    new = cfg.build()
    assert isinstance(new.routed_experts, tabby_tt.TabbyRoutedExperts)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(0, 1 / D ** 0.5 if "w2" not in name else 1 / F ** 0.5)
    new.load_state_dict(ref.state_dict(), strict=True)
    return ref, new


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def test_override_keeps_state_dict_keys_and_drops_the_dispatcher():
    ref, new = _models()
    assert list(ref.state_dict().keys()) == list(new.state_dict().keys())
    for k, v in ref.state_dict().items():
        assert new.state_dict()[k].shape == v.shape and new.state_dict()[k].dtype == v.dtype, k
    cfg = _config()
    tabby_tt.apply(cfg)
    # torchtitan's CUDA-graph check at EP > 1 walks these nodes: with the override there are none
    assert not list(cfg.traverse(LocalTokenDispatcher.Config))
    assert list(cfg.traverse(RoutedExperts.Config))  # the Tabby config is still a RoutedExperts.Config


@pytest.mark.parametrize("score_func,route_norm", [("softmax", False), ("sigmoid", True)])
def test_output_and_gradients_match_torchtitan(score_func, route_norm):
    ref, new = _models(score_func, route_norm)
    torch.manual_seed(1)
    x = torch.randn(2, 16, D)
    dy = torch.randn(2, 16, D)
    outs, grads = [], []
    for m in (ref, new):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * dy).sum().backward()
        outs.append(y.detach())
        grads.append({"x": xi.grad, **{n: p.grad for n, p in m.named_parameters()}})
    assert outs[1].shape == outs[0].shape and outs[1].dtype == outs[0].dtype
    assert _rel(outs[1], outs[0]) < 2e-2
    assert set(grads[0]) == set(grads[1])
    for n in grads[0]:
        assert grads[1][n] is not None, n
        assert _rel(grads[1][n], grads[0][n]) < 2e-2, (n, _rel(grads[1][n], grads[0][n]))


def test_cli_form_with_a_tabby_config():
    """``--override.imports 'tabby.integrations.torchtitan.tabby_routed_experts={"config": ...}'``:
    parsed by torchtitan's own CLI parser, applied by its own apply_overrides."""
    import json

    from torchtitan.config.override import (
        OverrideConfig,
        apply_overrides,
        parse_cli_imports,
    )

    from tabby.functional.config import MoEConfig
    from tabby.functional.config import config_string

    text = config_string(MoEConfig())
    imports = parse_cli_imports([f"{tabby_tt.OVERRIDE}={json.dumps({'config': text})}"])
    cfg = _config()
    assert len(apply_overrides(OverrideConfig(imports=imports), cfg)) == 1
    assert cfg.routed_experts.tabby_config == text
    assert cfg.build().routed_experts.tabby_config == text
