"""The forward megakernel (MoEConfig(megakernel=True)) on the CPU: ranks as threads, kernels interpreted.

Values and every gradient against the reference layer; bitwise equality of y with the
sync-free path (same GEMM tiles, same K order per output element); bitwise determinism; small
rings that wrap many times; extreme routing; and a wait that cannot be satisfied becoming an
error record instead of a hang.
"""
import dataclasses

import pytest
import torch

import tabby
from tabby.functional import moe as moe_mod
from tabby.functional.config import MoEConfig
from tabby.functional.workspace import (FWD, FWD_DONE, FWD_X_PULL, FWD_X_READY, TabbyDeviceError, Workspace,
                                       WorkspaceKey)
from tabby.ops import gemm, megakernel_fwd, sync
from tabby.ops.schedule import alloc_schedule, launch_schedule

from harness import make_problem, rel_err, run_ranks
from test_moe_cpu import CFG, _check, _run_reference, _run_tabby

# debug: check the error record after every pass (a timed-out tile wait fails the test)
MEGA = dataclasses.replace(CFG, megakernel=True, ring_rows=2 * CFG.tile_m, fwd_programs=3, debug=True)


def _small_tiles(monkeypatch, BN=16, BK=16):
    """Several gate/up and down column tiles per row tile (and several K steps), both paths."""
    orig = moe_mod._gemm_cfg
    monkeypatch.setattr(moe_mod, "_gemm_cfg", lambda cfg, kind, N, K: orig(cfg, kind, N, K).with_(BN=BN, BK=BK))


CASES = {
    # name: (W, T, H, I, E_local, k, shared, route, ring slots)
    "ep1-shared": (1, 9, 32, 24, 3, 2, True, "random", 2),
    "ep2-shared": (2, 7, 48, 40, 2, 3, True, "random", 2),
    "ep2-one-expert": (2, 20, 32, 16, 2, 2, False, "one_expert", 2),  # 80 rows (5 tiles) into one expert
    "ep2-one-rank": (2, 12, 32, 16, 2, 2, True, "one_rank", 3),
    "ep4": (4, 5, 32, 16, 2, 2, True, "random", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megakernel_matches_reference(case, monkeypatch):
    W, T, H, I, E_local, k, shared, route, slots = CASES[case]
    _small_tiles(monkeypatch)
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=hash(case) % 1000, route=route)
    cfg = dataclasses.replace(MEGA, ring_rows=slots * CFG.tile_m)
    _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))


def _run_y(W, T, prob, cfg):
    """Forward only: y of every rank (concatenated)."""
    x, idx, wts, ws, sh, _ = prob
    E_local = ws[0].shape[0] // W

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        wl = [w[r * E_local:(r + 1) * E_local] for w in ws]
        with torch.no_grad():
            return tabby.moe(x[rows], idx[rows], wts[rows], *wl, shared=sh, group=group, config=cfg)

    return torch.cat(run_ranks(W, rank_fn))


@pytest.mark.parametrize("route,down_bn,gu_bn,tma,cols", [("random", None, None, False, None),
                                                          ("one_expert", None, None, False, 16),
                                                          ("random", 8, 8, False, None), ("one_expert", None, None, True, None),
                                                          ("random", 8, 8, True, 256)])
def test_megakernel_y_bitwise_equals_sync_free_path(route, down_bn, gu_bn, tma, cols, monkeypatch):
    # 2 slots; one_expert: 2*24*2 = 96 rows -> 6 tiles into expert 0 of rank 0 (the ring wraps 3 times);
    # down_bn / gu_bn: narrower tiles in the megakernel only (each output still sums K in the same order);
    # tma: operands through tensor descriptors (ring slots as TMA coordinates); cols: columns per
    # fill step (16: three steps per row; 256: one step, wider than H)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 24, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=11, route=route)
    y0 = _run_y(W, T, prob, CFG)
    y1 = _run_y(W, T, prob, dataclasses.replace(MEGA, fwd_down_bn=down_bn, fwd_gate_up_bn=gu_bn, fwd_tma=tma,
                                                         fwd_pull_cols=cols))
    assert torch.equal(y0, y1)


@pytest.mark.parametrize("H,I,cols,tma,save", [(64, 40, 2, False, False), (64, 40, 4, True, False),
                                               (48, 40, 3, True, False), (48, 40, 3, None, True)])
def test_down_tickets_of_several_column_tiles(H, I, cols, tma, save, monkeypatch):
    # One down ticket (fwd_down_cols; with TMA in one K loop whose epilogue pushes each column tile)
    # runs several column tiles: 3 or 4 per row tile here (H / 16); half tiles on, the ring wraps.
    # Same K order per output element: y is bitwise the sync-free one; with saved rows the
    # gradients match the reference.
    _small_tiles(monkeypatch)
    W, T, E_local, k = 2, 21, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=17, route="random")
    cfg = dataclasses.replace(MEGA, fwd_tma=tma, fwd_save_for_backward=save, ring_rows=4 * CFG.tile_m,
                              fwd_down_cols=cols)
    assert megakernel_fwd.down_col_tiles(H // 16, cols) == cols
    assert torch.equal(_run_y(W, T, prob, CFG), _run_y(W, T, prob, cfg))
    if save:
        _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))


def test_two_down_cols_by_default_only_for_short_expert_widths():
    from tabby.functional.config import TWO_DOWN_COLS_MAX_I

    assert [MoEConfig().down_cols(I) for I in (768, 1024, 2048, 2880)] == [2, 2, 1, 1]
    assert TWO_DOWN_COLS_MAX_I == 1024 and MoEConfig(fwd_down_cols=4).down_cols(768) == 4


def test_small_experts_group_two_row_tiles_by_default():
    # groups of 2 where H * I <= GROUP_2_MAX_HI (qwen3-30b-a3b), 4 for the larger experts; an explicit
    # fwd_group_m wins, a ring too small for groups of 2 still gets 1, and no shape keeps the old rule
    from tabby.functional.config import GROUP_2_MAX_HI
    from tabby.shapes import SHAPES

    got = {n: MoEConfig().group_m(s.H, s.I) for n, s in SHAPES.items()}
    assert got == {"kimi-k2": 4, "glm-5": 4, "qwen3.5-397b": 4, "deepseek-v4-pro": 4, "qwen3-30b-a3b": 2,
                   "gpt-oss-120b": 4}, got
    assert MoEConfig().group_m() == 4 and GROUP_2_MAX_HI == 2 * 2**20
    assert MoEConfig().group_m(1024, 2048) == 2 and MoEConfig().group_m(1024, 2049) == 4  # the edge
    assert MoEConfig(fwd_group_m=4).group_m(2048, 768) == 4
    assert MoEConfig(ring_rows=256).group_m(2048, 768) == 1  # 2 slots: one group of 2 would be all


def test_experts_aligned_to_two_tiles_by_default_only_where_row_tiles_are_grouped():
    # 2 when the ticket order groups row tiles (4 per group from 8 ring slots up), 1 otherwise and
    # on the sync-free path; and only where experts average at most ALIGN_MAX_TILES row tiles (an
    # explicit fwd_align_tiles wins)
    from tabby.functional.config import ALIGN_MAX_TILES

    q35, q30_16k = (4096, 10, 256), (16384, 8, 64)  # 160 and 2048 rows per local expert at EP2
    assert MoEConfig().align_tiles(*q35) == 2  # 4096 / 128 = 32 slots: groups of 4
    assert MoEConfig().align_tiles(*q30_16k) == 1 and ALIGN_MAX_TILES == 4
    assert MoEConfig().align_tiles(64, 8, 1) == 2 and MoEConfig().align_tiles(65, 8, 1) == 1  # 512 rows: 4 tiles
    assert MoEConfig(ring_rows=256).align_tiles(*q35) == 1  # 2 slots: groups of 1
    assert MoEConfig(fwd_group_m=1).align_tiles(*q35) == 1 and MoEConfig(fwd_group_m=2).align_tiles(*q35) == 2
    assert MoEConfig(megakernel=False, fwd_align_tiles=3).align_tiles(*q35) == 1
    assert MoEConfig(fwd_align_tiles=3).align_tiles(*q30_16k) == 3


def test_down_col_tiles_divides_the_column_tiles():
    assert [megakernel_fwd.down_col_tiles(16, c) for c in (1, 2, 3, 4, 5, 8, 100)] == [1, 2, 2, 4, 4, 8, 16]
    assert [megakernel_fwd.down_col_tiles(12, c) for c in (4, 5, 8)] == [4, 4, 6]
    with pytest.raises(ValueError, match="fwd_down_cols"):
        megakernel_fwd.down_col_tiles(16, 0)


def test_megakernel_tma_falls_back_to_pointer_loads_on_unaligned_rows(monkeypatch):
    # H = 36: a 72-byte row stride is no multiple of 16, which TMA needs; the launcher then uses
    # pointer loads (same result as without TMA, bitwise)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 10, 36, 24, 2, 2
    assert not gemm._tma_ok(torch.empty(4, H, dtype=torch.bfloat16))
    prob = make_problem(W, T, H, I, E_local, k, seed=8, route="random")
    y0 = _run_y(W, T, prob, dataclasses.replace(MEGA, fwd_tma=False))
    y1 = _run_y(W, T, prob, dataclasses.replace(MEGA, fwd_tma=True))
    assert torch.equal(y0, y1)
    assert rel_err(y1, _run_y(W, T, prob, CFG)) == 0


def test_megakernel_tma_with_shared_expert_matches_reference(monkeypatch):
    # the shared expert through descriptors too: x rows past T read as zeros (x has 9 rows, one 16-row tile)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 9, 32, 24, 3, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=5, route="random")
    cfg = dataclasses.replace(MEGA, fwd_tma=True)
    _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))


@pytest.mark.parametrize("slots,prefetch,lag,split,group,save", [(2, 0, 1, 4, 1, True), (3, 2, 2, 2, 1, False),
                                                                (3, 1, 2, 1, 1, True), (4, 1, 1, 2, 2, False),
                                                                (6, 0, 1, 1, 3, True)])
def test_megakernel_ring_wraps_many_times_bitwise_deterministic(slots, prefetch, lag, split, group, save,
                                                                monkeypatch):
    # every token of every rank to expert 0: 2*64*2 = 256 rows = 16 tiles through a 2- or 3-slot
    # ring (wraps 8 or 5 times), fills 0 or 2 tiles ahead, shared expert, a grid of 4; all outputs
    # and gradients bitwise equal over runs
    _small_tiles(monkeypatch, BN=32, BK=16)
    W, T, H, I, E_local, k = 2, 64, 32, 32, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=3, route="one_expert")
    cfg = dataclasses.replace(MEGA, fwd_programs=4, ring_rows=slots * CFG.tile_m, fwd_prefetch=prefetch,
                              fwd_down_lag=lag, fwd_fill_split=split, fwd_group_m=group,
                              fwd_save_for_backward=save)  # save: the backward uses what the kernel kept
    a = _run_tabby(W, T, prob, cfg=cfg)
    _check(a, _run_reference(prob))
    b = _run_tabby(W, T, prob, cfg=cfg)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ref = _run_tabby(W, T, prob, cfg=CFG)  # the sync-free path: routed part bitwise equal (no shared here)
    for name in ("dw", "dw0", "dw1", "dw2"):
        assert torch.equal(a[name], ref[name]), name


def test_megakernel_split_mode_runs_when_the_ring_holds_every_tile(monkeypatch):
    # fwd_comm_programs=1: program 0 pulls every tile, the others compute. Under the interpreter the
    # programs run in pid order, so the comm program must never wait for a slot: ring >= num_tiles.
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 10, 32, 16, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=4)
    cfg = dataclasses.replace(MEGA, ring_rows=8 * CFG.tile_m, fwd_comm_programs=1, fwd_programs=3)
    got = _run_tabby(W, T, prob, cfg=cfg)
    _check(got, _run_reference(prob))
    assert torch.equal(got["y"], _run_tabby(W, T, prob, cfg=dataclasses.replace(cfg, fwd_comm_programs=0))["y"])


def test_megakernel_needs_two_slots_and_a_valid_prefetch():
    prob = make_problem(1, 4, 32, 16, 2, 2)
    x, idx, wts, ws, _, _ = prob
    with pytest.raises(tabby.MoEInputError, match="two ring slots"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, ring_rows=CFG.tile_m))
    with pytest.raises(tabby.MoEInputError, match="fwd_prefetch"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_prefetch=2))
    with pytest.raises(tabby.MoEInputError, match="fwd_down_lag"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_down_lag=2))  # 2 slots: lag in [1, 2)
    with pytest.raises(tabby.MoEInputError, match="fwd_fill_split"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_fill_split=3))
    with pytest.raises(tabby.MoEInputError, match="fwd_group_m"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_group_m=2))  # 2 slots: one group
    with pytest.raises(tabby.MoEInputError, match="fwd_pull_cols"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_pull_cols=48))
    with pytest.raises(tabby.MoEInputError, match="fwd_num_warps"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_num_warps=2))
    with pytest.raises(tabby.MoEInputError, match="fwd_fill_stages"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_fill_stages=0))
    with pytest.raises(tabby.MoEInputError, match="fwd_align_tiles"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, fwd_align_tiles=0))
    with pytest.raises(tabby.MoEInputError, match="overlap_publish"):
        tabby.moe(x, idx, wts, *ws, config=dataclasses.replace(MEGA, overlap_publish=2))


# ------------------------------------------------------------------------------------------------
# One rank, the launcher directly: counters and error records
# ------------------------------------------------------------------------------------------------

def _one_rank(T=40, H=32, I=32, E_local=2, k=2, BM=16, slots=2, I_s=0, seed=0, route="one_expert",
              tile_counters=False):
    x, idx, wts, (wg, wu, wd), _, _ = make_problem(1, T, H, I, E_local, k, seed=seed, route=route)
    ws = Workspace(WorkspaceKey(T, H, k, E_local, I, 1, x.dtype, "cpu"), 0)
    ws.x_pub.copy_(x)
    ws.idx_pub.copy_(idx)
    sched = alloc_schedule(1, T, k, E_local, BM, x.device)
    launch_schedule(sched, ws.ptrs["idx_pub"], ws.err, 0)
    mb = megakernel_fwd.alloc_mega(T, H, I, I_s, BM, slots * BM, x.dtype, x.device,
                                   n_tiles=sched.n_tiles_max if tile_counters else 0)
    gu_cfg = gemm.default_config(gemm.KIND_GATE_UP, I, H, BM=BM).with_(BN=16, BK=16)
    dn_cfg = gemm.default_config(gemm.KIND_DOWN, H, I, BM=BM).with_(BN=16, BK=16)
    return dict(ws=ws, sched=sched, mb=mb, w=(wg, wu, wd), x=x, gu_cfg=gu_cfg, dn_cfg=dn_cfg, TK=T * k)


def _launch(p, max_iters=1 << 20, programs=2, zero=True, prefetch=None, fill_split=1):
    ws = p["ws"]
    megakernel_fwd.launch_fwd_megakernel(
        p["mb"], p["sched"], ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[0:], 0, max_iters, *p["w"],
        gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=programs, prefetch=prefetch, zero_counters=zero,
        fill_split=fill_split)


@pytest.mark.parametrize("prefetch,split", [(0, 1), (1, 1), (1, 4)])
def test_megakernel_counters_and_pushed_rows(prefetch, split):
    p = _one_rank()  # 80 rows into expert 0: 5 tiles, 2 slots
    _launch(p, prefetch=prefetch, fill_split=split)
    nt = int(p["sched"].num_tiles)
    assert nt == 5
    NS, G, D = 2, 2, 2  # I / 16, H / 16
    lay = megakernel_fwd.counter_layout(NS, 0)
    c = p["mb"].counters
    ready = c[lay["ready"]:lay["ready"] + NS].tolist()
    assert ready == [3 * split, 2 * split]  # tiles 0, 2, 4 in slot 0; 1, 3 in slot 1; split fills each
    assert c[lay["gu_done"]:lay["gu_done"] + NS].tolist() == [G * 3, G * 2]
    assert c[lay["dn_done"]:lay["dn_done"] + NS].tolist() == [D * 3, D * 2]
    F = split  # every ticket taken, one more per program
    assert int(c[lay["ticket"]]) == prefetch * F + nt * (F + G + D) + 2
    # the pushed rows equal those of the sync-free launches (pull, gate_up, down_push), bitwise
    sched, ws = p["sched"], p["ws"]
    xs = p["x"].new_empty((sched.R_max, p["x"].shape[1]))
    moe_mod._pull_rows(CFG, sched, ws.ptrs["x_pub"], xs, p["TK"], sched.k)
    h = gemm.gate_up_swiglu(xs, p["w"][0], p["w"][1], sched.tile_expert, sched.num_tiles, config=p["gu_cfg"])
    y_ref = torch.zeros_like(ws.y_in)
    gemm.down_push(h, p["w"][2], sched.tile_expert, sched.num_tiles, sched.row_src,
                   torch.tensor([y_ref.data_ptr()], dtype=torch.int64), p["TK"], config=p["dn_cfg"])
    assert torch.equal(ws.y_in, y_ref)
    ws.check_errors()


@pytest.mark.parametrize("which,code", [("gu_done", sync.ERR_WAIT_RING_SLOT), ("ready", sync.ERR_WAIT_TILE)])
def test_megakernel_impossible_wait_is_an_error_record(which, code):
    p = _one_rank()
    lay = megakernel_fwd.counter_layout(2, 0)
    c = p["mb"].counters
    c.zero_()
    c[lay[which] + 1] = -1000  # slot 1 can never be filled (gu_done) / never looks filled (ready)
    _launch(p, max_iters=50, zero=False)  # returns: bounded waits
    rec = p["ws"].err.tolist()
    assert rec[0] == code and rec[2] == lay[which] + 1
    with pytest.raises(TabbyDeviceError, match="timed out"):
        p["ws"].check_errors()


def test_wait_on_index_minus_one_is_no_wait():
    """``_routed_waits``' index -1 means "no wait": ``_wait`` must not read the word before the
    counters (session 15: a token-pull tile of this rank's rows, idx1 = -1, whose first polls missed
    spun there, on another allocation's memory, and timed out by the process's history). The
    counters now start one always-zero guard word into their allocation, so such a read fails here
    every time; a real unmet wait still is an error record."""
    import triton

    @triton.jit
    def probe(cnt_ptr, err_ptr, idx, target, budget):
        megakernel_fwd._wait(cnt_ptr, idx, target, budget, err_ptr, sync.ERR_WAIT_TILE, 0, 1)

    mb = megakernel_fwd.alloc_mega(8, 16, 16, 0, 16, 32, torch.bfloat16, torch.device("cpu"), 2)
    c = mb.counters
    guard = torch.empty(0, dtype=torch.int32).set_(c.untyped_storage())
    assert c.storage_offset() == 1 and int(guard[0]) == 0
    err = torch.zeros(sync.ERR_WORDS, dtype=torch.int32)
    probe[(1,)](c, err, -1, 1, 50)
    assert int(err[0]) == sync.ERR_NONE, err.tolist()
    probe[(1,)](c, err, 3, 1, 50)
    assert int(err[0]) == sync.ERR_WAIT_TILE and int(err[2]) == 3


# ------------------------------------------------------------------------------------------------
# The ticket / counter protocol under concurrent schedules (a model; the interpreter only ever runs
# the programs one after another, so it cannot show a race or a deadlock of another interleaving)
# ------------------------------------------------------------------------------------------------

def _decode_py(t, n, F, G, D, L=1):
    """Python mirror of megakernel_fwd._decode (checked against the kernel's below): the stages
    [F fills of s] [G gate/ups of s if s < n] [D downs of s - L if s >= L], empty ones skipped."""
    seq = []
    for s in range(n + L):
        seq += [(0, s, p) for p in range(F)] if s < n else []
        seq += [(1, s, c) for c in range(G)] if s < n else []
        seq += [(2, s - L, c) for c in range(D)] if s >= L else []
    return seq[t]


def test_decode_mirror_matches_the_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def k(out, n, F, G, D, L, BLOCK: tl.constexpr):
        t = tl.arange(0, BLOCK)
        kind, tile, col = megakernel_fwd._decode(t, n, F, G, D, L)
        tl.store(out + t * 3, kind)
        tl.store(out + t * 3 + 1, tile)
        tl.store(out + t * 3 + 2, col)

    for n, F, G, D, L in [(5, 1, 2, 3, 1), (3, 0, 1, 1, 1), (1, 1, 3, 2, 1), (4, 0, 2, 5, 1), (5, 4, 2, 3, 2),
                          (2, 2, 1, 2, 4), (6, 3, 2, 1, 3), (0, 1, 1, 1, 2)]:
        total = n * (F + G + D)
        out = torch.zeros(128, 3, dtype=torch.int32)
        k[(1,)](out, n, F, G, D, L, BLOCK=128)
        want = [_decode_py(t, n, F, G, D, L) for t in range(total)]
        assert [tuple(r) for r in out[:total].tolist()] == want
        # every task exactly once
        assert sorted(want) == sorted([(0, i, p) for i in range(n) for p in range(F)]
                                      + [(1, i, c) for i in range(n) for c in range(G)]
                                      + [(2, i, c) for i in range(n) for c in range(D)])


def _routed_task_py(tr, nt, pre, L, F, G, D, GM):
    """Python mirror of megakernel_fwd._routed_task: (kind, row tile, column or part)."""
    if tr < pre * GM * F:
        return 0, tr // F, tr % F
    ng = -(-nt // GM)
    kind, q, c = _decode_py(tr - pre * GM * F, ng, GM * F, GM * G, GM * D, L)
    if kind == 0:
        return 0, (q + pre) * GM + c // F, c % F
    return kind, q * GM + c % GM, c // GM


@pytest.mark.parametrize("GM", [1, 2, 3])
def test_routed_task_mirror_matches_the_kernel_and_covers_every_task(GM):
    import triton
    import triton.language as tl

    @triton.jit
    def k(out, nt, pre, L, F: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GM: tl.constexpr,
          BLOCK: tl.constexpr):
        t = tl.arange(0, BLOCK)
        kind, i, n = megakernel_fwd._routed_task(t, nt, pre, L, F, G, D, GM)
        tl.store(out + t * 3, kind)
        tl.store(out + t * 3 + 1, i)
        tl.store(out + t * 3 + 2, n)

    for nt, pre, L, F, G, D in [(5, 1, 1, 1, 2, 3), (7, 2, 2, 2, 1, 2), (4, 0, 3, 0, 2, 2), (1, 1, 1, 4, 1, 1)]:
        ng = -(-nt // GM)
        total = pre * GM * F + ng * GM * (F + G + D)
        out = torch.zeros(256, 3, dtype=torch.int32)
        k[(1,)](out, nt, pre, L, F, G, D, GM, BLOCK=256)
        want = [_routed_task_py(t, nt, pre, L, F, G, D, GM) for t in range(total)]
        assert [tuple(r) for r in out[:total].tolist()] == want
        real = sorted(w for w in want if w[1] < nt)  # every task of every row tile exactly once
        assert real == sorted([(0, i, p) for i in range(nt) for p in range(F)]
                              + [(1, i, c) for i in range(nt) for c in range(G)]
                              + [(2, i, c) for i in range(nt) for c in range(D)])


def _simulate(nt, NS, G, D, pre, programs, comm, rng, L=1, FS=1, GM=1, TR=False):
    """Run the megakernel's routed protocol with a random interleaving of `programs` programs.

    A task is: wait (its counter conditions), then work (an interval other programs may overlap),
    then signal. Checks that no task starts its work while the data it reads is not yet written or
    is being overwritten, and that the run never deadlocks. Returns the number of steps.
    TR: the differentiated forward's per-tile fill counters (fills write rows of their own, not a
    ring slot: no fill waits; gate/up waits for its tile's counter).
    """
    F = 0 if comm else FS
    pre = pre if F else 0
    total = pre * GM * F + -(-nt // GM) * GM * (F + G + D)
    cnt = dict(ticket=0, fill_ticket=0, ready=[0] * NS, gu=[0] * NS, dn=[0] * NS, tile=[0] * max(nt, 1))
    done = set()  # finished tasks
    working = set()  # tasks between their wait and their signal
    state = [None] * programs  # None: needs a ticket; ("wait"|"work", task); "exit"

    def task_of(p):
        if p < comm:
            f = cnt["fill_ticket"]
            cnt["fill_ticket"] += 1
            return ("fill", f // FS, f % FS) if f < nt * FS else None
        t = cnt["ticket"]
        cnt["ticket"] += 1
        if t >= total:
            return None
        kind, i, c = _routed_task_py(t, nt, pre, L, F, G, D, GM)
        if i >= nt:
            return ("nop", 0, 0)
        return (("fill", "gu", "dn")[kind], i, c)

    def ready(task):
        kind, i, _ = task
        s, g = i % NS, i // NS
        if kind == "fill":
            return TR or cnt["gu"][s] >= G * g
        if kind == "gu":
            filled = cnt["tile"][i] >= FS if TR else cnt["ready"][s] >= FS * (g + 1)
            return filled and cnt["dn"][s] >= D * g
        if kind == "dn":
            return cnt["gu"][s] >= G * (g + 1)
        return True

    def check_start(task):
        kind, i, _ = task
        busy = done | working
        if kind == "fill":  # xs slot: every reader of the previous generation finished
            assert TR or i < NS or all(("gu", i - NS, c) in done for c in range(G)), task
        elif kind == "gu":  # its rows are there and stay; the h slot's previous readers finished
            assert all(("fill", i, p) in done for p in range(FS)), task
            assert TR or not any(("fill", i + NS, p) in busy for p in range(FS)), task
            assert i < NS or all(("dn", i - NS, c) in done for c in range(D)), task
        elif kind == "dn":  # every h column tile is there and stays
            assert all(("gu", i, c) in done for c in range(G)), task
            assert not any(("gu", i + NS, c) in busy for c in range(G)), task

    def signal(task):
        kind, i, _ = task
        s = i % NS
        if kind == "fill" and TR:
            cnt["tile"][i] += 1
        elif kind in ("fill", "gu", "dn"):
            cnt[{"fill": "ready", "gu": "gu", "dn": "dn"}[kind]][s] += 1

    steps = 0
    while any(st != "exit" for st in state):
        movable = [p for p, st in enumerate(state)
                   if st is None or (st != "exit" and (st[0] == "work" or ready(st[1])))]
        assert movable, f"deadlock: {state} {cnt}"
        p = rng.choice(movable)
        st = state[p]
        if st is None:
            task = task_of(p)
            state[p] = "exit" if task is None else ("wait", task)
        elif st[0] == "wait":
            check_start(st[1])
            working.add(st[1])
            state[p] = ("work", st[1])
        else:
            working.discard(st[1])
            done.add(st[1])
            signal(st[1])
            state[p] = None
        steps += 1
    assert all(("dn", i, c) in done for i in range(nt) for c in range(D))
    return steps


@pytest.mark.parametrize("NS,pre,comm,L,FS,GM", [
    (2, 0, 0, 1, 1, 1), (2, 1, 0, 1, 1, 1), (3, 2, 0, 1, 1, 1), (4, 1, 0, 1, 1, 1), (2, 0, 1, 1, 1, 1),
    (3, 0, 2, 1, 1, 1), (4, 2, 0, 3, 2, 1), (5, 4, 0, 4, 4, 1), (3, 1, 0, 2, 2, 1), (4, 0, 2, 3, 4, 1),
    (4, 1, 0, 1, 2, 2), (6, 1, 0, 2, 1, 2), (6, 0, 0, 1, 2, 3), (8, 1, 0, 1, 2, 4), (6, 0, 2, 2, 1, 2)])
@pytest.mark.parametrize("TR", [False, True])
def test_protocol_model_random_interleavings(NS, pre, comm, L, FS, GM, TR):
    import random

    rng = random.Random(NS * 100 + pre * 10 + comm + 1000 * L + 10000 * FS + 100000 * GM + 7 * TR)
    for trial in range(60):
        nt = rng.randint(0, 12)
        G, D = rng.randint(1, 3), rng.randint(1, 3)
        programs = comm + rng.randint(1, 6)
        _simulate(nt, NS, G, D, pre, programs, comm, rng, L=L, FS=FS, GM=GM, TR=TR)


def test_protocol_model_catches_a_lag_as_long_as_the_ring():
    # down(i - L) must come before gate/up(i + 1) of the next generation of its slot: L = NS deadlocks
    import random

    with pytest.raises(AssertionError, match="deadlock"):
        for seed in range(20):
            _simulate(8, 2, 1, 1, 0, 1, 0, random.Random(seed), L=2)
    with pytest.raises(AssertionError, match="deadlock"):  # groups of 2 in 4 slots: 2 groups, L = 2 too long
        for seed in range(20):
            _simulate(8, 4, 1, 1, 0, 1, 0, random.Random(seed), L=2, GM=2)


def test_protocol_model_catches_a_one_slot_ring():
    # with one slot gate/up(i) waits on down(i-1), a later ticket: deadlock once every program holds a
    # gate/up ticket (here the one program; under the interpreter, program 0)
    import random

    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(4, 1, 2, 2, 0, 1, 0, random.Random(0))
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(4, 1, 2, 2, 0, 2, 0, random.Random(0))  # two programs, both on gate/up(1, *)


def test_split_mode_under_the_interpreter_refuses_a_ring_smaller_than_the_tiles():
    p = _one_rank()  # 5 tiles, 2 slots
    ws = p["ws"]
    with pytest.raises(ValueError, match="holds every tile"):
        megakernel_fwd.launch_fwd_megakernel(
            p["mb"], p["sched"], ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[0:], 0, 1 << 20, *p["w"],
            gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=3, comm_programs=1)


@pytest.mark.parametrize("save", [True, False])
def test_megakernel_backward_recomputes_only_without_saved_rows(save, monkeypatch):
    # fwd_save_for_backward: the kernel fills xs, g|u and the row weights and the backward uses them
    # (no "bwd:recompute" stage); without it the backward replays dispatch and gate/up. Both correct.
    stages = []

    class Marks:
        def mark(self, name):
            stages.append(name)

    monkeypatch.setattr(moe_mod, "STAGE_TIMER", Marks())
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 12, 32, 24, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=21, route="random")
    cfg = dataclasses.replace(MEGA, fwd_save_for_backward=save)
    _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))
    assert "fwd:megakernel" in stages
    assert ("bwd:recompute" in stages) == (not save)


def test_tma_by_default_only_for_large_forwards():
    # fwd_tma=None: TMA from TMA_MIN_FLOP routed forward FLOPs per rank (host time of the descriptors)
    from tabby.functional.config import TMA_MIN_FLOP

    cfg = MoEConfig()
    assert cfg.fwd_tma is None
    assert not cfg.use_tma(4096, 8, 2048, 768)  # qwen3-30b-a3b, 4096 tokens: 0.31 TFLOP
    assert cfg.use_tma(16384, 8, 2048, 768)  # 1.24 TFLOP
    assert cfg.use_tma(4096, 8, 7168, 2048)  # kimi-k2
    assert 6 * 4096 * 8 * 2048 * 768 < TMA_MIN_FLOP <= 6 * 4096 * 4 * 2880 * 2880  # gpt-oss-120b on
    assert MoEConfig(fwd_tma=True).use_tma(1, 1, 8, 8) and not MoEConfig(fwd_tma=False).use_tma(10**6, 8, 8192, 8192)


def _ragged_problem():
    """EP2, two experts per rank with 25, 12, 17 and 22 rows: several tiles of 16 rows, tails of at
    most half a tile and of more. Returns (W, T, problem, rows per global expert)."""
    W, T, H, I, E_local, k = 2, 19, 32, 24, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=0, route="random")
    return W, T, prob, torch.bincount(prob[1].flatten(), minlength=W * E_local).tolist()


@pytest.mark.parametrize("tma", [False, True])
def test_half_tiles_equal_full_tiles_and_match_the_reference(tma, monkeypatch):
    # fwd_half_tiles: an expert's last tile with at most tile_m/2 rows is computed as a half-height
    # tile; y is bitwise the same as with full tiles, and the saved rows (padding rows left
    # unwritten) give the reference's gradients
    _small_tiles(monkeypatch)
    W, T, prob, counts = _ragged_problem()
    tails = [c % CFG.tile_m for c in counts]
    assert any(0 < r <= CFG.tile_m // 2 for r in tails) and any(r > CFG.tile_m // 2 for r in tails), counts
    full = dataclasses.replace(MEGA, fwd_half_tiles=False, fwd_tma=tma)
    half = dataclasses.replace(MEGA, fwd_half_tiles=True, fwd_tma=tma)
    assert torch.equal(_run_y(W, T, prob, full), _run_y(W, T, prob, half))
    _check(_run_tabby(W, T, prob, cfg=half), _run_reference(prob))


def test_trace_records_every_ticket_once(monkeypatch):
    # fwd_trace_events: one rank, program 0 takes every ticket under the interpreter; the recorded
    # kinds count the fills (4 parts per row tile), gate/ups and downs of every row tile, the
    # shared expert's tiles and the order's empty tickets
    _small_tiles(monkeypatch)
    T, H, I, E, k = 21, 32, 24, 3, 2
    x, idx, wts, ws, sh, _ = make_problem(1, T, H, I, E, k, shared=True, seed=4, route="random")
    cfg = dataclasses.replace(MEGA, fwd_trace_events=256, fwd_group_m=1)
    megakernel_fwd.LAST_TRACE = None
    with torch.no_grad():
        tabby.moe(x, idx, wts, *ws, shared=sh, config=cfg)
    tr = megakernel_fwd.LAST_TRACE
    assert tr is not None and tr.shape == (3, megakernel_fwd.TRACE_HEAD.value + 4 * 256)
    n = int(tr[0, 0])
    assert tr[1:, 0].tolist() == [0, 0]  # programs 1, 2 found no ticket left
    codes = tr[0, megakernel_fwd.TRACE_HEAD.value:].reshape(256, 4)[:n, 0].tolist()
    a = cfg.align_tiles(T, k, E)  # each expert's row tiles padded to a multiple of a (padding tiles are tickets too)
    nt = sum(-(-c // (CFG.tile_m * a)) * a for c in torch.bincount(idx.flatten(), minlength=E).tolist())
    G, D = -(-I // 16), -(-H // 16)  # _small_tiles: 16-column tiles
    D_routed = D // megakernel_fwd.down_col_tiles(D, cfg.down_cols(I))  # down tickets per row tile (2 tiles each)
    assert D_routed == 1
    n_sh = -(-T // CFG.tile_m)
    kinds = megakernel_fwd.TRACE_KINDS
    count = {name: codes.count(c) for c, name in enumerate(kinds)}
    assert (count["fill"], count["gate/up"], count["down"]) == (nt * cfg.fwd_fill_split, nt * G, nt * D_routed)
    assert (count["shared gate/up"], count["shared down"]) == (n_sh * G, n_sh * D)
    assert count["fill remote"] == 0  # one rank: every row is local
    assert sum(count.values()) == n


def test_trace_tells_fills_of_remote_rows_from_local_ones(monkeypatch):
    # EP2: each rank's trace counts as "fill remote" exactly the fill parts that hold a row of the
    # other rank (from the schedule's reference), the rest as "fill"
    from tabby.ops.schedule import schedule_reference

    _small_tiles(monkeypatch)
    W, T, prob, _ = _ragged_problem()
    E_local = prob[3][0].shape[0] // W
    cfg = dataclasses.replace(MEGA, fwd_trace_events=256, fwd_group_m=1)
    megakernel_fwd.LAST_TRACE_BY_RANK.clear()
    _run_y(W, T, prob, cfg)
    idx, BM, FS, k = prob[1], CFG.tile_m, cfg.fwd_fill_split, prob[1].shape[1]
    kinds = megakernel_fwd.TRACE_KINDS
    for r in range(W):
        tr = megakernel_fwd.LAST_TRACE_BY_RANK[r]
        codes = tr[0, megakernel_fwd.TRACE_HEAD.value:].reshape(256, 4)[:int(tr[0, 0]), 0].tolist()
        sched = schedule_reference(idx.reshape(W, T, k), r, E_local, BM, align=cfg.align_tiles(T, k, E_local))
        parts = sched["row_src"][:int(sched["num_tiles"]) * BM].long().reshape(-1, BM // FS)
        remote = ((parts >= 0) & (parts // (T * k) != r)).any(dim=1)
        assert 0 < int(remote.sum()) < len(parts), r  # the case has both kinds on each rank
        assert codes.count(kinds.index("fill remote")) == int(remote.sum()), r
        assert codes.count(kinds.index("fill")) == len(parts) - int(remote.sum()), r


@pytest.mark.parametrize("save", [True, False])
def test_padding_tiles_of_aligned_experts_change_nothing(save, monkeypatch):
    # fwd_align_tiles: each expert's row tiles padded to a multiple of 1, 2 or 3 (padding tiles are
    # tickets that wait and signal but compute nothing); y is bitwise the same, and the backward
    # (saved rows, or recomputed ones) skips the padding tiles and matches the reference
    _small_tiles(monkeypatch)
    W, T, prob, counts = _ragged_problem()
    assert any(-(-c // CFG.tile_m) % 2 for c in counts), counts  # align 2 pads some expert
    ys = [_run_y(W, T, prob, dataclasses.replace(MEGA, fwd_align_tiles=a)) for a in (1, 2, 3)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    cfg = dataclasses.replace(MEGA, fwd_align_tiles=3, fwd_save_for_backward=save)
    _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))


@pytest.mark.parametrize("cols", [None, 16])
def test_pipelined_fill_loop_gives_the_same_rows(cols, monkeypatch):
    # fwd_fill_stages: the fills' column loop as a pipelined tl.range (the interpreter runs it as a
    # plain loop; tests/test_megakernel_compile.py checks that sm_90 gets async copies): y bitwise
    # equal to the sync-free path, with one column step per row (None) or three (16 of 48 columns)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 24, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=5, route="random")
    y0 = _run_y(W, T, prob, CFG)
    for stages in (1, 3):
        cfg = dataclasses.replace(MEGA, fwd_fill_stages=stages, fwd_pull_cols=cols)
        assert torch.equal(y0, _run_y(W, T, prob, cfg)), stages


def test_ticket_taken_after_the_release_gives_the_same_rows(monkeypatch):
    # fwd_ticket_ahead=False: the next ticket is taken after the release (sync.signal_take without AHEAD)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 24, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=6, route="random")
    y0 = _run_y(W, T, prob, CFG)
    assert torch.equal(y0, _run_y(W, T, prob, dataclasses.replace(MEGA, fwd_ticket_ahead=False)))
    # ... and with each wait polling on its own (fwd_poll_together=False)
    assert torch.equal(y0, _run_y(W, T, prob, dataclasses.replace(MEGA, fwd_poll_together=False)))


@pytest.mark.parametrize("tile_ready,fill_table", [(False, True), (True, False), (False, False)])
def test_fill_counters_and_address_tables_change_no_output(tile_ready, fill_table, monkeypatch):
    # fwd_tile_ready (per-tile fill counters of a differentiated forward) and fwd_fill_table (address
    # tables loaded whole by a fill): y and every gradient bitwise equal to the defaults (both on), over
    # a 2-slot ring that wraps (every token of both ranks to one expert: 10 row tiles)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 40, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=8, route="one_expert")
    a = _run_tabby(W, T, prob, cfg=MEGA)
    b = _run_tabby(W, T, prob, cfg=dataclasses.replace(MEGA, fwd_tile_ready=tile_ready, fwd_fill_table=fill_table))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    _check(a, _run_reference(prob))


def _launch_saving(p, tile_ready=True, max_iters=1 << 20, zero=True, split=2):
    """_launch with the rows kept (save): xs, g | u and row weights into full-size buffers."""
    ws, sched = p["ws"], p["sched"]
    R, H = sched.row_src.numel(), p["x"].shape[1]
    I = p["w"][0].shape[1]
    save = (p["x"].new_zeros((R, H)), p["x"].new_zeros((R, 2 * I)), torch.zeros(R, dtype=torch.float32))
    megakernel_fwd.launch_fwd_megakernel(
        p["mb"], sched, ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[0:], 0, max_iters, *p["w"],
        gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=2, zero_counters=zero, fill_split=split, save=save,
        w_ptrs=ws.ptrs["w_pub"], tile_ready=tile_ready)
    return save


def test_per_tile_fill_counters_count_each_tile_and_leave_the_slot_counters():
    p = _one_rank(tile_counters=True)  # 80 rows into expert 0: 5 tiles, 2 slots
    xs, _, _ = _launch_saving(p, split=2)
    nt, NS, n_max = int(p["sched"].num_tiles), 2, p["sched"].n_tiles_max
    lay = megakernel_fwd.counter_layout(NS, 0, n_max)
    c = p["mb"].counters
    assert c[lay["tile_ready"]:lay["tile_ready"] + n_max].tolist() == [2] * nt + [0] * (n_max - nt)
    assert c[lay["ready"]:lay["ready"] + NS].tolist() == [0, 0]  # the ring's fill counters: unused
    assert c[lay["gu_done"]:lay["gu_done"] + NS].tolist() == [2 * 3, 2 * 2]  # G = 2 per tile
    p["ws"].check_errors()
    # the kept rows are the rows the per-slot counting keeps (tile_ready=False), bitwise
    q = _one_rank(tile_counters=True)
    assert torch.equal(xs, _launch_saving(q, tile_ready=False, split=2)[0])
    assert torch.equal(p["ws"].y_in, q["ws"].y_in)


def test_per_tile_fill_counter_never_reached_is_an_error_record():
    p = _one_rank(tile_counters=True)
    lay = megakernel_fwd.counter_layout(2, 0, p["sched"].n_tiles_max)
    c = p["mb"].counters
    c.zero_()
    c[lay["tile_ready"] + 1] = -1000  # tile 1 never looks filled: its gate/up tiles time out
    _launch_saving(p, max_iters=50, zero=False)
    rec = p["ws"].err.tolist()
    assert rec[0] == sync.ERR_WAIT_TILE and rec[2] == lay["tile_ready"] + 1
    with pytest.raises(TabbyDeviceError, match="timed out"):
        p["ws"].check_errors()


def test_per_tile_fill_counters_need_their_counters_allocated():
    p = _one_rank()  # alloc_mega without n_tiles
    with pytest.raises(ValueError, match="tile_ready needs"):
        _launch_saving(p)


# ------------------------------------------------------------------------------------------------
# The pass's flags set and waited for inside the kernel (fwd_peer_flags)
# ------------------------------------------------------------------------------------------------

def _launch_peers(p, programs=3, max_iters=1 << 20):
    ws = p["ws"]
    megakernel_fwd.launch_fwd_megakernel(
        p["mb"], p["sched"], ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[FWD:], 0, max_iters, *p["w"],
        gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=programs,
        peers=(ws.ptrs["flags"], ws.flags, FWD_X_READY, FWD_DONE, False))


def test_kernel_sets_x_ready_and_done_after_every_program():
    """Program 0 sets the x-ready flag before any fill; every program counts itself done and the
    last one sets DONE; the rows pushed are those of the launch without flags, bitwise."""
    p = _one_rank()
    ws = p["ws"]
    ws.epoch[FWD] = 5
    _launch_peers(p, programs=3)
    lay = megakernel_fwd.counter_layout(2, 0)
    assert int(p["mb"].counters[lay["programs_done"]]) == 3
    W = 1
    assert int(ws.flags[FWD_X_READY * W]) == 5 and int(ws.flags[FWD_DONE * W]) == 5
    ws.check_errors()
    q = _one_rank()
    _launch(q, programs=3)
    assert int(q["ws"].flags[FWD_DONE * W]) == 0  # without peers the kernel sets no flag
    assert torch.equal(ws.y_in, q["ws"].y_in)


def test_kernel_x_ready_wait_is_bounded():
    """An x-ready flag that never reaches the epoch is an error record naming it, not a hang: here
    the signal table points elsewhere, so program 0's signal never lands on the flag waited for."""
    p = _one_rank()
    ws = p["ws"]
    ws.epoch[FWD] = 3
    # the flags table points this rank's x-ready flag elsewhere: program 0's signal never lands on it
    sink = torch.zeros_like(ws.flags)
    p_ws_flags = torch.tensor([sink.data_ptr()], dtype=torch.int64)
    megakernel_fwd.launch_fwd_megakernel(
        p["mb"], p["sched"], ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[FWD:], 0, 50, *p["w"],
        gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=2,
        peers=(p_ws_flags, ws.flags, FWD_X_READY, FWD_DONE, True))
    rec = ws.err.tolist()
    assert rec[0] == sync.ERR_WAIT_PEER_READY and rec[2] == FWD_X_READY * 1 + 0
    assert int(sink[FWD_X_READY]) == 3 and int(sink[FWD_DONE]) == 3  # what the kernel did set
    with pytest.raises(TabbyDeviceError, match="timed out"):
        ws.check_errors()


# ------------------------------------------------------------------------------------------------
# Local rows read from x by the gate/up tiles (fwd_local_rows, on by default with TMA)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W,route,save,half", [(2, "random", True, True), (2, "one_rank", False, True),
                                               (1, "random", True, False), (2, "one_expert", True, False)])
def test_local_rows_from_x_are_bitwise_the_filled_ones(W, route, save, half, monkeypatch):
    """Gate/up gathering this rank's rows from x (and the fills copying only the others') gives the
    same y and, with saved rows, the same gradients, bitwise: the backward fills the missing rows
    of xs from x. EP2 routings with local and remote rows in one tile, every row local or remote
    (one_rank), one expert; half tiles on and off."""
    _small_tiles(monkeypatch)
    T, H, I, k = 13, 32, 24, 3
    E_local = 2 if W == 2 else 4
    prob = make_problem(W, T, H, I, E_local, k, seed=23, route=route)
    base = dataclasses.replace(MEGA, fwd_tma=True, fwd_save_for_backward=save, ring_rows=4 * CFG.tile_m,
                               fwd_half_tiles=half, fwd_local_rows=False)
    _assert_bitwise_and_right(W, T, prob, base, fwd_local_rows=True)


def _assert_bitwise_and_right(W, T, prob, base, **change):
    """The layer with ``change`` applied to config ``base`` gives base's y and gradients bitwise,
    and the reference's within tolerance."""
    a, b = _run_tabby(W, T, prob, cfg=base), _run_tabby(W, T, prob, cfg=dataclasses.replace(base, **change))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    _check(b, _run_reference(prob))


def test_local_rows_are_off_without_tma_and_left_unfilled_with_it():
    """The launcher turns LOCAL_A on only with TMA operand loads, and reports it; the fills then
    leave this rank's rows of the kept xs unwritten (the backward fills them in)."""
    p = _one_rank(route="random")
    ws, sched = p["ws"], p["sched"]
    ws.w_pub.fill_(0.5)
    R, H = sched.row_src.numel(), p["x"].shape[1]
    I = p["w"][0].shape[1]

    def launch(tma):
        save = (torch.full((R, H), 7.0, dtype=p["x"].dtype), p["x"].new_zeros((R, 2 * I)),
                torch.zeros(R, dtype=torch.float32))
        on = megakernel_fwd.launch_fwd_megakernel(
            p["mb"], sched, ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[0:], 0, 1 << 20, *p["w"],
            x=p["x"], gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=2, save=save, w_ptrs=ws.ptrs["w_pub"],
            tile_ready=False, tma=tma, local_rows=True)
        return on, save

    on, (xs, _, row_w) = launch(tma=False)
    assert not on
    on, (xs, _, row_w) = launch(tma=True)
    assert on
    n = int(sched.num_tiles) * 16
    real = sched.row_src[:n] >= 0  # one rank: every real row is local
    assert real.any() and (xs[:n][real] == 7.0).all()  # not copied
    assert (row_w[:n][real] == 0.5).all()  # their router weights are kept
    ws.check_errors()


# ------------------------------------------------------------------------------------------------
# The next ticket taken before a GEMM's epilogue, its polls before the release (fwd_early_ticket)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W,route,save,half,shared", [(2, "random", True, True, True), (2, "one_expert", False, True, False),
                                                      (1, "random", True, False, True), (2, "one_rank", True, True, False)])
def test_early_ticket_is_bitwise_the_default(W, route, save, half, shared, monkeypatch):
    """Taking the next ticket between a GEMM's K loop and its epilogue and polling it before the
    release changes only when things happen: y and the gradients are bitwise the default's. Ring
    only and saved rows, half tiles on and off, the shared expert's tickets (taken after them),
    a ring of 4 slots that wraps, padding tiles; outputs checked against the reference too."""
    _small_tiles(monkeypatch)
    T, H, I, k = 13, 32, 24, 3
    E_local = 2 if W == 2 else 4
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=29, route=route)
    base = dataclasses.replace(MEGA, fwd_tma=True, fwd_save_for_backward=save, ring_rows=4 * CFG.tile_m,
                               fwd_half_tiles=half, fwd_align_tiles=2)
    _assert_bitwise_and_right(W, T, prob, base, fwd_early_ticket=True)


# ------------------------------------------------------------------------------------------------
# The peers' x pulled whole, no fills, tiles of this rank's rows first (fwd_pull_tokens)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W,route,save,half,shared,early,poll", [
    (2, "random", True, True, False, False, True), (2, "one_rank", False, True, False, False, True),
    (1, "random", True, False, True, False, True), (2, "one_expert", True, False, False, True, True),
    (3, "random", True, True, False, False, True), (2, "random", True, True, True, True, True),
    (2, "random", True, True, False, False, False)])
def test_token_pull_is_bitwise_the_default(W, route, save, half, shared, early, poll, monkeypatch):
    """Gate/up gathering every A row from x or the peers' copied x (no fills), tiles of this rank's
    rows first, gives y and the gradients of the default bitwise (each tile computes the same rows
    in the same K order; only the ticket order and the rows' source buffers differ). EP1, EP2, EP3
    (a rank with other ranks' rows on both sides of its own), every row from one rank, one expert,
    ring only and saved rows (the backward gathers from the tokens), half tiles, the shared expert,
    the early ticket, a ring of 4 slots that wraps, each wait polled on its own (``poll`` False:
    the path where a tile of this rank's rows has a wait of index -1 and no first poll, session
    15's bug); checked against the reference too."""
    _small_tiles(monkeypatch)
    T, H, I, k = 13, 32, 24, 3
    E_local = 2 if W >= 2 else 4
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=37, route=route)
    base = dataclasses.replace(MEGA, fwd_tma=True, fwd_save_for_backward=save, ring_rows=4 * CFG.tile_m,
                               fwd_half_tiles=half, fwd_align_tiles=2, fwd_early_ticket=early,
                               fwd_pull_tokens=False, fwd_poll_together=poll)
    _assert_bitwise_and_right(W, T, prob, base, fwd_pull_tokens=True)


def test_token_pull_with_one_rank_s_x_misaligned(monkeypatch):
    """Every rank takes part in the token pull (the peers' copies wait for its flag), so a rank
    whose x is not 16-byte aligned gathers from an aligned copy instead of falling back to the
    fills alone; y and the gradients stay bitwise those of aligned inputs."""
    _small_tiles(monkeypatch)
    T, H, I, k, W = 13, 32, 24, 3, 2
    prob = make_problem(W, T, H, I, 2, k, seed=41, route="random")
    cfg = dataclasses.replace(MEGA, fwd_tma=True, ring_rows=4 * CFG.tile_m, fwd_pull_tokens=True)
    a = _run_tabby(W, T, prob, cfg=cfg)
    pulls = []
    pull = moe_mod._pull_tokens
    monkeypatch.setattr(moe_mod, "_pull_tokens", lambda ws, *args: pulls.append(ws.rank) or pull(ws, *args))
    b = _run_tabby(W, T, prob, cfg=cfg, misaligned={1})
    assert sorted(pulls) == [0, 1]  # both ranks pulled (the interpreter would not hang on a mismatch)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    _check(b, _run_reference(prob))


def test_token_pull_by_default_only_where_experts_get_many_tiles_per_rank():
    """On by default where experts average PULL_TOKENS_MIN_TILES row tiles per source rank
    (qwen3-30b-a3b 16384 EP2: 8), off below (qwen3.5-397b 4096: 0.6); and only where what it needs holds."""
    from tabby.functional.config import PULL_TOKENS_MIN_TILES, MoEConfig

    cfg = MoEConfig()
    E = 64
    edge = PULL_TOKENS_MIN_TILES * cfg.tile_m * E  # tokens x k at the threshold
    assert cfg.pull_tokens(edge, 1, E) and not cfg.pull_tokens(edge - 1, 1, E)
    args = (16384, 8, 2048, 768, 256)  # qwen3-30b-a3b 16384, 128 experts per rank at EP2
    assert cfg.fwd_pull_tokens is None and cfg.token_pull_on(*args)
    assert not cfg.token_pull_on(4096, 10, 4096, 1024, 512)  # qwen3.5-397b 4096
    assert not dataclasses.replace(cfg, fwd_pull_tokens=False).token_pull_on(*args)
    assert dataclasses.replace(cfg, fwd_pull_tokens=True).token_pull_on(4096, 10, 4096, 1024, 512)
    assert not dataclasses.replace(cfg, fwd_local_rows=False).token_pull_on(*args)
    assert not dataclasses.replace(cfg, fwd_comm_programs=2).token_pull_on(*args)
    assert not cfg.token_pull_on(16384, 8, 2044, 768, 256)  # H % 8


def test_token_pull_wait_is_bounded_and_releases_the_copy_stream():
    """A copy that never lands (``pulled`` never set: a peer that never publishes) is an error record
    naming the counter, not a hang; the last program then sets this rank's FWD_X_PULL flags, so a copy
    stream waiting on them (GPU: ``streamops.wait_geq``, unbounded) goes on. The flags table points
    elsewhere here, so only that release can set this rank's own flags."""
    p = _one_rank(route="random")
    ws = p["ws"]
    T, H = p["x"].shape
    k, E_local = 2, 2
    sched = alloc_schedule(1, T, k, E_local, 16, p["x"].device, order=True)
    launch_schedule(sched, ws.ptrs["idx_pub"], ws.err, 0)
    sink = torch.zeros_like(ws.flags)
    ws.epoch[FWD] = 2
    megakernel_fwd.launch_fwd_megakernel(
        p["mb"], sched, ws.ptrs["x_pub"], ws.ptrs["y_in"], ws.err, ws.epoch[FWD:], 0, 50, *p["w"], x=p["x"],
        gu_cfg=p["gu_cfg"], dn_cfg=p["dn_cfg"], programs=2, tma=True, local_rows=True,
        peers=(torch.tensor([sink.data_ptr()], dtype=torch.int64), ws.flags, FWD_X_READY, FWD_DONE, False),
        tokens=(p["x"].new_zeros((T, H)), FWD_X_PULL))
    lay = megakernel_fwd.counter_layout(p["mb"].n_slots, p["mb"].n_sh, p["mb"].n_tiles)
    rec = ws.err.tolist()
    assert rec[0] == sync.ERR_WAIT_PEER_READY and rec[2] == lay["pulled"] and rec[3] == 1
    assert int(ws.flags[FWD_X_PULL * 1]) == 1  # released by the last program
    # what the last program signalled; the peers' FWD_X_PULL flags are the host stream's, not program 0's
    assert int(sink[FWD_DONE]) == 2 and int(sink[FWD_X_PULL]) == 0
    with pytest.raises(TabbyDeviceError, match="timed out"):
        ws.check_errors()
