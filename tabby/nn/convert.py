"""Expert weights to and from the layouts of transformers and torchtitan, for any EP rank and size.

Layouts (every weight in ``nn.Linear`` order, out x in):

* Tabby (``tabby.moe``, ``Experts(layout="separate")``): ``w_gate``, ``w_up [E, I, H]``,
  ``w_down [E, H, I]``.
* transformers 5.x (``Experts(layout="fused")`` too): ``gate_up_proj [E, 2I, H]``, the gate's rows
  first (``gate_up_proj[:, :I]`` is the gate), and ``down_proj [E, H, I]``.
* gpt-oss (transformers' ``GptOssExperts``; the OpenAI privacy filter's with ``interleaved=False``):
  ``gate_up_proj [E, H, 2I]`` transposed, the gate at even columns (privacy filter: the first I),
  ``down_proj [E, I, H]`` transposed, ``gate_up_proj_bias [E, 2I]`` (the same halves) and
  ``down_proj_bias [E, H]``. ``tabby.moe`` reads them in place (``validate.weights_layout``); the
  converters make Tabby's layout once (its faster GEMMs), with the biases.
* torchtitan 0.3.0 (``torchtitan/models/common/moe.py``, ``GroupedExperts``): ``w1_EFD [E, F, D]``
  (gate), ``w3_EFD [E, F, D]`` (up), ``w2_EDF [E, D, F]`` (down), ``D = H``, ``F = I``; older
  releases name them ``w1``, ``w3``, ``w2`` (read too).

Expert parallelism: rank ``r`` of ``W`` holds experts ``[r * E / W, (r + 1) * E / W)``, as
``tabby.moe`` expects (expert ``e`` on rank ``e // E_local``). ``*_to_tabby`` take the full tensors
(or a rank's slice with ``world_size=1``) and return the slice of ``rank``; ``gather`` joins the
slices of every rank back into full tensors. Results are contiguous copies unless said otherwise.
"""
from __future__ import annotations

import torch

from ..validate import MoEInputError

TABBY_KEYS = ("w_gate", "w_up", "w_down")
TRANSFORMERS_KEYS = ("gate_up_proj", "down_proj")
TORCHTITAN_KEYS = ("w1_EFD", "w3_EFD", "w2_EDF")  # gate, up, down
_TORCHTITAN_OLD_KEYS = ("w1", "w3", "w2")


def local_experts(t: torch.Tensor, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """Rows ``[rank * E / W, (rank + 1) * E / W)`` of dimension 0 (a view)."""
    E = t.shape[0]
    if world_size < 1 or not 0 <= rank < world_size:
        raise MoEInputError(f"rank {rank} is not in [0, world_size={world_size})")
    if E % world_size:
        raise MoEInputError(f"{E} experts do not split evenly over {world_size} ranks")
    n = E // world_size
    return t[rank * n:(rank + 1) * n]


def split_gate_up(gate_up_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) ``[E, I, H]`` of transformers' ``gate_up_proj [E, 2I, H]`` (views)."""
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise MoEInputError(f"gate_up_proj must be [E, 2I, H], got {tuple(gate_up_proj.shape)}")
    I = gate_up_proj.shape[1] // 2
    return gate_up_proj[:, :I], gate_up_proj[:, I:]


def fuse_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """transformers' ``gate_up_proj [E, 2I, H]`` from ``w_gate``, ``w_up [E, I, H]``."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 3:
        raise MoEInputError(f"w_gate and w_up must both be [E, I, H], got {tuple(w_gate.shape)} and "
                            f"{tuple(w_up.shape)}")
    return torch.cat([w_gate, w_up], dim=1)


def _pick(state: dict, keys, what: str):
    missing = [k for k in keys if k not in state]
    if missing:
        raise MoEInputError(f"{what}: missing {missing} (has {sorted(state)})")
    return [state[k] for k in keys]


def transformers_to_tabby(state: dict, rank: int = 0, world_size: int = 1, layout: str = "separate") -> dict:
    """``{"gate_up_proj", "down_proj"}`` (transformers, all experts) -> rank ``rank``'s experts in
    Tabby's ``layout``: "separate" (``w_gate``, ``w_up``, ``w_down``) or "fused" (transformers'
    keys, the rank's slice), loadable into ``tabby.nn.Experts`` of that layout."""
    gate_up, down = _pick(state, TRANSFORMERS_KEYS, "transformers experts")
    gate_up, down = local_experts(gate_up, rank, world_size), local_experts(down, rank, world_size)
    if layout == "fused":
        return {"gate_up_proj": gate_up.contiguous(), "down_proj": down.contiguous()}
    gate, up = split_gate_up(gate_up)
    return {"w_gate": gate.contiguous(), "w_up": up.contiguous(), "w_down": down.contiguous()}


def tabby_to_transformers(state: dict) -> dict:
    """Tabby's experts (either layout) -> ``{"gate_up_proj", "down_proj"}`` of the same experts."""
    if "gate_up_proj" in state:
        return {"gate_up_proj": state["gate_up_proj"].contiguous(), "down_proj": state["down_proj"].contiguous()}
    gate, up, down = _pick(state, TABBY_KEYS, "Tabby experts")
    return {"gate_up_proj": fuse_gate_up(gate, up), "down_proj": down.contiguous()}


def torchtitan_to_tabby(state: dict, rank: int = 0, world_size: int = 1, layout: str = "separate") -> dict:
    """torchtitan's ``GroupedExperts`` weights (``w1_EFD``, ``w3_EFD``, ``w2_EDF``, or the older
    ``w1``, ``w3``, ``w2``; all experts) -> rank ``rank``'s experts in Tabby's ``layout``."""
    keys = TORCHTITAN_KEYS if TORCHTITAN_KEYS[0] in state else _TORCHTITAN_OLD_KEYS
    gate, up, down = (local_experts(t, rank, world_size) for t in _pick(state, keys, "torchtitan experts"))
    if layout == "fused":
        return {"gate_up_proj": fuse_gate_up(gate, up), "down_proj": down.contiguous()}
    return {"w_gate": gate.contiguous(), "w_up": up.contiguous(), "w_down": down.contiguous()}


GPT_OSS_KEYS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
TABBY_BIAS_KEYS = ("b_gate", "b_up", "b_down")


def gpt_oss_to_tabby(state: dict, rank: int = 0, world_size: int = 1, layout: str = "separate",
                     interleaved: bool = True) -> dict:
    """gpt-oss's experts (``GPT_OSS_KEYS``, all experts; ``interleaved``: g and u alternate along 2I, as
    gpt-oss stores them, else the gate's I first, as the privacy filter does) -> rank ``rank``'s experts
    in Tabby's ``layout`` with their biases: "separate" (``w_gate``, ``w_up``, ``w_down``, ``b_gate``,
    ``b_up``, ``b_down``) or "fused" (transformers' Tabby-layout keys ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, ``gate_up_proj_bias [E, 2I]`` gate first, ``down_proj_bias``), loadable
    into ``tabby.nn.Experts(bias=True)`` of that layout."""
    gate_up, down, b_gate_up, b_down = (local_experts(t, rank, world_size)
                                        for t in _pick(state, GPT_OSS_KEYS, "gpt-oss experts"))
    E, H, I2 = gate_up.shape
    if I2 % 2 or tuple(down.shape) != (E, I2 // 2, H):
        raise MoEInputError(f"gpt-oss experts: gate_up_proj must be [E, H, 2I] and down_proj [E, I, H], got "
                            f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    I = I2 // 2
    halves = (lambda t: (t[..., 0::2], t[..., 1::2])) if interleaved else (lambda t: (t[..., :I], t[..., I:]))
    gate, up = (h.transpose(1, 2).contiguous() for h in halves(gate_up))
    bg, bu = (h.contiguous() for h in halves(b_gate_up))
    w_down = down.transpose(1, 2).contiguous()
    if layout == "fused":
        return {"gate_up_proj": fuse_gate_up(gate, up), "down_proj": w_down,
                "gate_up_proj_bias": torch.cat([bg, bu], dim=1), "down_proj_bias": b_down.contiguous()}
    return {"w_gate": gate, "w_up": up, "w_down": w_down, "b_gate": bg, "b_up": bu, "b_down": b_down.contiguous()}


def tabby_to_gpt_oss(state: dict, interleaved: bool = True) -> dict:
    """Tabby's experts with biases (either layout of ``gpt_oss_to_tabby``) -> gpt-oss's ``GPT_OSS_KEYS``."""
    if "gate_up_proj" in state:
        gate, up = split_gate_up(state["gate_up_proj"])
        bg, bu = state["gate_up_proj_bias"].chunk(2, dim=1)
        down, b_down = state["down_proj"], state["down_proj_bias"]
    else:
        gate, up, down = _pick(state, TABBY_KEYS, "Tabby experts")
        bg, bu, b_down = _pick(state, TABBY_BIAS_KEYS, "Tabby experts' biases")
    pair = (lambda a, b: torch.stack([a, b], dim=-1).flatten(-2)) if interleaved else (
        lambda a, b: torch.cat([a, b], dim=-1))
    return {"gate_up_proj": pair(gate.transpose(1, 2), up.transpose(1, 2)).contiguous(),
            "down_proj": down.transpose(1, 2).contiguous(), "gate_up_proj_bias": pair(bg, bu).contiguous(),
            "down_proj_bias": b_down.contiguous()}


def tabby_to_torchtitan(state: dict, old_names: bool = False) -> dict:
    """Tabby's experts (either layout) -> torchtitan's ``{"w1_EFD", "w3_EFD", "w2_EDF"}``
    (``old_names``: ``w1``, ``w3``, ``w2``)."""
    if "gate_up_proj" in state:
        gate, up = split_gate_up(state["gate_up_proj"])
        down = state["down_proj"]
    else:
        gate, up, down = _pick(state, TABBY_KEYS, "Tabby experts")
    keys = _TORCHTITAN_OLD_KEYS if old_names else TORCHTITAN_KEYS
    return dict(zip(keys, (gate.contiguous(), up.contiguous(), down.contiguous())))


def gather(shards: list[dict]) -> dict:
    """The slices of every rank (rank order; any one layout's keys) joined into all experts."""
    if not shards:
        raise MoEInputError("gather: no shards")
    keys = list(shards[0])
    for r, s in enumerate(shards):
        if list(s) != keys:
            raise MoEInputError(f"gather: rank {r} has keys {sorted(s)}, rank 0 {sorted(keys)}")
    return {k: torch.cat([s[k] for s in shards], dim=0) for k in keys}
