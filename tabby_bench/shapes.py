"""The benchmark shapes of DESIGN.md and random inputs for them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    E: int  # experts in the whole model
    H: int  # hidden size
    I: int  # expert intermediate size
    k: int  # experts per token
    I_shared: int = 0  # shared-expert intermediate size (0: none)


SHAPES = {s.name: s for s in [
    Shape("kimi-k2", 384, 7168, 2048, 8),
    Shape("glm-5", 256, 6144, 2048, 8),
    Shape("qwen3.5-397b", 512, 4096, 1024, 10),
    Shape("deepseek-v4-pro", 384, 7168, 3072, 6),
    Shape("qwen3-30b-a3b", 128, 2048, 768, 8),
    Shape("gpt-oss-120b", 128, 2880, 2880, 4),
]}

# A tiny shape for CPU runs of the layer against the reference.
TINY = Shape("tiny", 8, 64, 32, 2, I_shared=32)


def make_routing(T: int, E: int, k: int, generator=None, device="cpu"):
    """Uniform random top-k routing: distinct expert ids [T, k] int64 and softmax weights [T, k] fp32."""
    logits = torch.randn(T, E, generator=generator, device=device)
    vals, idx = logits.topk(k, dim=1)
    return idx, torch.softmax(vals, dim=1)


def make_weights(shape: Shape, E_local: int, dtype=torch.bfloat16, device="cpu", generator=None, shared=None):
    """Expert weights [E_local, I, H], [E_local, I, H], [E_local, H, I] scaled like nn.Linear init."""
    H, I = shape.H, shape.I

    def w(*size, fan_in):
        return (torch.randn(*size, generator=generator, device=device) / fan_in ** 0.5).to(dtype)

    ws = (w(E_local, I, H, fan_in=H), w(E_local, I, H, fan_in=H), w(E_local, H, I, fan_in=I))
    if shared is None:
        shared = shape.I_shared > 0
    sh = None
    if shared and shape.I_shared > 0:
        Is = shape.I_shared
        sh = (w(Is, H, fan_in=H), w(Is, H, fan_in=H), w(H, Is, fan_in=Is))
    return ws, sh
