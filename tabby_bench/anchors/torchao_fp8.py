"""``torchao-fp8``: the torch-a2a anchor with torchao's FP8 MoE training GEMM for the three expert
GEMMs, as a PyTorch user on Hopper sets it up: ``torchao.prototype.moe_training`` (torchao 0.17,
whose ``Float8TrainingOpConfig`` swaps a model's ``torch._grouped_mm`` for this function) with
rowwise E4M3 scaling, power-of-two scales, its own Triton quantization kernels, and its autograd
(each GEMM quantizes its operands again in the backward, the weight gradient's per group).

Everything else is torch-a2a's (routing, host-synced splits, NCCL all_to_all, combine) and
torch-fp8's (each expert's rows padded to the 16 the FP8 grouped GEMM needs, in a worst-case
buffer, no host sync). Weights are quantized on every call, as torchao's dynamic scaling does.

torchao is not a dependency: the row runs where ``torchao`` imports (the pure-Python wheel of
torchao 0.17.0 imports with torch 2.11; ``pip install torchao==0.17.0``), else it is unavailable
with the import's error as the reason.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .torch_fp8 import _padded_layout, fp8_a2a_layer
from .torch_fp8 import unavailable_reason as _torch_fp8_unavailable


def _grouped_mm():
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm


def unavailable_reason() -> str | None:
    """Why torchao-fp8 cannot run here, or None."""
    reason = _torch_fp8_unavailable()
    if reason is not None:
        return reason
    try:
        _grouped_mm()
    except Exception as e:  # noqa: BLE001 -- any import failure is the reason
        return f"torchao's FP8 grouped GEMM does not import: {type(e).__name__}: {e}"
    return None


def torchao_version() -> str:
    try:
        import torchao
    except Exception:  # noqa: BLE001 -- the row's note: unavailable
        return "not importable"
    return getattr(torchao, "__version__", "?")


def grouped_swiglu_torchao(xs, offs, w_gate, w_up, w_down):
    """``torch_a2a.grouped_swiglu`` with torchao's FP8 grouped GEMM for the three products; [M, H] bf16."""
    M, H = xs.shape
    E = w_gate.shape[0]
    dest, pends, _, M_pad = _padded_layout(offs, M, E)
    xp = xs.new_zeros(M_pad, H).index_copy(0, dest, xs)
    mm = _grouped_mm()

    def linear(a, w):  # a @ w[e]^T; torchao takes B_t [E, K, N] column-major per group: w's transpose
        return mm(a, w.transpose(-2, -1), pends, torch.bfloat16, pad_token_groups_for_grouped_mm=False)

    g, u = linear(xp, w_gate), linear(xp, w_up)
    y = linear(F.silu(g) * u, w_down)
    return y.index_select(0, dest)


def moe_torchao_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """torch-a2a with torchao's FP8 expert GEMMs; same contract as :func:`tabby.reference.moe_reference`
    (bf16 on an sm_90 GPU with torchao; the shared expert stays bf16)."""
    return fp8_a2a_layer("torchao-fp8", unavailable_reason(), grouped_swiglu_torchao, x, topk_idx, topk_weights,
                         w_gate, w_up, w_down, shared, group)
