"""The routed-row schedule (tabby/ops/schedule.py) against its PyTorch reference, bit for bit."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tabby.ops.schedule import (  # noqa: E402
    alloc_schedule,
    launch_schedule,
    schedule_capacity,
    schedule_grids,
    schedule_reference,
)
from tabby.ops.sync import ERR_BAD_EXPERT_ID, ERR_WORDS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUTPUTS = ("row_src", "tile_expert", "expert_start", "expert_count", "src_count", "num_tiles")


def _ptrs(idx_list, device):
    return torch.tensor([t.data_ptr() for t in idx_list], dtype=torch.int64, device=device)


def _run(all_idx, rank, E_local, BM, bufs=None, chunk=None, inverse=True, err=None, align=1):
    """Run the kernels on ``all_idx`` [W, T, k] (each rank's slice a separate contiguous buffer)."""
    W, T, k = all_idx.shape
    idx_list = [all_idx[s].contiguous().clone().to(DEVICE) for s in range(W)]
    if bufs is None:
        bufs = alloc_schedule(W, T, k, E_local, BM, DEVICE, chunk=chunk, inverse=inverse, align=align)
    if err is None:
        err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=DEVICE)
    launch_schedule(bufs, _ptrs(idx_list, DEVICE), err, rank)
    return bufs, err


def _check(bufs, all_idx, rank, E_local, BM):
    ref = schedule_reference(all_idx, rank, E_local, BM, R_max=bufs.R_max, align=bufs.ALIGN_TILES)
    out = bufs.outputs()
    names = OUTPUTS + (("row_of_src",) if bufs.row_of_src is not None else ())
    for name in names:
        got = out[name].cpu()
        assert got.dtype == torch.int32, name
        assert got.shape == ref[name].shape, name
        if not torch.equal(got, ref[name]):
            bad = (got != ref[name]).nonzero()[:8].flatten().tolist()
            raise AssertionError(f"{name} differs at {bad}: got {got.flatten()[bad].tolist()}, "
                                 f"want {ref[name].flatten()[bad].tolist()}")
    return ref


def _random_idx(W, T, k, E, gen, distinct=True):
    """Random routing [W, T, k] over E global experts; distinct experts per token when possible."""
    if distinct and k <= E:
        scores = torch.rand(W, T, E, generator=gen)
        return scores.topk(k, dim=-1).indices.to(torch.int32)
    return torch.randint(0, E, (W, T, k), generator=gen, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------
# Reference self-checks (cheap, independent of the kernels)


def test_reference_structure():
    gen = torch.Generator().manual_seed(1)
    W, T, k, E_local, BM, rank = 3, 29, 4, 5, 8, 2
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    ref = schedule_reference(all_idx, rank, E_local, BM)
    R_max = schedule_capacity(W, T, k, E_local, BM)
    assert R_max % BM == 0 and R_max >= W * T * k + E_local * (BM - 1)
    flat = all_idx.reshape(-1).long()
    start, count = ref["expert_start"].long(), ref["expert_count"].long()
    for e in range(E_local):
        want = (flat == rank * E_local + e).nonzero().flatten()
        seg = ref["row_src"][start[e]:start[e + 1]].long()
        assert torch.equal(seg[:count[e]], want)  # (src, t, kk) order
        assert (seg[count[e]:] == -1).all() and (start[e + 1] - start[e]) % BM == 0
        assert start[e + 1] - start[e] < count[e] + BM
        assert ref["src_count"][e].sum() == count[e]
        assert (ref["tile_expert"][start[e] // BM:start[e + 1] // BM] == e).all()
    assert (ref["row_src"][start[-1]:] == -1).all()
    assert (ref["tile_expert"][ref["num_tiles"][0]:] == -1).all()
    served = ref["row_of_src"]
    assert torch.equal(ref["row_src"][served[served >= 0].long()].long(), (served >= 0).nonzero().flatten())


# ------------------------------------------------------------------------------------------------
# Kernels == reference


_ROUTING_CASES = [
    (37, 3, 5, 16, 16),     # odd T, several chunks, N not a multiple of the chunk
    (37, 1, 3, 4, 32),      # k = 1
    (64, 8, 4, 16, None),   # default chunk (one chunk per rank)
    (50, 2, 33, 2, 16),     # E_local not a power of two, > 32 (E_PAD 64)
    (600, 4, 40, 16, 16),   # 150 chunks per rank: the scan takes two steps of 128 chunks (E_PAD 64)
]


# the 600-token case on one rank only: its two-step scan is the point, and at W = 2 and 4 the
# interpreter takes 23 and 43 s there for what the other cases cover
@pytest.mark.parametrize("W,T,k,E_local,BM,chunk", [(W, *c) for W in (1, 2, 4) for c in _ROUTING_CASES
                                                    if W == 1 or c[0] != 600])
def test_random_routing(W, T, k, E_local, BM, chunk):
    gen = torch.Generator().manual_seed(100 * W + T + k)
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    for rank in sorted({0, W - 1}):
        bufs, err = _run(all_idx, rank, E_local, BM, chunk=chunk)
        _check(bufs, all_idx, rank, E_local, BM)
        assert (err.cpu() == 0).all()


@pytest.mark.parametrize("align", [2, 3])
def test_aligned_segments(align):
    """align > 1: every expert's segment is a multiple of align tiles, its padding-only tiles are
    marked unused (-1) like the tiles past the end, and the real rows are those of align = 1."""
    gen = torch.Generator().manual_seed(11 + align)
    W, T, k, E_local, BM, rank = 2, 45, 3, 7, 8, 1
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    all_idx[0, :5, 0] = rank * E_local + 3  # one expert with more rows than the others
    bufs, err = _run(all_idx, rank, E_local, BM, chunk=32, align=align)
    ref = _check(bufs, all_idx, rank, E_local, BM)
    assert (err.cpu() == 0).all()
    plain = schedule_reference(all_idx, rank, E_local, BM)
    start, count = ref["expert_start"].long(), ref["expert_count"].long()
    assert torch.equal(count, plain["expert_count"])
    assert bufs.R_max >= schedule_capacity(W, T, k, E_local, BM) + E_local * (align - 1) * BM
    phantom = 0
    for e in range(E_local):
        seg = ref["row_src"][start[e]:start[e + 1]].long()
        p0 = plain["expert_start"][e].long()
        assert torch.equal(seg[:count[e]], plain["row_src"][p0:p0 + count[e]].long())
        assert (seg[count[e]:] == -1).all() and (start[e + 1] - start[e]) % (align * BM) == 0
        tiles = ref["tile_expert"][start[e] // BM:start[e + 1] // BM]
        used = -(-int(count[e]) // BM)
        assert (tiles[:used] == e).all() and (tiles[used:] == -1).all()
        phantom += tiles.numel() - used
    assert phantom > 0  # the case exercises padding tiles
    assert ref["num_tiles"].item() == start[-1].item() // BM


@pytest.mark.parametrize("W,rank,align,BM", [(1, 0, 1, 8), (2, 0, 1, 8), (2, 1, 2, 8), (3, 1, 1, 4), (3, 2, 2, 16),
                                             (4, 1, 1, 8)])
def test_token_pull_order_and_row_weights(W, rank, align, BM):
    """``order=True``: tile_order lists the tiles with rows from this rank only (or none) first, then
    the others, each in tile order, and local_tiles counts the first; ``row_w``: each real row's router
    weight from its source rank's table. Mixed tiles, padding tiles, a rank in the middle (other ranks'
    rows on both sides of its own in an expert), an expert with most rows, an empty expert."""
    gen = torch.Generator().manual_seed(31 * W + rank + align)
    T, k, E_local = 45, 3, 5
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    all_idx[:, :20, 0] = rank * E_local + 1  # a big expert on this rank, rows from every rank
    all_idx[all_idx == rank * E_local + 4] = (rank * E_local + 5) % (W * E_local)  # an empty expert
    w_all = torch.rand(W, T, k, generator=gen)
    w_list = [w_all[s].contiguous().to(DEVICE) for s in range(W)]
    idx_list = [all_idx[s].contiguous().clone().to(DEVICE) for s in range(W)]
    bufs = alloc_schedule(W, T, k, E_local, BM, DEVICE, chunk=32, align=align, order=True)
    row_w = torch.full((bufs.R_max,), -7.0, device=DEVICE)
    err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=DEVICE)
    launch_schedule(bufs, _ptrs(idx_list, DEVICE), err, rank, row_w=(_ptrs(w_list, DEVICE), row_w))
    ref = _check(bufs, all_idx, rank, E_local, BM)
    nt = ref["num_tiles"].item()
    assert torch.equal(bufs.tile_order.cpu()[:nt], ref["tile_order"][:nt])
    assert bufs.local_tiles.item() == ref["local_tiles"].item()
    assert sorted(ref["tile_order"][:nt].tolist()) == list(range(nt))  # a permutation of the tiles
    if W > 1:
        assert 0 < ref["local_tiles"].item() < nt  # both classes present
    rs = ref["row_src"].long()
    real = rs >= 0
    assert torch.equal(row_w.cpu()[real], w_all.reshape(-1)[rs[real]])
    assert (err.cpu() == 0).all()


def test_empty_experts_and_remote_only():
    """Some local experts get nothing; a rank whose experts get nothing at all."""
    gen = torch.Generator().manual_seed(7)
    W, T, k, E_local, BM = 2, 41, 3, 6, 8
    # Only even global experts, never expert 2 of rank 0 (global 2) nor any of rank 1's.
    choices = torch.tensor([0, 4], dtype=torch.int32)
    all_idx = choices[torch.randint(0, 2, (W, T, k), generator=gen)]
    bufs, _ = _run(all_idx, 0, E_local, BM, chunk=32)
    ref = _check(bufs, all_idx, 0, E_local, BM)
    assert (ref["expert_count"] == 0).sum() == 4
    bufs, _ = _run(all_idx, 1, E_local, BM, chunk=32)
    ref = _check(bufs, all_idx, 1, E_local, BM)
    assert ref["num_tiles"].item() == 0 and (bufs.row_src.cpu() == -1).all()
    assert (bufs.tile_expert.cpu() == -1).all()


@pytest.mark.parametrize("W,rank,align", [(1, 0, 1), (2, 1, 1), (4, 2, 1), (2, 1, 2), (4, 2, 3)])
def test_everything_to_one_expert(W, rank, align):
    """Every (token, k) of every rank routed to one expert: the worst case fills the capacity
    (with align > 1 the expert's segment rounds up to align tiles and still fits)."""
    T, k, E_local, BM = 37, 4, 3, 16
    all_idx = torch.full((W, T, k), rank * E_local + 2, dtype=torch.int32)
    bufs, _ = _run(all_idx, rank, E_local, BM, chunk=64, align=align)
    ref = _check(bufs, all_idx, rank, E_local, BM)
    assert ref["expert_count"][2].item() == W * T * k
    assert ref["expert_start"][-1].item() == -(-W * T * k // (BM * align)) * BM * align <= bufs.R_max


def test_reuse_buffers_no_stale_rows():
    """The same buffers across calls with different routings (no memset in between)."""
    gen = torch.Generator().manual_seed(3)
    W, T, k, E_local, BM, rank = 2, 37, 3, 4, 16, 1
    bufs = alloc_schedule(W, T, k, E_local, BM, DEVICE, chunk=32, inverse=True)
    for buf in (bufs.row_src, bufs.tile_expert, bufs.row_of_src, bufs.counts, bufs.within, bufs.expert_count):
        buf.fill_(12345)  # garbage, as torch.empty may give
    routings = [
        torch.full((W, T, k), rank * E_local + 1, dtype=torch.int32),  # everything local, one expert
        _random_idx(W, T, k, W * E_local, gen),
        torch.zeros(W, T, k, dtype=torch.int32),  # everything remote (expert 0 lives on rank 0)
        _random_idx(W, T, k, W * E_local, gen, distinct=False),
    ]
    for all_idx in routings:
        _run(all_idx, rank, E_local, BM, bufs=bufs)
        _check(bufs, all_idx, rank, E_local, BM)


def test_deterministic():
    gen = torch.Generator().manual_seed(11)
    W, T, k, E_local, BM, rank = 4, 45, 4, 7, 8, 3
    all_idx = _random_idx(W, T, k, W * E_local, gen, distinct=False)
    a, _ = _run(all_idx, rank, E_local, BM, chunk=32)
    b, _ = _run(all_idx, rank, E_local, BM, chunk=32)
    for name, t in a.outputs().items():
        assert torch.equal(t.cpu(), b.outputs()[name].cpu()), name
    assert torch.equal(a.within.cpu(), b.within.cpu()) and torch.equal(a.counts.cpu(), b.counts.cpu())
    # The chunking changes the scratch, never the result.
    c, _ = _run(all_idx, rank, E_local, BM, chunk=16)
    for name, t in a.outputs().items():
        assert torch.equal(t.cpu(), c.outputs()[name].cpu()), name


@pytest.mark.parametrize("bad_value", [10_000, -3, 8])
def test_bad_expert_id(bad_value):
    """An id outside [0, W*E_local) sets the error record, is routed nowhere, writes nothing OOB."""
    gen = torch.Generator().manual_seed(5)
    W, T, k, E_local, BM, rank = 2, 37, 3, 4, 16, 0  # E = 8: id 8 is the first bad one
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    t_bad, k_bad = 20, 1
    all_idx[1, t_bad, k_bad] = bad_value
    all_idx[1, t_bad + 5, 0] = bad_value + 1  # a second bad id: the first one wins
    bufs = alloc_schedule(W, T, k, E_local, BM, DEVICE, chunk=32, inverse=True)
    # Guard words around every output: replace each by a view into a larger sentinel buffer.
    G, SENT = 64, -777
    guarded = {}
    for name in OUTPUTS + ("row_of_src",):
        t = getattr(bufs, name)
        big = torch.full((t.numel() + 2 * G,), SENT, dtype=torch.int32, device=DEVICE)
        guarded[name] = big
        setattr(bufs, name, big[G:G + t.numel()].view(t.shape))
    bufs, err = _run(all_idx, rank, E_local, BM, bufs=bufs)
    _check(bufs, all_idx, rank, E_local, BM)
    for name, big in guarded.items():
        big = big.cpu()
        assert (big[:G] == SENT).all() and (big[-G:] == SENT).all(), f"out-of-bounds write near {name}"
    err = err.cpu().tolist()
    assert err[0] == ERR_BAD_EXPERT_ID
    assert err[1] == rank
    assert err[2] == 1 * T * k + t_bad * k + k_bad  # flat position of the first bad entry
    assert err[3] == W * E_local
    assert err[4] == bad_value
    assert err[5] == 0
    # Same call on another rank: same report, with that rank.
    _, err1 = _run(all_idx, 1, E_local, BM, chunk=32)
    assert err1.cpu().tolist()[:5] == [ERR_BAD_EXPERT_ID, 1, err[2], W * E_local, bad_value]


def test_first_error_wins():
    W, T, k, E_local, BM = 2, 16, 2, 4, 8
    all_idx = torch.randint(0, W * E_local, (W, T, k), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(9))
    all_idx[0, 3, 1] = -1
    err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=DEVICE)
    err[0], err[2] = 2, 99  # an earlier error already recorded
    _run(all_idx, 0, E_local, BM, chunk=16, err=err)
    assert err[0].item() == 2 and err[2].item() == 99


def test_grids_fixed_by_shapes():
    """Grids depend on the shapes alone, never on the routing (CUDA-graph capturable)."""
    a = alloc_schedule(2, 100, 8, 64, 128, "cpu")
    b = alloc_schedule(2, 100, 8, 64, 128, "cpu")
    assert schedule_grids(a) == schedule_grids(b)
    g = schedule_grids(alloc_schedule(2, 16384, 8, 64, 128, "cpu"))
    assert g["count"] == 2 * 128 and set(g) == {"count", "place"}  # two launches: the scan is count's last program


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("W,T,k,E_local,BM", [
    (2, 16384, 8, 64, 128),   # qwen3-30b-a3b at EP2
    (8, 2048, 8, 48, 128),    # kimi-k2 at EP8
    (1, 16384, 10, 512, 128),  # qwen3.5-397b, all experts on one rank
    (4, 333, 6, 5, 64),
])
def test_gpu_matches_reference_and_time(W, T, k, E_local, BM):
    gen = torch.Generator().manual_seed(W * T + E_local)
    all_idx = _random_idx(W, T, k, W * E_local, gen)
    rank = W - 1
    idx_list = [all_idx[s].contiguous().cuda() for s in range(W)]
    ptrs = _ptrs(idx_list, "cuda")
    err = torch.zeros(ERR_WORDS, dtype=torch.int32, device="cuda")
    bufs = alloc_schedule(W, T, k, E_local, BM, "cuda", inverse=True)
    bufs.row_src.fill_(7)
    launch_schedule(bufs, ptrs, err, rank)
    torch.cuda.synchronize()
    _check(bufs, all_idx, rank, E_local, BM)
    assert (err == 0).all()
    # Skewed routing on the same buffers, then the first one again.
    skew = torch.where(torch.rand(W, T, k, generator=gen) < 0.5,
                       torch.full((W, T, k), rank * E_local, dtype=torch.int32), all_idx)
    for routing in (skew, all_idx):
        for s in range(W):
            idx_list[s].copy_(routing[s])
        launch_schedule(bufs, ptrs, err, rank)
        torch.cuda.synchronize()
        _check(bufs, routing, rank, E_local, BM)
    # Timing (CUDA graph of the three launches, to see kernel time rather than launch overhead).
    bufs_t = alloc_schedule(W, T, k, E_local, BM, "cuda")
    launch_schedule(bufs_t, ptrs, err, rank)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch_schedule(bufs_t, ptrs, err, rank)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / n
    print(f"\nschedule W={W} T={T} k={k} E_local={E_local} BM={BM} chunk={bufs_t.CHUNK}: {us:.1f} us/call")
    _check(bufs_t, all_idx, rank, E_local, BM)


@pytest.mark.parametrize("idx_dtype,w_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
def test_count_launch_publishes_the_routing(idx_dtype, w_dtype):
    """``publish``: the count programs of this rank's chunks copy its routing into idx_pub / w_pub and
    the last of them sets its flag to the pass's new epoch; the launch stores that epoch and the
    schedule is the one of the published routing. (One rank: under the interpreter a program cannot
    wait for another rank's launch.)"""
    gen = torch.Generator().manual_seed(5)
    W, T, k, E_local, BM, rank, slot = 1, 53, 3, 6, 16, 0, 2
    idx = _random_idx(W, T, k, W * E_local, gen)[0].to(idx_dtype).to(DEVICE)
    w = torch.rand(T, k, generator=gen).to(w_dtype).to(DEVICE)
    idx_pub = torch.full((T, k), -7, dtype=torch.int32, device=DEVICE)
    w_pub = torch.full((T, k), -1.0, dtype=torch.float32, device=DEVICE)
    flags = torch.zeros(4 * W, dtype=torch.int32, device=DEVICE)
    epoch = torch.full((1,), 41, dtype=torch.int32, device=DEVICE)
    err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=DEVICE)
    bufs = alloc_schedule(W, T, k, E_local, BM, DEVICE, chunk=16, inverse=True)
    for _ in range(2):  # twice: the done counters are back at zero after a launch
        launch_schedule(bufs, _ptrs([idx_pub], DEVICE), err, rank, ready=(flags, epoch, slot, 1 << 20),
                        publish=(idx, w, idx_pub, w_pub, _ptrs([flags], DEVICE)))
        assert bufs.done.tolist() == [0, 0]
    assert epoch.item() == 43 and flags[slot * W + rank].item() == 43
    assert torch.equal(idx_pub.cpu(), idx.cpu().to(torch.int32))
    assert torch.equal(w_pub.cpu(), w.cpu().float())
    _check(bufs, idx.cpu().to(torch.int32)[None], rank, E_local, BM)
    assert (err.cpu() == 0).all()
