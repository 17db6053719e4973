"""The routed experts' function between gate/up and down: ``h = act(g, u)``, g = x Wg^T, u = x Wu^T.

``MoEConfig(activation=Activation(...))`` chooses it for the layer; the reference
(``tabby.moe_reference(..., activation=...)``) computes the same function in plain PyTorch. The
kinds, each the experts of real model families (transformers 5.17's names):

    "swiglu"         silu(g) * u                                        (Qwen3-MoE, Mixtral, DeepSeek-V3, ...)
    "swiglu-clamp"   silu(min(g, L)) * clamp(u, -L, L)                  (deepseek_v4, glm5_next, hy_v4)
    "swiglu-clamp-out"  min(silu(g), L) * clamp(u, -L, L)              (step3p7)
    "gpt-oss"        (clamp(u, -L, L) + 1) * gc * sigmoid(alpha gc), gc = min(g, L)   (gpt_oss, minimax_m3_vl)
    "geglu"          gelu_tanh(g) * u, GELU's tanh form                 (gemma4, diffusion_gemma)
    "relu2"          relu(u)^2, no gate (w_gate None)                   (nemotron_h)

L is ``limit``, alpha ``alpha`` (gpt-oss only). "relu2" is ungated (``Activation.gated`` false): its
experts have no gate projection, the layer takes ``w_gate=None`` and runs no gate GEMM. The clamps' gradients are zero where they clip
(``torch.clamp``'s rule: the bound itself passes the gradient). Every kind is one constexpr
variant of the GEMM epilogues (``ops/gemm/activation.py``); "swiglu" compiles to the code it
always had.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .validate import MoEInputError

# A kind's index is the kernels' constexpr code of it (ops/gemm/activation.py's ACT_*).
KINDS = ("swiglu", "swiglu-clamp", "swiglu-clamp-out", "gpt-oss", "geglu", "relu2")
UNGATED_KINDS = ("relu2",)  # kinds without a gate projection
_LIMITED = ("swiglu-clamp", "swiglu-clamp-out", "gpt-oss")


@dataclass(frozen=True)
class Activation:
    """``kind`` one of ``KINDS``; ``limit`` the clamp bound L (> 0; the clamped kinds need it,
    "swiglu" takes none); ``alpha`` gpt-oss's sigmoid scale (> 0; 1.702 in gpt-oss)."""

    kind: str = "swiglu"
    limit: float | None = None
    alpha: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MoEInputError(f"Activation(kind={self.kind!r}): must be one of {KINDS}")
        for name in ("limit", "alpha"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise MoEInputError(f"Activation({name}={v!r}): must be a positive finite number or None")
        if self.kind in _LIMITED and self.limit is None:
            raise MoEInputError(f"Activation(kind={self.kind!r}) needs limit (the clamp bound L)")
        if self.kind in ("swiglu", "geglu", "relu2") and self.limit is not None:
            raise MoEInputError(f"Activation(kind={self.kind!r}) takes no limit: the clamped SwiGLU is kind "
                                "'swiglu-clamp' (clamps on g and u) or 'swiglu-clamp-out' (on silu(g) and u)")
        if (self.kind == "gpt-oss") != (self.alpha is not None):
            raise MoEInputError(f"Activation(kind={self.kind!r}, alpha={self.alpha!r}): alpha is gpt-oss's and "
                                "only its (gpt-oss: 1.702)")
        # Floats as the kernels take them (constexprs: one compiled variant per value).
        if self.limit is not None:
            object.__setattr__(self, "limit", float(self.limit))
        if self.alpha is not None:
            object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def gated(self) -> bool:
        """Whether h depends on a gate projection g (every kind but "relu2")."""
        return self.kind not in UNGATED_KINDS

    @property
    def code(self) -> int:
        return KINDS.index(self.kind)

    def constexprs(self) -> tuple[int, float, float]:
        """(ACT, LIMIT, ALPHA): the epilogues' constexpr arguments (0.0 where unused)."""
        return self.code, self.limit or 0.0, self.alpha or 0.0

    def __str__(self) -> str:
        more = "".join(f", {n}={getattr(self, n)}" for n in ("limit", "alpha") if getattr(self, n) is not None)
        return self.kind + (f"({more[2:]})" if more else "")


SWIGLU = Activation()


def apply(g, u, act: Activation):
    """h = act(g, u) in plain PyTorch (any dtype; autograd gives the gradients, zero where a clamp clips)."""
    import torch
    import torch.nn.functional as F

    if act.kind == "swiglu":
        return F.silu(g) * u
    if act.kind == "geglu":
        return F.gelu(g, approximate="tanh") * u
    if act.kind == "relu2":  # (g unused: None)
        return torch.square(F.relu(u))
    L = act.limit
    uc = torch.clamp(u, -L, L)
    if act.kind == "swiglu-clamp":
        return F.silu(torch.clamp(g, max=L)) * uc
    if act.kind == "swiglu-clamp-out":
        return torch.clamp(F.silu(g), max=L) * uc
    gc = torch.clamp(g, max=L)
    return (uc + 1) * (gc * torch.sigmoid(act.alpha * gc))


def grads(g, u, dh, act: Activation):
    """(dg, du) given dh = dL/dh, by the formulas the kernels' epilogues use (ops/gemm/activation.py
    ``act_grads``, operation for operation in fp32): the FP8 backward's reference reads these."""
    import torch

    if act.kind == "swiglu":
        sg = torch.sigmoid(g)
        return dh * u * sg * (1 + g * (1 - sg)), dh * (g * sg)
    if act.kind == "geglu":
        c2, a = 1.5957691216057308, 0.044715
        s = torch.sigmoid(c2 * (g + a * g * g * g))
        return dh * u * (s + g * s * (1 - s) * c2 * (1 + 3 * a * g * g)), dh * (g * s)
    if act.kind == "relu2":  # (no gate: dg None)
        return None, dh * (2.0 * torch.relu(u))
    L = act.limit
    uc = torch.clamp(u, -L, L)
    u_in = u.abs() <= L
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if act.kind == "swiglu-clamp":
        gc = torch.clamp(g, max=L)
        sg = torch.sigmoid(gc)
        return (torch.where(g <= L, dh * uc * sg * (1 + gc * (1 - sg)), zero),
                torch.where(u_in, dh * (gc * sg), zero))
    if act.kind == "swiglu-clamp-out":
        sg = torch.sigmoid(g)
        silu = g * sg
        return (torch.where(silu <= L, dh * uc * sg * (1 + g * (1 - sg)), zero),
                torch.where(u_in, dh * torch.clamp(silu, max=L), zero))
    gc = torch.clamp(g, max=L)
    sa = torch.sigmoid(act.alpha * gc)
    return (torch.where(g <= L, dh * (uc + 1) * sa * (1 + act.alpha * gc * (1 - sa)), zero),
            torch.where(u_in, dh * (gc * sa), zero))
