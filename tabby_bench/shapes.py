"""The benchmark shapes (docs/design.md) and random inputs for them."""
from __future__ import annotations

import zlib
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

    def describe(self) -> str:
        shared = f", shared expert {self.I_shared}" if self.I_shared else ""
        return f"E={self.E} H={self.H} I={self.I} top-{self.k}{shared}"


SHAPES = {s.name: s for s in [
    Shape("kimi-k2", 384, 7168, 2048, 8),
    Shape("glm-5", 256, 6144, 2048, 8),
    Shape("qwen3.5-397b", 512, 4096, 1024, 10),
    Shape("deepseek-v4-pro", 384, 7168, 3072, 6),
    Shape("qwen3-30b-a3b", 128, 2048, 768, 8),
    Shape("gpt-oss-120b", 128, 2880, 2880, 4),
]}


def rank_share(shape: Shape, ep: int) -> Shape:
    """The experts one rank holds at EP ``ep`` as a shape of its own, "NAME@epN" (E / ep experts):
    at EP1 and T tokens it does one such rank's expert work at T tokens a rank (T k / (E / ep)
    rows an expert), without the exchange, in one GPU's memory."""
    if ep < 1 or shape.E % ep:
        raise ValueError(f"{shape.name}: {shape.E} experts do not split over {ep} ranks")
    return Shape(f"{shape.name}@ep{ep}", shape.E // ep, shape.H, shape.I, shape.k, shape.I_shared)


def shape_named(name: str, known: dict = SHAPES) -> Shape:
    """A shape of ``known`` by name, or "NAME@epN" (:func:`rank_share`). KeyError / ValueError otherwise."""
    base, at, ep = name.partition("@ep")
    if not at:
        return known[name]
    if not ep.isdigit():
        raise ValueError(f"{name!r}: expected NAME@epN with N an integer")
    return rank_share(known[base], int(ep))


# A tiny shape for CPU runs of the layer against the reference.
TINY = Shape("tiny", 8, 64, 32, 2, I_shared=32)


def make_routing(T: int, E: int, k: int, generator=None, device="cpu"):
    """Uniform random top-k routing: distinct expert ids [T, k] int64 and softmax weights [T, k] fp32."""
    logits = torch.randn(T, E, generator=generator, device=device)
    vals, idx = logits.topk(k, dim=1)
    return idx, torch.softmax(vals, dim=1)


def make_weights(shape: Shape, E_local: int, dtype=torch.bfloat16, device="cpu", generator=None, shared=None):
    """Expert weights [E_local, I, H], [E_local, I, H], [E_local, H, I] scaled like nn.Linear init,
    and the shared expert's (or None)."""
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


@dataclass
class Inputs:
    """One rank's layer inputs; x, topk_weights, the weights (and shared) are leaves requiring grad."""

    shape: Shape
    T: int
    ep: int
    x: torch.Tensor  # [T, H]
    topk_idx: torch.Tensor  # [T, k] int64 global expert ids
    topk_weights: torch.Tensor  # [T, k] fp32
    w_gate: torch.Tensor  # [E_local, I, H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [E_local, H, I]
    shared: tuple | None
    dy: torch.Tensor  # [T, H] output gradient for fwd+bwd
    generator: torch.Generator

    def args(self):
        return (self.x, self.topk_idx, self.topk_weights, self.w_gate, self.w_up, self.w_down, self.shared)

    def leaves(self):
        return [self.x, self.topk_weights, *self.weights()]

    def weights(self):
        return [self.w_gate, self.w_up, self.w_down, *(self.shared or ())]


def input_seed(shape: Shape, T: int, ep: int, rank: int) -> int:
    """Deterministic per (shape, T, EP, rank): every implementation sees the same inputs, ranks differ."""
    return (zlib.crc32(f"{shape.name}/{T}/{ep}".encode()) + 1_000_003 * rank) % (2 ** 63)


def make_inputs(shape: Shape, T: int, ep: int, rank: int, device, dtype=torch.bfloat16) -> Inputs:
    """Fresh random inputs (never zeros) for this rank: E_local = E // ep experts, x ~ N(0, 1)."""
    gen = torch.Generator(device=device).manual_seed(input_seed(shape, T, ep, rank))
    x = torch.randn(T, shape.H, generator=gen, device=device).to(dtype)
    idx, tw = make_routing(T, shape.E, shape.k, generator=gen, device=device)
    (wg, wu, wd), sh = make_weights(shape, shape.E // ep, dtype=dtype, device=device, generator=gen)
    dy = torch.randn(T, shape.H, generator=gen, device=device).to(dtype)
    inp = Inputs(shape, T, ep, x, idx, tw, wg, wu, wd, sh, dy, gen)
    for t in inp.leaves():
        t.requires_grad_(True)
    return inp


def flops(shape: Shape, T: int, pass_: str) -> float:
    """MoE-layer FLOPs per GPU: 6*T*k*H*I (+ 6*T*H*I_shared) forward, 3x that forward+backward."""
    f = 6.0 * T * shape.k * shape.H * shape.I + 6.0 * T * shape.H * shape.I_shared
    return f * (3 if pass_ == "fwd+bwd" else 1)
