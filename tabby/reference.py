"""The MoE layer in plain PyTorch: the definition of the right answer.

    y[t] = shared(x[t]) + sum_k topk_weights[t, k] * down_e(act(gate_e x[t], up_e x[t])),  e = topk_idx[t, k]

act is ``activation`` (``tabby.Activation``; SwiGLU, silu(g) * u, by default: tabby/activation.py);
the shared expert is SwiGLU.

Forward and backward come from autograd. The computation runs in ``compute_dtype`` (fp32 by
default; pass fp64 for a tighter oracle) and returns ``x.dtype``.

Expert-parallel over ``torch.distributed`` (any backend with ``all_to_all_single``): expert
``e`` lives on rank ``e // E_local``. Rows are processed in one fixed order, expert then source
rank then token then k (the order of docs/design.md), both on one process and across ranks, so the
EP result equals the single-process result on the concatenated tokens bitwise. Every reduction
has a fixed order: k contributions are summed in k order, and no atomics are used (gathers and
scatters are by permutations, whose backward is a permutation too). (The shared expert is
one dense matmul over the rank's tokens: BLAS results depend on the row count, so with a
shared expert EP matches the single process to rounding rather than bitwise.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import SWIGLU, Activation
from .activation import apply as apply_activation
from .validate import MoEDims, MoEInputError, check_group_agrees, check_inputs


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with autograd (the backward sends the gradients back)."""

    @staticmethod
    def forward(ctx, inp, send_splits, recv_splits, group):
        import torch.distributed as dist

        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        out = inp.new_empty((sum(recv_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty((sum(ctx.send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return out, None, None, None


def swiglu_mlp(x, w_gate, w_up, w_down, act: Activation = SWIGLU, biases=None):
    """down(act(gate x, up x)) for x [M, H], w_gate/w_up [I, H], w_down [H, I] (SwiGLU by default:
    down(silu(gate x) * up x)); ``biases`` (b_gate, b_up [I], b_down [H]) added to g, u and the output.
    An ungated activation ("relu2"): w_gate None, down(act(up x))."""
    if w_gate is None:
        return apply_activation(None, x @ w_up.t(), act) @ w_down.t()
    if biases is not None:
        bg, bu, bd = biases
        return apply_activation(x @ w_gate.t() + bg, x @ w_up.t() + bu, act) @ w_down.t() + bd
    if act == SWIGLU:
        return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()
    return apply_activation(x @ w_gate.t(), x @ w_up.t(), act) @ w_down.t()


def expert_segments(xs, counts, w_gate, w_up, w_down, compute_dtype, act: Activation = SWIGLU, biases=None):
    """Run each local expert on its contiguous segment of ``xs`` [sum(counts), H]; returns [rows, H]."""
    outs = []
    H = xs.shape[1]
    for e, rows in enumerate(torch.split(xs, counts)):
        # Empty segments run too (on zero rows): their outputs must stay in the autograd graph, or
        # an EP rank that receives no rows would skip the backward's all_to_all its peers wait in.
        # A fresh allocation per segment: BLAS results must not depend on where a segment starts.
        rows = rows.to(compute_dtype).clone()
        b = None if biases is None else tuple(t[e].to(compute_dtype) for t in biases)
        gate = None if w_gate is None else w_gate[e].to(compute_dtype)
        outs.append(swiglu_mlp(rows, gate, w_up[e].to(compute_dtype), w_down[e].to(compute_dtype), act, b))
    return torch.cat(outs) if outs else xs.new_zeros((0, H), dtype=compute_dtype)


def combine_k(y_rep, topk_weights, compute_dtype):
    """sum_k w[t, k] * y_rep[t, k] in k order; y_rep [T, k, H]."""
    w = topk_weights.to(compute_dtype)
    acc = w[:, 0, None] * y_rep[:, 0]
    for j in range(1, y_rep.shape[1]):
        acc = acc + w[:, j, None] * y_rep[:, j]
    return acc


def _routed(x, topk_idx, topk_weights, w_gate, w_up, w_down, dims: MoEDims, group, compute_dtype, act, biases):
    T, H, k, E_local, W = dims.T, dims.H, dims.k, dims.E_local, dims.world_size
    flat_e = topk_idx.reshape(-1).long()
    # Stable sort: rows ordered by expert, then token, then k (the flat order).
    perm = torch.argsort(flat_e, stable=True)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    x_rep = x[:, None, :].expand(T, k, H).reshape(T * k, H)
    x_send = x_rep[perm]
    e_sorted = flat_e[perm]
    if W == 1:
        counts = torch.bincount(e_sorted, minlength=E_local).tolist()
        ys = expert_segments(x_send, counts, w_gate, w_up, w_down, compute_dtype, act, biases)
        y_back = ys
    else:
        import torch.distributed as dist

        dest = e_sorted // E_local
        send_splits_t = torch.bincount(dest, minlength=W)
        recv_splits_t = torch.empty_like(send_splits_t)
        dist.all_to_all_single(recv_splits_t, send_splits_t, group=group)
        send_splits, recv_splits = send_splits_t.tolist(), recv_splits_t.tolist()
        e_local_send = (e_sorted - dest * E_local).contiguous()
        e_recv = e_local_send.new_empty(sum(recv_splits))
        dist.all_to_all_single(e_recv, e_local_send, recv_splits, send_splits, group=group)
        x_recv = _AllToAll.apply(x_send, send_splits, recv_splits, group)
        # Received rows are source-rank major; a stable sort by local expert gives (expert, src, token, k).
        order = torch.argsort(e_recv, stable=True)
        inv_order = torch.empty_like(order)
        inv_order[order] = torch.arange(order.numel(), device=order.device)
        counts = torch.bincount(e_recv, minlength=E_local).tolist()
        ys = expert_segments(x_recv[order], counts, w_gate, w_up, w_down, compute_dtype, act, biases)
        y_back = _AllToAll.apply(ys[inv_order], recv_splits, send_splits, group)
    y_rep = y_back[inv_perm].view(T, k, H)
    return combine_k(y_rep, topk_weights, compute_dtype)


def moe_reference(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None,
                  compute_dtype=torch.float32, activation: Activation | None = None, biases=None):
    """Reference MoE layer; see the module docstring. Returns y [T, H] in x.dtype.

    ``group``: a ``torch.distributed`` process group for expert parallelism (None: one process).
    ``activation``: the routed experts' (``tabby.Activation``; None: SwiGLU; an ungated one, "relu2",
    with ``w_gate=None``). ``biases``: None or the
    routed experts' (b_gate [E_local, I], b_up [E_local, I], b_down [E_local, H]) of this rank: g + b_gate,
    u + b_up before the activation, b_down added to each expert's output before the router weight.
    """
    act = SWIGLU if activation is None else activation
    if not isinstance(act, Activation):
        raise MoEInputError(f"activation must be a tabby.Activation, got {type(act).__name__}")
    W = 1
    if group is not None:
        import torch.distributed as dist

        W = dist.get_world_size(group)
    if (w_gate is None) == act.gated:
        raise MoEInputError(f"Activation({act.kind!r}) {'needs w_gate' if act.gated else 'is ungated: w_gate must be None'}")
    dims = check_inputs(x, topk_idx, topk_weights, w_up if w_gate is None else w_gate, w_up, w_down, shared,
                        world_size=W, biases=biases)
    if W > 1:
        check_group_agrees(dims, x, group)
    y = _routed(x, topk_idx, topk_weights, w_gate, w_up, w_down, dims, group, compute_dtype, act, biases)
    if shared is not None:
        y = y + swiglu_mlp(x.to(compute_dtype), *(w.to(compute_dtype) for w in shared))
    return y.to(x.dtype)
