"""``Experts``: the routed SwiGLU experts of one expert-parallel rank, as an ``nn.Module``."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from ..activation import SWIGLU, Activation
from ..functional import moe as layer
from ..functional.config import MoEConfig
from ..functional.threads import ThreadRank
from ..validate import MoEInputError

LAYOUTS = ("fused", "separate")


def group_rank_size(group) -> tuple[int, int]:
    """(rank, world size) of an expert-parallel group: None (one rank), a ``ThreadRank`` or a
    ``torch.distributed`` process group."""
    if group is None:
        return 0, 1
    if isinstance(group, ThreadRank):
        return group.rank, group.group.world_size
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def skip_invalid_ids(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, first_local: int,
                     num_local: int):
    """Routing slots whose expert id is outside ``[0, num_experts)`` (the sentinels of transformers'
    expert-parallel plan, ``-1`` padding) contribute nothing: their weight becomes 0 and their id a
    local expert of this rank (spread over the local experts by position, so that the wasted rows
    cost no communication and no single expert takes them all). Device ops only, no host sync."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    slot = torch.arange(topk_idx.numel(), device=topk_idx.device, dtype=topk_idx.dtype).view(topk_idx.shape)
    fallback = first_local + slot % num_local
    return torch.where(valid, topk_idx, fallback), topk_weights.masked_fill(~valid, 0)


class Experts(nn.Module):
    """The routed experts of one expert-parallel rank (SwiGLU, or ``activation``): ``forward(x, topk_idx, topk_weights)``
    is ``tabby.moe`` (through the registered operator ``torch.ops.tabby.moe``, so that
    ``torch.compile(fullgraph=True)`` keeps it in one graph).

    Args:
        num_experts_local: experts held by this rank (``E_local``); the layer has
            ``num_experts = E_local * world size`` experts, expert ``e`` on rank ``e // E_local``.
        hidden, intermediate: the model width ``H`` and the expert width ``I``.
        layout: ``"fused"``: transformers' parameters ``gate_up_proj [E_local, 2I, H]`` (gate rows
            first) and ``down_proj [E_local, H, I]`` (the halves go to Tabby as views, no copy; the
            gradient of ``gate_up_proj`` is assembled from the two halves' gradients, one copy);
            ``"separate"``: ``w_gate``, ``w_up [E_local, I, H]`` and ``w_down [E_local, H, I]``.
        group: the expert-parallel group (None: one rank; a ``torch.distributed`` process group; a
            ``tabby.functional.threads.ThreadRank`` for simulated ranks).
        config: ``tabby.MoEConfig`` (None: the defaults).
        skip_invalid: map expert ids outside ``[0, num_experts)`` to weight 0 (see
            ``skip_invalid_ids``); False when the router never makes them (saves two small
            elementwise launches).
        activation: the experts' function between gate/up and down (``tabby.Activation``; None: the
            config's, SwiGLU by default); it becomes the config's ``activation``. An ungated one
            (``"relu2"``) has an up projection only: ``up_proj [E_local, I, H]`` (fused; transformers'
            name) or ``w_up``, beside the down projection.
        bias: biases on both projections (gpt-oss's experts), initialized to zero: fused layout
            ``gate_up_proj_bias [E_local, 2I]`` (gate first) and ``down_proj_bias [E_local, H]``;
            separate: ``b_gate``, ``b_up [E_local, I]``, ``b_down [E_local, H]`` (bf16 on the path of
            separate launches for now: ``tabby.moe``'s ``biases``).
        init_std: parameters initialized from N(0, init_std^2); None: ``1/sqrt(fan_in)`` scaling.
        dtype, device: of the parameters (Tabby computes in bf16; other dtypes are cast per call).

    ``x`` may have leading dimensions (``[..., H]``); ``topk_idx`` and ``topk_weights`` then have the
    same leading dimensions and ``k`` last. The output has ``x``'s shape and dtype.
    """

    def __init__(self, num_experts_local: int, hidden: int, intermediate: int, *, layout: str = "fused",
                 group=None, config: MoEConfig | None = None, skip_invalid: bool = True,
                 activation: Activation | None = None, bias: bool = False, init_std: float | None = 0.02,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if activation is not None:
            if not isinstance(activation, Activation):
                raise MoEInputError(f"Experts(activation={activation!r}): must be a tabby.Activation")
            if config is not None and config.activation not in (SWIGLU, activation):
                raise MoEInputError(f"Experts(activation={activation}) and config.activation={config.activation} "
                                    "differ: give one")
            config = replace(config or MoEConfig(), activation=activation)
        if layout not in LAYOUTS:
            raise MoEInputError(f"Experts(layout={layout!r}): must be one of {LAYOUTS}")
        if num_experts_local < 1 or hidden < 1 or intermediate < 1:
            raise MoEInputError("Experts: num_experts_local, hidden and intermediate must be positive")
        self.num_experts_local, self.hidden, self.intermediate = num_experts_local, hidden, intermediate
        self.layout = layout
        self.group = group
        self.rank, self.world_size = group_rank_size(group)
        self._group_name = layer.group_name(group)  # the operator's string, made once
        self.num_experts = num_experts_local * self.world_size
        self.config = config
        self.skip_invalid = skip_invalid
        self.init_std = init_std
        E, H, I = num_experts_local, hidden, intermediate
        kw = dict(dtype=dtype, device=device)
        self.gated = config is None or config.activation.gated
        if not self.gated:  # ungated experts (relu2): an up projection only (fused: transformers' up_proj)
            if bias:
                raise MoEInputError(f"Experts(activation={config.activation}, bias=True): ungated experts take no "
                                    f"biases for now")
            if layout == "fused":
                self.up_proj = nn.Parameter(torch.empty(E, I, H, **kw))
                self.down_proj = nn.Parameter(torch.empty(E, H, I, **kw))
            else:
                self.w_up = nn.Parameter(torch.empty(E, I, H, **kw))
                self.w_down = nn.Parameter(torch.empty(E, H, I, **kw))
        elif layout == "fused":
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, **kw))
            self.down_proj = nn.Parameter(torch.empty(E, H, I, **kw))
        else:
            self.w_gate = nn.Parameter(torch.empty(E, I, H, **kw))
            self.w_up = nn.Parameter(torch.empty(E, I, H, **kw))
            self.w_down = nn.Parameter(torch.empty(E, H, I, **kw))
        self.bias = bias
        if bias and layout == "fused":
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I, **kw))
            self.down_proj_bias = nn.Parameter(torch.empty(E, H, **kw))
        elif bias:
            self.b_gate = nn.Parameter(torch.empty(E, I, **kw))
            self.b_up = nn.Parameter(torch.empty(E, I, **kw))
            self.b_down = nn.Parameter(torch.empty(E, H, **kw))
        self.reset_parameters()

    @property
    def config(self) -> MoEConfig | None:
        return self._config

    @config.setter
    def config(self, config: MoEConfig | None) -> None:
        self._config_string = layer.config_string(config)  # (validates it)
        self._config = config

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:  # a bias: zeros
                    p.zero_()
                    continue
                std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(p.shape[-1])
                p.normal_(0.0, std)

    def extra_repr(self) -> str:
        act = self.config.activation if self.config is not None else SWIGLU
        return (f"num_experts_local={self.num_experts_local}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, layout={self.layout!r}, activation={act}, bias={self.bias}, "
                f"rank={self.rank}, "
                f"world_size={self.world_size}")

    def weights(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(w_gate, w_up [E_local, I, H], w_down [E_local, H, I]); in the fused layout views of
        ``gate_up_proj`` with equal strides (what Tabby's kernels need), no copy. Ungated: w_gate None."""
        if not self.gated:
            return (None, self.up_proj, self.down_proj) if self.layout == "fused" else (None, self.w_up, self.w_down)
        if self.layout == "separate":
            return self.w_gate, self.w_up, self.w_down
        return (*split_gate_up(self.gate_up_proj), self.down_proj)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(b_gate, b_up [E_local, I], b_down [E_local, H]) or None without biases; in the fused layout
        views of ``gate_up_proj_bias``, no copy."""
        if not self.bias:
            return None
        if self.layout == "separate":
            return self.b_gate, self.b_up, self.b_down
        bg, bu = gate_up_halves(self.gate_up_proj_bias, 1)
        return bg, bu, self.down_proj_bias

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                shared=None) -> torch.Tensor:
        """y = sum_j topk_weights[.., j] * expert_{topk_idx[.., j]}(x) (+ shared(x) when ``shared``
        (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]) is given: the shared expert runs
        inside Tabby's kernel)."""
        shape = x.shape
        H = self.hidden
        x2 = x.reshape(-1, H)
        k = topk_idx.shape[-1]
        idx = topk_idx.reshape(-1, k)
        w = topk_weights.reshape(-1, k)
        if self.skip_invalid:
            idx, w = skip_invalid_ids(idx, w, self.num_experts, self.rank * self.num_experts_local,
                                      self.num_experts_local)
        w_gate, w_up, w_down = self.weights()
        dt = torch.bfloat16
        ws = [t if t is None or t.dtype == dt else t.to(dt) for t in (w_gate, w_up, w_down)]
        if shared is not None:
            shared = tuple(t if t.dtype == dt else t.to(dt) for t in shared)
        xin = x2 if x2.dtype == dt else x2.to(dt)
        biases = self.biases()
        if biases is not None:
            biases = tuple(t if t.dtype == dt else t.to(dt) for t in biases)
        y = layer.moe(xin, idx, w, *ws, shared=shared, group=self._group_name,
                      config=self._config_string, biases=biases)
        return y.to(x.dtype).reshape(shape)


def split_gate_up(gate_up_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves ``[E, I, H]`` of a fused ``gate_up_proj [E, 2I, H]`` (gate rows
    first), as views with equal strides. Through ``unbind`` (rather than two slices) autograd
    assembles the fused gradient with one ``stack`` instead of two zero-filled scatters and a sum."""
    E, I2, H = gate_up_proj.shape
    if I2 % 2:
        raise MoEInputError(f"gate_up_proj must be [E, 2I, H], got {tuple(gate_up_proj.shape)}")
    return gate_up_halves(gate_up_proj, 1)


def gate_up_halves(t: torch.Tensor, dim: int, concatenated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``t`` along ``dim`` (of size 2I): its first and second I entries, or
    (not ``concatenated``: interleaved, gpt-oss's) its even and odd ones; views. Their backward
    (``_GateUpHalves``) hands ``t`` the tensor whose halves the two gradients are, where they are
    (the layer's gradient of gpt-oss's weights, made whole), else assembles one with a ``stack``."""
    return _GateUpHalves.apply(t, dim, concatenated)


def _halves(t: torch.Tensor, dim: int, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[dim] // 2
    if concatenated:
        return t.unflatten(dim, (2, n)).unbind(dim)
    return t.unflatten(dim, (n, 2)).unbind(dim + 1)


class _GateUpHalves(torch.autograd.Function):
    """``gate_up_halves`` with a backward that copies nothing where the two gradients already lie in
    one tensor laid out as ``t`` (each the view ``_halves`` takes of it: the layer's eager backward
    of gpt-oss's interleaved weights writes gate_up_proj's gradient whole), else one ``stack``."""

    @staticmethod
    def forward(ctx, t, dim: int, concatenated: bool):
        ctx.shape, ctx.dim, ctx.concatenated = t.shape, dim, concatenated
        return _halves(t, dim, concatenated)

    @staticmethod
    def backward(ctx, dg, du):  # (both given: autograd materializes an unused half's gradient as zeros)
        dim, concatenated = ctx.dim, ctx.concatenated
        base = dg._base
        if base is not None and du._base is base and base.shape == ctx.shape:
            eg, eu = _halves(base, dim, concatenated)
            if all(a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                   for a, b in ((eg, dg), (eu, du))):
                return base, None, None
        return torch.stack([dg, du], dim if concatenated else dim + 1).flatten(dim, dim + 1), None, None
