"""``torch-a2a``: the plain PyTorch expert-parallel MoE layer that most users run.

Per rank, forward:

1. sort the T*k (token, k) rows by global expert (stable argsort) and gather them;
2. exchange per-expert row counts (``all_to_all_single``) and copy them to the host
   (``.tolist()``: the host-synced splits);
3. NCCL ``all_to_all_single`` of the rows (an autograd Function: the backward sends the gradients
   back), received in (source rank, expert) order, regrouped locally to (expert, source rank);
4. ``torch._grouped_mm`` for gate and up, ``silu(gate) * up``, ``torch._grouped_mm`` for down;
5. the reverse regroup and ``all_to_all_single`` back, then ``sum_k topk_weights * y`` with an fp32
   ``index_add`` (not deterministic on CUDA: it is an anchor), plus the shared expert by plain matmuls.

Autograd provides the backward everywhere. Also home of the pieces the other anchors, the floor
and the benchmark's reference check share: :func:`grouped_swiglu`, :func:`shared_swiglu`,
:func:`route_plan` and :func:`combine_sorted`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tabby.validate import MoEInputError, check_inputs


def group_size(group) -> int:
    """World size of ``group`` (1 for None: a single process)."""
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def check_layer_inputs(name, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group):
    """Shape/dtype checks without the host sync of the expert-id range; bf16 on CUDA (``_grouped_mm``)."""
    W = group_size(group)
    dims = check_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, world_size=W, check_ids=False)
    if x.is_cuda and x.dtype != torch.bfloat16:
        raise MoEInputError(f"{name} uses torch._grouped_mm, which needs bfloat16 on CUDA; x has {x.dtype}")
    return dims


def grouped_swiglu(xs, offs, w_gate, w_up, w_down):
    """SwiGLU experts over rows grouped by expert.

    xs [M, H]; offs int32 [E_local], the end row of each expert's group (rows past offs[-1] are
    ignored and their outputs left undefined); w_gate, w_up [E_local, I, H]; w_down [E_local, H, I].
    Returns [M, H] in xs.dtype.
    """
    g = torch._grouped_mm(xs, w_gate.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)


def shared_swiglu(x, shared):
    """The shared expert on x [T, H] with (w_gate_s [I_s, H], w_up_s [I_s, H], w_down_s [H, I_s]); [T, H]."""
    sg, su, sd = shared
    return (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()


def combine_sorted(y_sorted, tok, w_sorted, T):
    """y[t] = sum over rows r of token t of w_sorted[r] * y_sorted[r], in fp32; [T, H] fp32.

    y_sorted [T*k, H] (any float dtype), tok int64 [T*k] the token of each row, w_sorted [T*k] fp32.
    """
    contrib = y_sorted.float() * w_sorted[:, None]
    return torch.zeros(T, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device).index_add(0, tok, contrib)


def sort_rows(topk_idx):
    """Sort the flat (token, k) rows by expert: perm int64 [T*k] (stable) and the token of each row."""
    k = topk_idx.shape[1]
    perm = torch.argsort(topk_idx.reshape(-1), stable=True)
    return perm, perm // k


def expert_offsets(flat_e_local, E_local):
    """int32 [E_local] end row of each expert, from the local expert id of every row (no host sync)."""
    counts = torch.zeros(E_local, dtype=torch.int64, device=flat_e_local.device)
    counts.scatter_add_(0, flat_e_local, torch.ones_like(flat_e_local))
    return counts.cumsum(0).to(torch.int32)


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows [N, H] with host splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        import torch.distributed as dist

        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty((sum(ctx.send_splits), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(rows, send_splits, recv_splits, group):
    """Exchange rows [sum(send_splits), H] -> [sum(recv_splits), H], with autograd."""
    return _AllToAllRows.apply(rows, send_splits, recv_splits, group)


@dataclass
class RoutePlan:
    """Where every (token, k) row goes and how the received rows are grouped (host-synced splits).

    perm, tok: int64 [T*k] rows sorted by global expert and their tokens (the send order).
    send_splits, recv_splits: rows to / from each rank (host lists).
    counts: host list [W][E_local], rows from source rank s for local expert e.
    grp_from_recv: int64 [M] gather index, received (source, expert) order -> (expert, source)
    order; None when no regroup is needed (one rank). recv_from_grp: its inverse.
    offs: int32 [E_local] end row of each local expert in the grouped order.
    """

    perm: torch.Tensor
    tok: torch.Tensor
    send_splits: list
    recv_splits: list
    counts: list
    grp_from_recv: torch.Tensor | None
    recv_from_grp: torch.Tensor | None
    offs: torch.Tensor

    @property
    def rows_received(self) -> int:
        return sum(self.recv_splits)


def route_plan(topk_idx, E_local: int, group) -> RoutePlan:
    """Exchange counts and build the :class:`RoutePlan` (one host sync; collective over ``group``)."""
    W = group_size(group)
    perm, tok = sort_rows(topk_idx)
    flat_sorted = topk_idx.reshape(-1)[perm].long()
    dev = topk_idx.device
    E = E_local * W
    sent = torch.zeros(E, dtype=torch.int64, device=dev)
    sent.scatter_add_(0, flat_sorted, torch.ones_like(flat_sorted))
    if W == 1:
        counts = [sent.tolist()]
        n = sum(counts[0])
        return RoutePlan(perm, tok, [n], [n], counts, None, None, sent.cumsum(0).to(torch.int32))
    import torch.distributed as dist

    recv = torch.empty_like(sent)  # [W * E_local]: rows from source s for my local expert e
    dist.all_to_all_single(recv, sent, group=group)
    host = torch.cat([sent.view(W, E_local).sum(1), recv]).tolist()  # the one host sync
    send_splits, flat_counts = host[:W], host[W:]
    counts = [flat_counts[s * E_local:(s + 1) * E_local] for s in range(W)]
    recv_splits = [sum(c) for c in counts]
    M = sum(recv_splits)
    L = recv.view(W, E_local)
    recv_start = (L.reshape(-1).cumsum(0) - L.reshape(-1)).view(W, E_local)  # segment (s, e) in received order
    Lt = L.t().reshape(-1)  # lengths in grouped order (e, s)
    grp_end = Lt.cumsum(0)
    seg = torch.repeat_interleave(torch.arange(E_local * W, device=dev), Lt, output_size=M)
    e_of, s_of = seg // W, seg % W
    grp_from_recv = recv_start[s_of, e_of] + torch.arange(M, device=dev) - (grp_end - Lt)[seg]
    recv_from_grp = torch.empty_like(grp_from_recv)
    recv_from_grp[grp_from_recv] = torch.arange(M, device=dev)
    offs = L.sum(0).cumsum(0).to(torch.int32)
    return RoutePlan(perm, tok, send_splits, recv_splits, counts, grp_from_recv, recv_from_grp, offs)


def dispatch_rows(rows_sorted, plan: RoutePlan, group):
    """Send rows in send order [T*k, ...] to the experts' ranks; returns them grouped by local expert."""
    if plan.grp_from_recv is None:
        return rows_sorted
    recv = all_to_all_rows(rows_sorted, plan.send_splits, plan.recv_splits, group)
    return recv[plan.grp_from_recv]


def return_rows(rows_grouped, plan: RoutePlan, group):
    """Inverse of :func:`dispatch_rows`: rows grouped by expert back to their origin, in send order."""
    if plan.grp_from_recv is None:
        return rows_grouped
    return all_to_all_rows(rows_grouped[plan.recv_from_grp], plan.recv_splits, plan.send_splits, group)


def moe_torch_a2a(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """The plain PyTorch EP layer; same contract as :func:`tabby.reference.moe_reference`.

    x [T, H] bf16 (any float on CPU), topk_idx [T, k] global expert ids, topk_weights [T, k] fp32,
    w_gate/w_up [E_local, I, H], w_down [E_local, H, I], shared optional. Returns y [T, H] in
    x.dtype, differentiable in every input. With ``group`` of more than one rank it synchronizes
    with the host once (the splits) and is a collective over ``group``.
    """
    dims = check_layer_inputs("torch-a2a", x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)
    return a2a_layer(grouped_swiglu, dims, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)


def a2a_layer(experts, dims, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group):
    """The all-to-all layer around ``experts(rows, offsets, w_gate, w_up, w_down)`` (the grouped
    SwiGLU of rows sorted by expert): route, dispatch, experts, return, combine, shared expert.
    ``dims``: the checked inputs' sizes (``check_layer_inputs``)."""
    T, E_local = dims.T, dims.E_local
    if dims.world_size == 1:
        # One rank: sorted rows are already grouped; offsets stay on the device.
        perm, tok = sort_rows(topk_idx)
        offs = expert_offsets(topk_idx.reshape(-1)[perm].long(), E_local)
        y_sorted = experts(x[tok], offs, w_gate, w_up, w_down)
    else:
        plan = route_plan(topk_idx, E_local, group)
        perm, tok = plan.perm, plan.tok
        xg = dispatch_rows(x[tok], plan, group)
        y_sorted = return_rows(experts(xg, plan.offs, w_gate, w_up, w_down), plan, group)
    y = combine_sorted(y_sorted, tok, topk_weights.reshape(-1)[perm].float(), T)
    if shared is not None:
        y = y + shared_swiglu(x, shared).float()
    return y.to(x.dtype)
