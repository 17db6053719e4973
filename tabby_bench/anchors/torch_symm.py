"""``torch-symm``: the sync-free PyTorch-native EP layer over NVSHMEM symmetric memory.

This is the path torchtitan takes for token dispatch without host synchronization:
``torch.ops.symm_mem.all_to_all_vdev_2d`` sends rows sorted by (destination rank, local expert)
and lands them expert-major (local expert, then source rank) on the receiver, with the split
sizes read on the device; ``torch.ops.symm_mem.all_to_all_vdev_2d_offset`` is its reverse (the
combine), driven by the splits and offsets the dispatch produced. Each direction's backward is
the other op. Expert math is ``torch._grouped_mm`` like ``torch-a2a``; no count ever reaches the
host, so every buffer is sized for the worst case (all tokens of all ranks to one rank: dropless).

The ops' contract (PyTorch's ``nvshmem_extension.cu``, the same from 2.8 to 2.13):

    all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name, major_align)
        input [N, ...]: rows ordered (dest rank, local expert) with in_splits int64 [W*ne];
        out: rows ordered (local expert e, source rank s); out_splits_offsets int64 [2, ne*W]
        gets, at column e*W + s, the split and the row offset (expert starts aligned up to
        major_align; an empty expert still takes major_align rows). Needs ne <= 16, W <= 32.
    all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name)
        the reverse: chunks of input at the given (e*W + s) splits/offsets go back to rank s,
        landing packed in (source rank, expert) order. Needs ne <= 32, W <= 16.

All tensors passed to them are symmetric (``symm_mem.empty``), the same shape on every rank.

Many experts per rank: the ops take at most 16 "experts" per rank, and our shapes have 16 to
384. So the 2-D exchange runs over G <= 16 chunks of consecutive local experts; a chunk from a
source holds its rows sorted by expert, and a small Triton kernel regroups the received rows into
(expert, source) order (and scatters results back), reading the row count from the device. The
per-expert counts the regroup needs come from one equal-split ``all_to_all_single`` of the count
matrix, which is on the device too. With G == E_local the regroup is the identity on real rows.

Buffers: allocated once per (group, rows, hidden, dtype, chunks) and cached; the combine's output
is returned as a view of a cached buffer, valid until the next call (the layer's own backward
consumes it in time). :func:`release_buffers` drops the cache (call it on every rank at once:
freeing NVSHMEM memory is collective).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import launch as _launch  # noqa: F401  (keeps NVLS off before NVSHMEM initializes)
from .torch_a2a import (check_layer_inputs, combine_sorted, expert_offsets, grouped_swiglu,
                        shared_swiglu, sort_rows)

MAX_CHUNKS = 16  # all_to_all_vdev_2d: experts per rank <= NUM_TILES = 512 threads / 32


def num_chunks(E_local: int) -> int:
    """Largest divisor of E_local that is at most 16: the 2-D exchange's 'experts' per rank."""
    return max(d for d in range(1, min(E_local, MAX_CHUNKS) + 1) if E_local % d == 0)


# ----------------------------------------------------------------------------------------------
# Symmetric buffers
# ----------------------------------------------------------------------------------------------

@dataclass
class _Buffers:
    group_name: str
    tok_rows: torch.Tensor  # [T*k, H] token side: dispatch input / combine output
    tok_rows2: torch.Tensor  # [T*k, H] second token-side buffer (forward and backward overlap)
    exp_rows: torch.Tensor  # [R, H] expert side: dispatch output / combine input
    exp_rows2: torch.Tensor  # [R, H]
    in_splits: torch.Tensor  # int64 [W*G]
    so_disp: torch.Tensor  # int64 [2, G*W] splits/offsets of the forward dispatch (kept for backward)
    so_comb: torch.Tensor  # int64 [2, W*G] scratch output of the combines
    so_bwd: torch.Tensor  # int64 [2, G*W] scratch output of the backward dispatch


_CACHE: dict = {}
_backend_ready = False


def release_buffers() -> None:
    """Drop the cached symmetric buffers (collectively: call on every rank at the same point)."""
    _CACHE.clear()


def _ensure_nvshmem(device) -> None:
    global _backend_ready
    if _backend_ready:
        return
    import torch.distributed._symmetric_memory as symm_mem

    if not torch.cuda.is_available() or device.type != "cuda":
        raise RuntimeError("torch-symm needs CUDA tensors (NVSHMEM symmetric memory); got device " + str(device))
    if not symm_mem.is_nvshmem_available():
        raise RuntimeError("torch-symm needs NVSHMEM, but torch.distributed._symmetric_memory.is_nvshmem_available() "
                           "is False (PyTorch built without NVSHMEM, or libnvshmem_host.so.3 not found)")
    current = None
    if hasattr(symm_mem, "get_backend"):
        try:
            current = symm_mem.get_backend(device)
        except Exception:  # noqa: BLE001 -- older builds raise before any allocation
            current = None
    if current != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"torch-symm needs the NVSHMEM symmetric-memory backend but could not select it (current backend: "
                f"{current}): {e}. The backend is fixed once a symmetric tensor exists in the process; run torch-symm "
                "in a process of its own (tabby bench does so when it spawns its workers)") from e
    _backend_ready = True


def _buffers(group, rows_tok: int, rows_exp: int, H: int, dtype, G: int, device) -> _Buffers:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    key = (name, rows_tok, rows_exp, H, dtype, G, str(device))
    bufs = _CACHE.get(key)
    if bufs is not None:
        return bufs
    _ensure_nvshmem(device)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():  # required before 2.9; deprecated (a no-op) later
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    W = dist.get_world_size(group)

    def alloc(*shape, dt=dtype):
        try:
            t = symm_mem.empty(*shape, dtype=dt, device=device)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"torch-symm: allocating a symmetric buffer {tuple(shape)} {dt} failed: {e} "
                               "(NVSHMEM_SYMMETRIC_SIZE may be too small)") from e
        symm_mem.rendezvous(t, name)
        return t

    bufs = _Buffers(name, alloc(rows_tok, H), alloc(rows_tok, H), alloc(rows_exp, H), alloc(rows_exp, H),
                    alloc(W * G, dt=torch.int64), alloc(2, W * G, dt=torch.int64), alloc(2, W * G, dt=torch.int64),
                    alloc(2, W * G, dt=torch.int64))
    dist.barrier(group=group, device_ids=[device.index])  # every peer's buffers exist before anyone reads them
    _CACHE[key] = bufs
    return bufs


# ----------------------------------------------------------------------------------------------
# Moving rows with a device-side row count
# ----------------------------------------------------------------------------------------------

_kernel = None


def _row_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def move_rows(src, dst, idx, n_ptr, H, src_stride, dst_stride, SCATTER: tl.constexpr,
                      BLOCK: tl.constexpr):
            # Program i moves one row if i < n (n read on the device): gather dst[i] = src[idx[i]]
            # or scatter dst[idx[i]] = src[i].
            i = tl.program_id(0).to(tl.int64)
            n = tl.load(n_ptr)
            if i < n:
                j = tl.load(idx + i)
                if SCATTER:
                    s_row = i
                    d_row = j
                else:
                    s_row = j
                    d_row = i
                for h in range(0, H, BLOCK):
                    cols = h + tl.arange(0, BLOCK)
                    m = cols < H
                    v = tl.load(src + s_row * src_stride + cols, mask=m)
                    tl.store(dst + d_row * dst_stride + cols, v, mask=m)

        _kernel = move_rows
    return _kernel


def move_rows(src, dst, idx, n, scatter: bool) -> None:
    """For i < n: dst[i] = src[idx[i]] (gather) or dst[idx[i]] = src[i] (scatter).

    src, dst [*, H] row-contiguous; idx int64 [>= n]; n int64 [1] on the device (no host sync on
    CUDA; the CPU fallback reads it).
    """
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("move_rows needs rows with unit column stride")
    if not src.is_cuda:
        m = int(n.reshape(-1)[0])
        if scatter:
            dst[idx[:m]] = src[:m]
        else:
            dst[:m] = src[idx[:m]]
        return
    rows = dst.shape[0] if not scatter else src.shape[0]
    H = src.shape[1]
    block = min(1024, 1 << (H - 1).bit_length())
    _row_kernel()[(rows,)](src, dst, idx, n, H, src.stride(0), dst.stride(0), SCATTER=scatter, BLOCK=block,
                           num_warps=4)


# ----------------------------------------------------------------------------------------------
# Plans: pure functions of the routing, testable on the CPU with an emulated exchange
# ----------------------------------------------------------------------------------------------

def sender_splits(flat_sorted, W: int, E_local: int, G: int):
    """Per-expert row counts int64 [W*E_local] and the 2-D exchange's in_splits int64 [W*G]."""
    counts = torch.zeros(W * E_local, dtype=torch.int64, device=flat_sorted.device)
    counts.scatter_add_(0, flat_sorted, torch.ones_like(flat_sorted))
    return counts, counts.view(W * G, E_local // G).sum(1)


def receiver_plan(counts_recv, chunk_offsets, G: int, R: int):
    """Regroup map from the dispatch's landing layout to (expert, source rank) order.

    counts_recv int64 [W, E_local]: rows source s sends to my local expert e. chunk_offsets int64
    [G*W]: where chunk (g, s) starts in the landing buffer (row 1 of the dispatch's
    out_splits_offsets). R: rows of the landing buffer. Returns (grp_to_recv int64 [R], valid for
    the first n entries; n int64 [1]; offs int32 [E_local] expert ends in grouped order).
    """
    W, E_local = counts_recv.shape
    dev = counts_recv.device
    per_chunk = counts_recv.view(W, G, E_local // G)
    within = per_chunk.cumsum(2) - per_chunk  # start of expert j inside its chunk (s, g)
    recv_start = (chunk_offsets.view(G, W).t()[:, :, None] + within).reshape(W, E_local)
    L = counts_recv.t().reshape(-1)  # segment lengths in grouped order (e, s)
    grp_end = L.cumsum(0)
    i = torch.arange(R, device=dev)
    seg = torch.searchsorted(grp_end, i, right=True).clamp_(max=E_local * W - 1)
    grp_to_recv = recv_start[seg % W, seg // W] + i - (grp_end - L)[seg]
    offs = counts_recv.sum(0).cumsum(0).to(torch.int32)
    return grp_to_recv, grp_end[-1:], offs


@dataclass
class _Plan:
    bufs: _Buffers
    T: int
    tok: torch.Tensor  # int64 [T*k]
    grp_to_recv: torch.Tensor | None = None
    n: torch.Tensor | None = None
    offs: torch.Tensor | None = None


def _a2a_2d(inp, out, in_splits, so, name):
    torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, so, name, major_align=1)


def _a2a_2d_offset(inp, out, in_so, so, name):
    torch.ops.symm_mem.all_to_all_vdev_2d_offset(inp, out, in_so, so, name)


class _Dispatch(torch.autograd.Function):
    """x [T, H] -> rows grouped by local expert [R, H] (first n valid). Backward: the combine op."""

    @staticmethod
    def forward(ctx, x, plan: _Plan, counts_recv, G: int):
        b = plan.bufs
        torch.index_select(x, 0, plan.tok, out=b.tok_rows)
        _a2a_2d(b.tok_rows, b.exp_rows, b.in_splits, b.so_disp, b.group_name)
        plan.grp_to_recv, plan.n, plan.offs = receiver_plan(counts_recv, b.so_disp[1], G, b.exp_rows.shape[0])
        xg = torch.empty_like(b.exp_rows)
        move_rows(b.exp_rows, xg, plan.grp_to_recv, plan.n, scatter=False)
        ctx.plan, ctx.x_dtype = plan, x.dtype
        return xg

    @staticmethod
    def backward(ctx, g):
        p, b = ctx.plan, ctx.plan.bufs
        move_rows(g.contiguous(), b.exp_rows2, p.grp_to_recv, p.n, scatter=True)
        _a2a_2d_offset(b.exp_rows2, b.tok_rows2, b.so_disp, b.so_comb, b.group_name)
        gx = torch.zeros(p.T, g.shape[1], dtype=torch.float32, device=g.device)
        gx.index_add_(0, p.tok, b.tok_rows2.float())
        return gx.to(ctx.x_dtype), None, None, None


class _Combine(torch.autograd.Function):
    """Expert outputs grouped [R, H] -> rows back at their origin in send order [T*k, H]."""

    @staticmethod
    def forward(ctx, yg, plan: _Plan):
        b = plan.bufs
        move_rows(yg.contiguous(), b.exp_rows2, plan.grp_to_recv, plan.n, scatter=True)
        _a2a_2d_offset(b.exp_rows2, b.tok_rows2, b.so_disp, b.so_comb, b.group_name)
        ctx.plan = plan
        return b.tok_rows2.detach()  # a view of the buffer: consumed before the next call writes it

    @staticmethod
    def backward(ctx, g):
        p, b = ctx.plan, ctx.plan.bufs
        b.tok_rows.copy_(g)
        # Same in_splits as the forward dispatch, so the rows land where the forward's did.
        _a2a_2d(b.tok_rows, b.exp_rows, b.in_splits, b.so_bwd, b.group_name)
        gg = torch.empty_like(b.exp_rows)
        move_rows(b.exp_rows, gg, p.grp_to_recv, p.n, scatter=False)
        return gg, None


def moe_torch_symm(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None, group=None):
    """Sync-free PyTorch EP layer over NVSHMEM; same contract as :func:`tabby.reference.moe_reference`.

    x [T, H] bf16 on CUDA; topk_idx [T, k]; topk_weights [T, k] fp32; w_gate/w_up [E_local, I, H];
    w_down [E_local, H, I]; shared optional. Returns y [T, H] bf16, differentiable in every input.
    Every rank must pass the same T (buffers are symmetric). With one rank (``group`` None or of
    size 1) there is nothing to exchange and it runs the local sync-free path. Raises
    RuntimeError with the reason when NVSHMEM or its ops are unusable.
    """
    dims = check_layer_inputs("torch-symm", x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)
    T, k, H, E_local, W = dims.T, dims.k, dims.H, dims.E_local, dims.world_size
    perm, tok = sort_rows(topk_idx)
    flat_sorted = topk_idx.reshape(-1)[perm].long()
    w_sorted = topk_weights.reshape(-1)[perm].float()
    if W == 1:
        y_sorted = grouped_swiglu(x[tok], expert_offsets(flat_sorted, E_local), w_gate, w_up, w_down)
    else:
        import torch.distributed as dist

        if W > 16:
            raise RuntimeError(f"torch-symm: all_to_all_vdev_2d_offset supports at most 16 ranks, group has {W}")
        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d_offset"):
            raise RuntimeError("torch-symm: this PyTorch has no torch.ops.symm_mem.all_to_all_vdev_2d_offset")
        G = num_chunks(E_local)
        R = W * T * k + G  # worst case: every row of every rank, plus one pad row per empty chunk
        bufs = _buffers(group, T * k, R, H, x.dtype, G, x.device)
        counts, in_splits = sender_splits(flat_sorted, W, E_local, G)
        bufs.in_splits.copy_(in_splits)
        counts_recv = torch.empty_like(counts)
        dist.all_to_all_single(counts_recv, counts, group=group)  # equal splits: stays on the device
        plan = _Plan(bufs, T, tok)
        xg = _Dispatch.apply(x, plan, counts_recv.view(W, E_local), G)
        y_sorted = _Combine.apply(grouped_swiglu(xg, plan.offs, w_gate, w_up, w_down), plan)
    y = combine_sorted(y_sorted, tok, w_sorted, T)
    if shared is not None:
        y = y + shared_swiglu(x, shared).float()
    return y.to(x.dtype)
