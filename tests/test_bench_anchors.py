"""CPU tests of the launcher and the anchors (gloo; no GPU needed)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tabby.reference import moe_reference
from tabby_bench.anchors.torch_a2a import moe_torch_a2a
from tabby_bench.anchors.torch_symm import move_rows, num_chunks, receiver_plan, sender_splits
from tabby_bench.launch import LaunchError, launch
from tabby_bench.shapes import TINY, Shape, make_routing, make_weights


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

def _sum_ranks(rank, world, offset):
    t = torch.tensor([rank + offset], dtype=torch.int64)
    dist.all_reduce(t)
    return rank, world, int(t)


def _raise_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # rank 0 waits in a collective: the launcher must still terminate it


def test_launch_runs_every_rank_and_returns_rank0_result():
    assert launch(_sum_ranks, 10, nprocs=2, cpu=True) == (0, 2, 10 + 11)


def test_launch_propagates_a_child_exception():
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank1, nprocs=2, cpu=True)
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError" in msg and "boom from the second rank" in msg


def test_launch_keeps_multicast_off():
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        assert os.environ.get(k) == v


# ----------------------------------------------------------------------------------------------
# torch-a2a on CPU over gloo vs the reference
# ----------------------------------------------------------------------------------------------

def _inputs(shape, T, E_local, rank, dtype, skew=False):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, shape.H, generator=g).to(dtype)
    idx, tw = make_routing(T, shape.E, shape.k, generator=g)
    if skew:  # every token of every rank to rank 0's first k experts: uneven splits, empty experts
        idx = torch.arange(shape.k).repeat(T, 1)
    (wg, wu, wd), sh = make_weights(shape, E_local, dtype=dtype, generator=g)
    dy = torch.randn(T, shape.H, generator=g).to(dtype)
    leaves = [x, tw, wg, wu, wd, *sh]
    for t in leaves:
        t.requires_grad_(True)
    return (x, idx, tw, wg, wu, wd, sh), leaves, dy


def _a2a_vs_reference(rank, world, dtype, skew):
    shape = Shape("t", 8, 64, 32, 2, I_shared=32)
    args, leaves, dy = _inputs(shape, 48, shape.E // world, rank, dtype, skew)
    group = dist.group.WORLD
    y = moe_torch_a2a(*args, group=group)
    g = torch.autograd.grad(y, leaves, dy, allow_unused=True, materialize_grads=True)
    y_ref = moe_reference(*args, group=group, compute_dtype=torch.float64)
    # Skewed routing leaves rank 1's experts without rows: the reference never touches them.
    g_ref = torch.autograd.grad(y_ref, leaves, dy, allow_unused=True, materialize_grads=True)
    names = ["y", "dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down", "dsg", "dsu", "dsd"]
    errs = [rel(y, y_ref)] + [rel(a, b) if b.norm() > 0 else a.norm().item() for a, b in zip(g, g_ref)]
    return dict(zip(names, errs))


CASES = [(dtype, tol, skew) for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)) for skew in (False, True)]


def _a2a_cases(rank, world):
    return [_a2a_vs_reference(rank, world, dtype, skew) for dtype, _, skew in CASES]


def test_torch_a2a_ep2_matches_reference():
    # every case in one pair of processes (a spawn costs seconds)
    for (dtype, tol, skew), errs in zip(CASES, launch(_a2a_cases, nprocs=2, cpu=True)):
        assert all(v < tol for v in errs.values()), (dtype, skew, errs)


def test_torch_a2a_single_process_matches_reference():
    args, leaves, dy = _inputs(TINY, 40, TINY.E, 0, torch.float32)
    y = moe_torch_a2a(*args)
    y_ref = moe_reference(*args, compute_dtype=torch.float64)
    assert rel(y, y_ref) < 1e-5
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        assert rel(a, b) < 1e-5


# ----------------------------------------------------------------------------------------------
# torch-symm's index plans, with the NVSHMEM exchange emulated
# ----------------------------------------------------------------------------------------------

def _emulate_dispatch(inputs, in_splits, W, G):
    """all_to_all_vdev_2d with major_align=1, as nvshmem_extension.cu does it (empty chunk: 1 pad row)."""
    outs, sos = [], []
    src_off = [torch.cat([torch.zeros(1, dtype=torch.int64), s.cumsum(0)[:-1]]) for s in in_splits]
    for d in range(W):
        rows, splits, offsets, pos = [], [], [], 0
        for g in range(G):
            start = pos
            for s in range(W):
                c = d * G + g
                n = int(in_splits[s][c])
                splits.append(n)
                offsets.append(pos)
                rows.append(inputs[s][int(src_off[s][c]):int(src_off[s][c]) + n])
                pos += n
            if pos == start:  # the op gives an empty chunk one (garbage) row
                rows.append(torch.full((1, inputs[0].shape[1]), float("nan")))
                pos += 1
        outs.append(torch.cat(rows))
        sos.append(torch.tensor([splits, offsets]))
    return outs, sos


def _emulate_combine(bufs, sos, W, G):
    """all_to_all_vdev_2d_offset: chunk (g, s) of every rank d goes back to s, packed in (d, g) order."""
    outs = []
    for s in range(W):
        parts = []
        for d in range(W):
            for g in range(G):
                n, off = int(sos[d][0][g * W + s]), int(sos[d][1][g * W + s])
                parts.append(bufs[d][off:off + n])
        outs.append(torch.cat(parts))
    return outs


@pytest.mark.parametrize("E_local", [6, 32, 40])
@pytest.mark.parametrize("skew", [False, True])
def test_symm_plan_regroups_like_the_reference_order(E_local, skew):
    W, T, k, H = 2, 37, 3, 8
    G = num_chunks(E_local)
    assert E_local % G == 0 and G <= 16
    gen = torch.Generator().manual_seed(E_local)
    xs, idxs, sorted_rows, counts, in_splits = [], [], [], [], []
    for r in range(W):
        x = torch.randn(T, H, generator=gen)
        idx, _ = make_routing(T, E_local * W, k, generator=gen)
        if skew:
            idx = torch.arange(k).repeat(T, 1)  # rank 0's first experts only: empty experts and chunks
        perm = torch.argsort(idx.reshape(-1), stable=True)
        c, s = sender_splits(idx.reshape(-1)[perm], W, E_local, G)
        xs.append(x), idxs.append(idx), sorted_rows.append(x[perm // k]), counts.append(c), in_splits.append(s)
    landed, sos = _emulate_dispatch(sorted_rows, in_splits, W, G)
    R = W * T * k + G
    grouped, plans = [], []
    for d in range(W):
        counts_recv = torch.stack([counts[s].view(W, E_local)[d] for s in range(W)])
        buf = torch.cat([landed[d], torch.zeros(R - landed[d].shape[0], H)])
        grp_to_recv, n, offs = receiver_plan(counts_recv, sos[d][1], G, R)
        xg = torch.full((R, H), float("nan"))
        move_rows(buf, xg, grp_to_recv, n, scatter=False)
        # Expected: for each local expert, each source rank's rows for it, in that rank's sorted order.
        want = []
        for e in range(E_local):
            for s in range(W):
                sel = idxs[s].reshape(-1) == d * E_local + e
                want.append(xs[s][torch.nonzero(sel).flatten() // k])
        want = torch.cat(want)
        assert int(n) == want.shape[0]
        assert torch.equal(xg[:int(n)], want)
        assert offs.tolist() == counts_recv.sum(0).cumsum(0).tolist()
        grouped.append(xg)
        plans.append((grp_to_recv, n))
    # Combine: expert outputs (here 2 * rows) scattered back and exchanged return to their origin.
    back = []
    for d in range(W):
        buf = torch.full((R, H), float("nan"))
        move_rows(2 * grouped[d], buf, *plans[d], scatter=True)
        back.append(buf)
    returned = _emulate_combine(back, sos, W, G)
    for s in range(W):
        assert torch.equal(returned[s], 2 * sorted_rows[s])


def test_num_chunks():
    assert [num_chunks(e) for e in (1, 6, 16, 32, 40, 64, 96, 192, 17)] == [1, 6, 16, 16, 10, 16, 16, 16, 1]
