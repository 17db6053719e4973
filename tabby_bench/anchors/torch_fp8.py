"""``torch-fp8``: the torch-a2a anchor with FP8 expert GEMMs, as torchao's FP8 MoE training
(``torchao.prototype.moe_training``, rowwise scaling) runs them on Hopper.

Everything is torch-a2a's (routing, host-synced splits, NCCL all_to_all, combine) except the three
expert GEMMs, each a ``torch._scaled_grouped_mm`` with E4M3 operands and power-of-two fp32
scales (saturating casts), ``use_fast_accum=True``, bf16 out:

- forward ``out = A @ W[e]^T``: A per row, W per output row (``[E, N]`` scales over K);
- backward ``dA = dY @ W[e]``: dY per row, W per input column (W transposed, scales over N);
- backward ``dW[e] = dY_e^T @ A_e`` (a grouped GEMM over the rows, groups along its K): dY and A
  per column within each expert's rows.

Quantization is fused, as in torchao (its Triton kernels for the weights and the per-group
scales, ``torch.compile`` for the rest): each quantizer (:func:`quantize_rows`,
:func:`quantize_group_cols_t`) is plain PyTorch, run through ``torch.compile``: inductor fuses the
amax into one kernel and the scaling and cast into another, which read the bf16 operand and write
E4M3 and the scales with no fp32 copy of it (the per-group amax's scatter, over 16-row blocks,
stays an aten op); one static compilation per operand shape, made at the first call with that shape.
Where compiling fails the quantizers run eagerly (same bits, unfused, with fp32 temporaries of
each operand) and :func:`quantize_mode` says why; ``TABBY_BENCH_FP8_QUANTIZE=eager`` asks for that.

Weights are quantized on every call (forward: W per row; backward: W per column), as torchao's
dynamic scaling does; the bench gives every FP8 row that policy (``tabby_bench/impls.py``).
Each GEMM quantizes its own A (x twice, for gate and for up), as torchtitan's experts call
torchao's grouped GEMM once per weight.

Each expert's rows are padded to a multiple of 16 (what the FP8 grouped GEMM's group offsets
need), in a buffer sized for the worst case, without a host sync. Unavailable (a clear
``MoEInputError``) without a CUDA sm_90 GPU or without ``torch._scaled_grouped_mm``.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from tabby.validate import MoEInputError

from .torch_a2a import a2a_layer, check_layer_inputs

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP_ALIGN = 16
AMAX_FLOOR = 1e-12  # a row or column of zeros takes this amax (its values quantize to zero at any scale)
QUANTIZE_ENV = "TABBY_BENCH_FP8_QUANTIZE"  # "compiled" (default) or "eager"
# static compilations per quantizer: one per operand shape (a few per bench shape and token count)
RECOMPILE_LIMIT = 256


def unavailable_reason() -> str | None:
    """Why torch-fp8 cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.get_device_capability() != (9, 0):
        return "torch's FP8 rowwise grouped GEMM runs on sm_90 only"
    return None


def pow2_scales(amax: torch.Tensor):
    """(multiplier 2^-j, inverse scale 2^j), fp32, for amax >= 0: j the smallest integer with
    ``amax <= 448 * 2^j`` (amax floored at 1e-12), so the scaled amax lands in (224, 448].

    From the bits (``amax = 1.m * 2^e`` and ``448 = 1.75 * 2^8``: ``j = e - 8``, plus one when
    ``1.m > 1.75``), so eager and compiled code give the same bits (no log2 or exp2 to round)."""
    bits = amax.float().clamp_min(AMAX_FLOOR).view(torch.int32)
    j = ((bits >> 23) & 0xFF) - (127 + 8) + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return ((127 - j) << 23).view(torch.float32), ((127 + j) << 23).view(torch.float32)


def _cast(t: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """E4M3 of ``t * mult`` (exact: mult is a power of two), one rounding, saturating."""
    return (t.float() * mult).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(t: torch.Tensor):
    """t [..., K] per row (over its last dim) -> (E4M3 of t's shape, contiguous; inverse scales [...]).

    A transposed view gives its transpose quantized per row, written contiguous: ``quantize_rows(
    w.transpose(-2, -1))`` is W per input column."""
    mult, inv = pow2_scales(t.abs().amax(dim=-1))
    return _cast(t, mult[..., None]).contiguous(), inv


def quantize_group_cols_t(t: torch.Tensor, gid: torch.Tensor, E: int):
    """t [M, C] per column within each group of rows -> (E4M3 [C, M], t's quantization transposed,
    contiguous: the weight-gradient GEMM's operand; inverse scales [E, C]).

    ``gid`` int64 [M]: each row's group. M and every group's first row are multiples of 16 (the
    padded layout), so each block of 16 rows lies in one group: the column amax of each block,
    then the blocks' maximum per group."""
    M, C = t.shape
    block_amax = t.reshape(M // GROUP_ALIGN, GROUP_ALIGN, C).abs().amax(dim=1).float()
    amax = block_amax.new_zeros(E, C).scatter_reduce_(0, gid[::GROUP_ALIGN, None].expand(-1, C), block_amax, "amax")
    mult, inv = pow2_scales(amax)
    return _cast(t, mult[gid]).t().contiguous(), inv


_compiled: dict = {}
_eager_reason: list = []  # why the quantizers run eagerly (set once), or empty


def quantize_mode() -> str:
    """How the quantizers have run in this process: "fused (torch.compile)", or "eager: <why>"."""
    if not _eager_reason and os.environ.get(QUANTIZE_ENV, "compiled") == "eager":
        return f"eager: {QUANTIZE_ENV}=eager"
    return f"eager: {_eager_reason[0]}" if _eager_reason else "fused (torch.compile)"


def fused(fn, *args):
    """``fn(*args)`` through ``torch.compile`` (static shapes, one graph); eagerly where that fails
    (the reason kept for :func:`quantize_mode` and warned once) or where TABBY_BENCH_FP8_QUANTIZE is
    "eager". Out-of-memory errors propagate: they are the operand's, not the compiler's."""
    mode = os.environ.get(QUANTIZE_ENV, "compiled")
    if mode not in ("compiled", "eager"):
        raise MoEInputError(f"{QUANTIZE_ENV} must be 'compiled' or 'eager', got {mode!r}")
    if mode == "compiled" and not _eager_reason:
        try:
            import torch._dynamo

            compiled = _compiled.get(fn)
            if compiled is None:
                compiled = _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 -- the eager quantizer is the same definition
            _eager_reason.append(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
            warnings.warn(f"torch-fp8: quantizing eagerly (unfused): {_eager_reason[0]}", RuntimeWarning, stacklevel=2)
    return fn(*args)


class _Fp8GroupedLinear(torch.autograd.Function):
    """out [M, N] = A[rows of e] @ W[e]^T per group (``offs`` int32 [E] group ends, multiples of 16;
    ``gid`` [M] each row's group, rows past the last end in the last group and zero)."""

    @staticmethod
    def forward(ctx, a, w, offs, gid):
        qa, sa = fused(quantize_rows, a)
        qw, sw = fused(quantize_rows, w)  # [E, N, K] per output row
        ctx.save_for_backward(a, w, offs, gid)
        return torch._scaled_grouped_mm(qa, qw.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        a, w, offs, gid = ctx.saved_tensors
        E = w.shape[0]
        dy = dy.contiguous()
        qdy, sdy = fused(quantize_rows, dy)
        qwt, swt = fused(quantize_rows, w.transpose(-2, -1))  # [E, K, N] per input column
        da = torch._scaled_grouped_mm(qdy, qwt.transpose(-2, -1), sdy, swt, offs=offs, out_dtype=torch.bfloat16,
                                      use_fast_accum=True)
        del qdy, qwt
        qdc_t, sdc = fused(quantize_group_cols_t, dy, gid, E)  # [N, M], [E, N]
        qac_t, sac = fused(quantize_group_cols_t, a, gid, E)  # [K, M], [E, K]
        dw = torch._scaled_grouped_mm(qdc_t, qac_t.t(), sdc.reshape(-1), sac.reshape(-1), offs=offs,
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
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


def fp8_a2a_layer(name: str, reason: str | None, grouped, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                  group):
    """torch-a2a with ``grouped`` (an FP8 ``grouped_swiglu``) for the experts, after the FP8 rows'
    checks: ``reason`` (why ``name`` cannot run here, or None), H and I multiples of 16."""
    if reason is not None:
        raise MoEInputError(f"{name} {reason}")
    dims = check_layer_inputs(name, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)
    if dims.H % 16 or dims.I % 16:
        raise MoEInputError(f"{name} needs H and I multiples of 16, got H={dims.H}, I={dims.I}")
    return a2a_layer(grouped, dims, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)


def moe_torch_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """torch-a2a with FP8 expert GEMMs; same contract as :func:`tabby.reference.moe_reference`
    (bf16 on an sm_90 GPU; the shared expert stays bf16)."""
    return fp8_a2a_layer("torch-fp8", unavailable_reason(), grouped_swiglu_fp8, x, topk_idx, topk_weights, w_gate,
                         w_up, w_down, shared, group)
