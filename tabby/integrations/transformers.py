"""Tabby as an experts backend of HuggingFace transformers (5.x).

transformers' MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, ...) keep their routed
experts in one module with ``gate_up_proj [E, 2I, H]`` (gate rows first) and
``down_proj [E, H, I]``, whose forward is looked up by name in ``transformers.integrations.moe.
ExpertsInterface`` (``experts_implementation=...`` at load, or ``model.set_experts_implementation``)::

    import tabby.integrations.transformers as tabby_hf
    tabby_hf.register()                          # adds "tabby" to the registry
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="tabby")

The backend reads ``gate_up_proj`` and ``down_proj`` from the module (the gate and up halves go to
Tabby as views, no copy; ``expert_weights``) and runs ``torch.ops.tabby.moe``, so ``torch.compile(fullgraph=True)``
keeps the experts in the graph. Routing slots whose expert id is outside the module's experts
(the sentinels that transformers' own expert-parallel plan writes, or -1) contribute nothing.
Tabby computes in bf16: other dtypes are cast per call (a copy of the weights each call; load the
model in bf16). Each module's gate (its ``_apply_gate`` with its ``act_fn``, limits and alpha) is
matched, once, against Tabby's activations (``tabby.Activation``: SwiGLU, SwiGLU with clamps on
g and u (DeepSeek-V4, GLM-5-next, HY-V4) or on silu(g) and u (Step-3.7), gpt-oss's (MiniMax-M3-VL),
GeGLU (Gemma 4)), by running it on a probe (``detect_activation``); the call then runs with that
activation. Weights in any of transformers' layouts (``is_transposed``, ``is_concatenated``) and
biases (``has_bias``: gpt-oss, the OpenAI privacy filter) go to Tabby as views, read in place
(``expert_weights``). Experts whose gate is none of Tabby's, or without a gate (Nemotron-H), run
transformers' ``grouped_mm`` instead, with a warning naming why.

Expert parallelism through Tabby's own dispatch (every rank its own tokens; the experts sharded
over ``group``; no replicated tokens, no all-reduce of the outputs): ``shard_experts(model,
group)`` keeps rank r's ``E / W`` experts of every experts module, and the backend then passes the
router's global expert ids and the group to Tabby. Use it *instead of* transformers' tensor/expert
parallel plan (``tp_plan``). The rest of the model is replicated over ``group``: wrap it for data
parallelism as usual, with the experts left out of the data-parallel reduction over ``group``
(each rank's experts are its own; their gradients already hold every rank's tokens), e.g. FSDP2::

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation="tabby")
    tabby_hf.shard_experts(model, ep_group)
    for layer in model.model.layers:            # experts: sharded over the data-parallel replicas
        fully_shard(layer.mlp.experts, mesh=dp_mesh)   # of the expert-parallel group (if any)
    fully_shard(model, mesh=world_mesh, ignored_params=expert_params)  # the rest over every rank

Each rank must make the same Tabby calls in the same order (same number of layers and steps;
the token count per rank may differ only between steps, not between ranks).
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from torch import nn

from ..activation import KINDS, UNGATED_KINDS, Activation
from ..activation import apply as apply_activation
from ..functional import moe as layer
from ..functional.config import MoEConfig, config_string, parse_config
from ..functional.plan import separate_launches_conflicts
from ..nn.convert import local_experts
from ..nn.experts import gate_up_halves, group_rank_size, skip_invalid_ids
from ..validate import LAYOUT_KN, LAYOUT_NK

log = logging.getLogger("tabby")

NAME = "tabby"
_config_string = ""
_warned: set = set()


# Attribute names under which transformers' experts modules keep their activation's constants.
_LIMIT_NAMES = ("limit", "swiglu_limit")
_ALPHA_NAMES = ("alpha", "swiglu_alpha")


def _constants(module: nn.Module, names) -> list:
    """The finite positive numbers under ``names`` on the module and its config (candidates)."""
    out = []
    for owner in (module, getattr(module, "config", None)):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
                out.append(float(v))
    return list(dict.fromkeys(out))


def _candidates(module: nn.Module):
    """Tabby's activations the module's gate could be, with its constants."""
    yield Activation()
    yield Activation("geglu")
    for L in _constants(module, _LIMIT_NAMES):
        yield Activation("swiglu-clamp", limit=L)
        yield Activation("swiglu-clamp-out", limit=L)
        for a in _constants(module, _ALPHA_NAMES):
            yield Activation("gpt-oss", limit=L, alpha=a)


def detect_activation(module: nn.Module) -> Activation | None:
    """Which of Tabby's activations the module's gate (``_apply_gate``, with its ``act_fn``, limits
    and alpha) computes, found by running it: on a probe of g, u values from -50 to 50 (past any
    clamp in use) in float64, against each candidate (``_candidates``); None if none matches. Where
    the gate and up columns interleave (``is_concatenated=False``) the probe is laid out so. Experts
    without a gate (``has_gate`` false): ``_ungated_activation``."""
    if not getattr(module, "has_gate", True):
        return _ungated_activation(module)
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:
        return None
    n = 4001
    g = torch.linspace(-50.0, 50.0, n, dtype=torch.float64)
    u = torch.linspace(50.0, -50.0, n, dtype=torch.float64)
    u = u[torch.randperm(n, generator=torch.Generator().manual_seed(0))]  # (g and u not in step)
    if getattr(module, "is_concatenated", True):
        probe = torch.cat([g, u]).view(1, 2 * n)
    else:
        probe = torch.stack([g, u], dim=-1).view(1, 2 * n)
    try:
        with torch.no_grad():
            got = apply_gate(probe).view(-1)
    except Exception:  # noqa: BLE001 -- a gate that cannot run on the probe is not one of Tabby's
        return None
    return _matching(got, ((act, apply_activation(g, u, act)) for act in _candidates(module)))


def _matching(got: torch.Tensor, candidates) -> Activation | None:
    """The first (activation, its values on the probe) of ``candidates`` whose values ``got`` holds
    (float64, to rounding), or None."""
    for act, want in candidates:
        if got.shape == want.shape and torch.allclose(got.to(torch.float64), want, rtol=1e-9, atol=1e-12):
            return act
    return None


def _ungated_activation(module: nn.Module) -> Activation | None:
    """Which of Tabby's ungated activations the module's ``act_fn`` computes on up x, found as
    ``detect_activation`` finds a gate (a probe from -50 to 50, float64); None if none matches."""
    fn = getattr(module, "act_fn", None)
    if fn is None:
        return None
    u = torch.linspace(-50.0, 50.0, 4001, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = fn(u)
    except Exception:  # noqa: BLE001 -- an act_fn that cannot run on the probe is not one of Tabby's
        return None
    return _matching(got, ((Activation(k), apply_activation(None, u, Activation(k))) for k in UNGATED_KINDS))


def _gate_of(module: nn.Module) -> tuple[Activation | None, str | None]:
    """(the module's activation, None) where its experts run on Tabby, else (None, why not)."""
    gated = getattr(module, "has_gate", True)
    first = "gate_up_proj" if gated else "up_proj"
    if not (hasattr(module, first) and hasattr(module, "down_proj")):
        return None, f"no {first} / down_proj parameters"
    if getattr(module, "has_bias", False) and not gated:
        return None, "ungated experts with biases"
    if getattr(module, "has_bias", False) and not (hasattr(module, "gate_up_proj_bias")
                                                   and hasattr(module, "down_proj_bias")):
        return None, "biases other than gate_up_proj_bias / down_proj_bias"
    act = detect_activation(module)
    if act is None:
        fn = getattr(module, "act_fn", None)
        kinds = ", ".join(k for k in KINDS if (k in UNGATED_KINDS) != gated)
        return None, (f"{'a gate' if gated else 'an ungated activation'} that is none of Tabby's (act_fn "
                      f"{type(fn).__name__ if fn is not None else None}; Tabby's: {kinds})")
    return act, None


def _flags(module: nn.Module) -> tuple:
    return tuple(getattr(module, n, None) for n in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def _gate(module: nn.Module) -> tuple[Activation | None, str | None]:
    """``_gate_of``, found once per module and layout flags (the probe runs once)."""
    cache = module.__dict__.setdefault("_tabby_gate", {})
    key = _flags(module)
    if key not in cache:
        cache[key] = _gate_of(module)
    return cache[key]


def _supported(module: nn.Module) -> str | None:
    """Why the module's experts are not one of Tabby's (None: they are)."""
    return _gate(module)[1]


@torch.compiler.assume_constant_result
def _call_plan(module: nn.Module, config: str) -> str:
    """The module's Tabby call as one string (constant under torch.compile): "!" and why the experts
    fall back, or the operator's config string: ``config`` with the module's activation. Experts that
    run on the path of separate launches only (biases, no gate, transposed weights) take that path:
    an FP8 ``config`` runs them in bf16 where FP8 cannot take them (biases, no gate), with a warning
    (once per experts class), and an explicit ``megakernel=True`` or ``Tuning(bf16_ws=True)`` is
    left to the plan's choice."""
    key = (config, _flags(module))
    cache = module.__dict__.setdefault("_tabby_calls", {})
    if key not in cache:
        act, why = _gate(module)
        if why is not None:
            cache[key] = "!" + why
        else:
            cfg = replace(parse_config(config), activation=act)
            cache[key] = config_string(_separate_launches(module, cfg, act))
    return cache[key]


def _separate_launches(module: nn.Module, cfg: MoEConfig, act: Activation) -> MoEConfig:
    """``cfg`` with what the module's experts cannot take (``plan.separate_launches_conflicts``: biases,
    transposed weights, no gate) replaced by what they can, warned once per experts class."""
    biases, transposed = getattr(module, "has_bias", False), getattr(module, "is_transposed", False)
    conflicts = separate_launches_conflicts(cfg, biases, LAYOUT_KN if transposed else LAYOUT_NK)
    if not conflicts:
        return cfg
    said = {"megakernel": "megakernel=True", "bf16_ws": "Tuning(bf16_ws=True)",
            "precision": f"precision={cfg.precision!r} (bf16 instead)"}
    key = (type(module).__name__, "separate launches")
    if key not in _warned:
        _warned.add(key)
        why = ", ".join(w for w, on in (("biases", biases), ("transposed weights", transposed),
                                        ("no gate", not act.gated)) if on)
        log.warning("tabby experts backend: %s's experts (%s) run on the path of separate launches in bf16; not "
                    "taken: %s", type(module).__name__, why, ", ".join(said[f] for f in conflicts))
    tuning = replace(cfg.tuning, bf16_ws=conflicts["bf16_ws"]) if "bf16_ws" in conflicts else cfg.tuning
    return replace(cfg, tuning=tuning, **{f: v for f, v in conflicts.items() if f != "bf16_ws"})


def tabby_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"tabby"`` entry of transformers' ``ExpertsInterface``: ``[T, H]`` -> ``[T, H]``."""
    call = _call_plan(self, getattr(self, "tabby_config_string", _config_string))
    if call.startswith("!"):
        why = call[1:]
        from transformers.integrations.moe import grouped_mm_experts_forward

        key = (type(self).__name__, why)
        if key not in _warned:
            _warned.add(key)
            log.warning("tabby experts backend: %s has %s; using transformers' grouped_mm for it",
                        type(self).__name__, why)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    rank, world = getattr(self, "tabby_rank_size", (0, 1))
    E_local = self.down_proj.shape[0]
    idx, weights = skip_invalid_ids(top_k_index, top_k_weights, E_local * world, rank * E_local, E_local)
    w_gate, w_up, w_down, biases = expert_weights(self)
    x = hidden_states if hidden_states.dtype == torch.bfloat16 else hidden_states.to(torch.bfloat16)
    y = layer.moe(x, idx, weights, w_gate, w_up, w_down, group=getattr(self, "tabby_group_name", ""), config=call,
                  biases=biases)
    return y.to(hidden_states.dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def expert_weights(module: nn.Module):
    """(w_gate, w_up [E, I, H], w_down [E, H, I], biases or None) of a transformers experts module for
    ``tabby.moe``: views of its parameters as they lie (no copy; bf16 casts excepted), whatever its
    layout flags: ``gate_up_proj`` [E, 2I, H] or transposed [E, H, 2I] (``is_transposed``, and then
    ``down_proj`` [E, I, H]), gate and up halves concatenated or interleaved (``is_concatenated``);
    ``has_bias``: (gate_up_proj_bias [E, 2I] halved the same way, down_proj_bias [E, H]). Without a gate
    (``has_gate`` false): w_gate None and w_up from ``up_proj`` [E, I, H] (transposed: [E, H, I])."""
    transposed = getattr(module, "is_transposed", False)
    concatenated = getattr(module, "is_concatenated", True)
    if not getattr(module, "has_gate", True):
        up, down = _bf16(module.up_proj), _bf16(module.down_proj)
        if transposed:
            return None, up.transpose(1, 2), down.transpose(1, 2), None
        return None, up, down, None
    gate_up, down = _bf16(module.gate_up_proj), _bf16(module.down_proj)
    if transposed:
        w_gate, w_up = (w.transpose(1, 2) for w in gate_up_halves(gate_up, 2, concatenated))
        w_down = down.transpose(1, 2)
    else:
        w_gate, w_up = gate_up_halves(gate_up, 1, concatenated)
        w_down = down
    biases = None
    if getattr(module, "has_bias", False):
        b_gate, b_up = gate_up_halves(_bf16(module.gate_up_proj_bias), 1, concatenated)
        biases = (b_gate, b_up, _bf16(module.down_proj_bias))
    return w_gate, w_up, w_down, biases


def register(config: MoEConfig | None = None, name: str = NAME) -> None:
    """Add ``name`` ("tabby") to transformers' experts registry (``ExpertsInterface``), so that
    ``experts_implementation="tabby"`` (``from_pretrained``, ``from_config``,
    ``set_experts_implementation``) runs every experts module through Tabby. ``config``: the
    ``tabby.MoEConfig`` of every call (None: the defaults; per module: ``set_config``)."""
    global _config_string
    from transformers.integrations.moe import ExpertsInterface

    _config_string = layer.config_string(config)
    ExpertsInterface.register(name, tabby_experts_forward)


def experts_modules(model: nn.Module):
    """The experts modules of a transformers model: those with ``gate_up_proj`` and ``down_proj``
    parameters that choose their forward through ``experts_implementation`` or that ``attach``
    routed through Tabby."""
    for m in model.modules():
        if _has_expert_weights(m) and (hasattr(m, "has_gate") or m.__dict__.get("_tabby_attached", False)):
            yield m


def _has_expert_weights(m: nn.Module) -> bool:
    first = "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj"
    return isinstance(getattr(m, first, None), nn.Parameter) and isinstance(getattr(m, "down_proj", None),
                                                                            nn.Parameter)


def attach(model: nn.Module) -> nn.Module:
    """Route through Tabby the experts modules that ``experts_implementation`` does not reach: classes
    without ``@use_experts_implementation`` whose forward is their own loop over the experts but
    that keep ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` and a gate ``_apply_gate``
    (Step-3.7's ``Step3p7Experts``); each one's forward becomes ``tabby_experts_forward`` (its
    activation detected as for the others). Returns the model."""
    import types

    for m in model.modules():
        if _has_expert_weights(m) and not hasattr(m, "has_gate") and callable(getattr(m, "_apply_gate", None)):
            m.forward = types.MethodType(tabby_experts_forward, m)
            m._tabby_attached = True
    return model


def set_config(model: nn.Module, config: MoEConfig | None) -> None:
    """Use ``config`` for the Tabby calls of every experts module of ``model``."""
    text = layer.config_string(config)
    for m in experts_modules(model):
        m.tabby_config_string = text


def shard_experts(model: nn.Module, group) -> nn.Module:
    """Expert parallelism through Tabby: every experts module of ``model`` keeps only this rank's
    ``E / W`` experts (``gate_up_proj`` and ``down_proj`` sliced, ``[r E/W, (r+1) E/W)``) and
    passes the router's global expert ids and ``group`` (a process group, or a ``ThreadRank`` of
    simulated ranks) to Tabby. Every rank must hold the same full weights before the call (same
    seed or checkpoint). Returns the model."""
    rank, world = group_rank_size(group)
    name = layer.group_name(group)
    for m in experts_modules(model):
        with torch.no_grad():
            for pname in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                p = getattr(m, pname, None)
                if not isinstance(p, nn.Parameter):
                    continue
                setattr(m, pname, nn.Parameter(local_experts(p.detach(), rank, world).clone(),
                                               requires_grad=p.requires_grad))
        m.tabby_group, m.tabby_group_name, m.tabby_rank_size = group, name, (rank, world)
    return model
