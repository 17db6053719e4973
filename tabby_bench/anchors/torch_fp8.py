"""``torch-fp8``: the torch-a2a anchor with FP8 expert GEMMs, as torchao's FP8 MoE training
(``torchao.prototype.moe_training``, rowwise scaling) runs them on Hopper.

Everything is torch-a2a's (routing, host-synced splits, NCCL all_to_all, combine) except the three
expert GEMMs, each a ``torch._scaled_grouped_mm`` with E4M3 operands and power-of-two fp32
scales (saturating casts), ``use_fast_accum=True``, bf16 out:

- forward ``out = A @ W[e]^T``: A per row, W per output row (``[E, N]`` scales over K);
- backward ``dA = dY @ W[e]``: dY per row, W per input column (W transposed, scales over N);
- backward ``dW[e] = dY_e^T @ A_e`` (a grouped GEMM over the rows, groups along its K): dY and A
  per column within each expert's rows.

Each expert's rows are padded to a multiple of 16 (what the FP8 grouped GEMM's group offsets
need), in a buffer sized for the worst case, without a host sync. Unavailable (a clear
``MoEInputError``) without a CUDA sm_90 GPU or without ``torch._scaled_grouped_mm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tabby.validate import MoEInputError

from .torch_a2a import a2a_layer, check_layer_inputs

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP_ALIGN = 16


def unavailable_reason() -> str | None:
    """Why torch-fp8 cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.get_device_capability() != (9, 0):
        return "torch's FP8 rowwise grouped GEMM runs on sm_90 only"
    return None


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """Multiplier 2^floor(log2(448 / amax)): the largest power of two keeping amax within E4M3."""
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.float().clamp_min(1e-12))))


def _cast(t: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    return (t.float() * mult).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _rows(t: torch.Tensor):
    """t [..., M, K] per row (over K) -> (E4M3 of t's shape, contiguous; inverse scales [..., M])."""
    mult = _scale(t.abs().amax(dim=-1, keepdim=True))
    return _cast(t, mult).contiguous(), mult.reciprocal().squeeze(-1)


def _group_cols(t: torch.Tensor, gid: torch.Tensor, E: int):
    """t [M, C] per column within each group of rows (``gid [M]``) -> (E4M3 [M, C], inverse scales [E, C])."""
    amax = torch.zeros(E, t.shape[1], dtype=torch.float32, device=t.device)
    amax.scatter_reduce_(0, gid[:, None].expand(-1, t.shape[1]), t.abs().float(), "amax")
    mult = _scale(amax)
    return _cast(t, mult[gid]), mult.reciprocal()


class _Fp8GroupedLinear(torch.autograd.Function):
    """out [M, N] = A[rows of e] @ W[e]^T per group (``offs`` int32 [E] group ends, multiples of 16;
    ``gid`` [M] each row's group, rows past the last end in the last group and zero)."""

    @staticmethod
    def forward(ctx, a, w, offs, gid):
        qa, sa = _rows(a)
        qw, sw = _rows(w)  # [E, N, K] per output row
        ctx.save_for_backward(a, w, offs, gid)
        return torch._scaled_grouped_mm(qa, qw.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        a, w, offs, gid = ctx.saved_tensors
        E = w.shape[0]
        dy = dy.contiguous()
        qdy, sdy = _rows(dy)
        qwt, swt = _rows(w.transpose(-2, -1))  # [E, K, N] per input column
        da = torch._scaled_grouped_mm(qdy, qwt.transpose(-2, -1), sdy, swt, offs=offs, out_dtype=torch.bfloat16,
                                      use_fast_accum=True)
        qdc, sdc = _group_cols(dy, gid, E)  # [M, N], [E, N]
        qac, sac = _group_cols(a, gid, E)  # [M, K], [E, K]
        dw = torch._scaled_grouped_mm(qdc.t().contiguous(), qac.t().contiguous().t(), sdc.reshape(-1),
                                      sac.reshape(-1), offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
        return da, dw, None, None


def _padded_layout(offs: torch.Tensor, M: int, E: int):
    """Rows grouped by expert (``offs`` int32 [E] ends) -> a layout with each group padded to 16:
    (dest int64 [M] each row's padded position, padded ends int32 [E], gid int64 [M_pad], M_pad)."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    pends = padded.cumsum(0)
    r = torch.arange(M, device=offs.device)
    e = torch.searchsorted(ends, r, right=True).clamp(max=E - 1)
    dest = (pends - padded)[e] + r - (ends - counts)[e]
    # the worst case, no host sync; a multiple of 16 (the row stride of the weight gradient's operands)
    M_pad = (M + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN + GROUP_ALIGN * E
    # the last group runs to the end of the buffer (zero rows): the groups cover it exactly
    pends = torch.cat([pends[:-1], pends.new_full((1,), M_pad)])
    gid = torch.searchsorted(pends, torch.arange(M_pad, device=offs.device), right=True).clamp(max=E - 1)
    return dest, pends.to(torch.int32), gid, M_pad


def grouped_swiglu_fp8(xs, offs, w_gate, w_up, w_down):
    """``torch_a2a.grouped_swiglu`` with the three GEMMs in FP8 (see the module docstring); [M, H] bf16."""
    M, H = xs.shape
    E = w_gate.shape[0]
    dest, pends, gid, M_pad = _padded_layout(offs, M, E)
    xp = xs.new_zeros(M_pad, H).index_copy(0, dest, xs)
    g = _Fp8GroupedLinear.apply(xp, w_gate, pends, gid)
    u = _Fp8GroupedLinear.apply(xp, w_up, pends, gid)
    y = _Fp8GroupedLinear.apply(F.silu(g) * u, w_down, pends, gid)
    return y.index_select(0, dest)


def moe_torch_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """torch-a2a with FP8 expert GEMMs; same contract as :func:`tabby.reference.moe_reference`
    (bf16 on an sm_90 GPU; the shared expert stays bf16)."""
    reason = unavailable_reason()
    if reason is not None:
        raise MoEInputError(f"torch-fp8 {reason}")
    dims = check_layer_inputs("torch-fp8", x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)
    if dims.H % 16 or dims.I % 16:
        raise MoEInputError(f"torch-fp8 needs H and I multiples of 16, got H={dims.H}, I={dims.I}")
    return a2a_layer(grouped_swiglu_fp8, dims, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)
