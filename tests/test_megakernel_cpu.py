"""The forward megakernel (MoEConfig(megakernel=True)) on the CPU: ranks as threads, kernels interpreted.

Values and every gradient against the reference layer; bitwise equality of y with the sync-free
path (same GEMM tiles, same K order per output element) and between variants that change only
when or where things happen; small rings that wrap many times; the launcher's counters, error
records and refusals; the trace. The protocol's pure functions and its interleaving model are in
test_protocol.py; tests/golden pins the default paths' outputs bitwise.
"""
import dataclasses

import pytest
import torch

import tabby
from tabby.functional import forward_mega, heuristics
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.moe import moe_with_probe
from tabby.functional.probe import Probe
from tabby.functional.workspace import (FWD, FWD_DONE, FWD_X_PULL, FWD_X_READY, TabbyDeviceError, Workspace,
                                       WorkspaceKey)
from tabby.ops import comm, megakernel, sync
from tabby.ops.gemm import bf16 as gemm
from tabby.ops.gemm.bf16 import GemmConfig
from tabby.ops.megakernel import MegaPlan, counter_layout
from tabby.ops.schedule import alloc_schedule, launch_schedule

from harness import make_problem, rel_err, run_ranks
from test_moe_cpu import CFG, SMALL, _check, _run_reference, _run_tabby

BM = SMALL["tile_m"]


def mega(**tuning):
    """The megakernel with the small tiles, a grid of 3 and a ring of 2 slots unless ``tuning`` says
    otherwise; debug: the error record checked after every pass (a timed-out wait fails the test)."""
    return MoEConfig(megakernel=True, debug=True, tuning=Tuning(**{**SMALL, "ring_rows": 2 * BM, "programs": 3,
                                                                  **tuning}))


def with_(cfg: MoEConfig, **kw) -> MoEConfig:
    """``cfg`` with its megakernel config (save_for_backward) or tuning fields changed."""
    top = {k: kw.pop(k) for k in ("save_for_backward",) if k in kw}
    return dataclasses.replace(cfg, tuning=dataclasses.replace(cfg.tuning, **kw), **top)


def _small_tiles(monkeypatch, BN=16, BK=16):
    """Several gate/up and down column tiles per row tile (and several K steps), both paths."""
    orig = heuristics.gemm_config
    monkeypatch.setattr(heuristics, "gemm_config", lambda kind, N, K, tile_m: orig(kind, N, K, tile_m).with_(BN=BN,
                                                                                                          BK=BK))


def _run_y(W, T, prob, cfg, trace_events=None):
    """Forward only: y of every rank (concatenated); with ``trace_events``, each rank's ``Probe``
    instead (its plan, and its ticket trace of that many events per program)."""
    x, idx, wts, ws, sh, _ = prob
    E_local = ws[0].shape[0] // W

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        args = (x[rows], idx[rows], wts[rows], *(w[r * E_local:(r + 1) * E_local] for w in ws))
        with torch.no_grad():
            if trace_events is None:
                return tabby.moe(*args, shared=sh, group=group, config=cfg)
            probe = Probe(trace_events=trace_events)
            moe_with_probe(*args, shared=sh, group=group, config=cfg, probe=probe)
            return probe

    res = run_ranks(W, rank_fn)
    return res if trace_events is not None else torch.cat(res)


@pytest.fixture(scope="module")
def sync_free():
    """``sync_free(key, fn)``: ``fn()`` (a run of the sync-free path, which several cases of this file
    compare with) once per ``key`` in this module's tests of one process; the key names the problem
    and the GEMM tiles. The results are only read."""
    runs = {}

    def run(key, fn):
        if key not in runs:
            runs[key] = fn()
        return runs[key]

    return run


def _assert_bitwise_and_right(W, T, prob, base, **change):
    """The layer with ``change`` applied to config ``base`` gives base's y and gradients bitwise,
    and the reference's within tolerance."""
    a, b = _run_tabby(W, T, prob, cfg=base), _run_tabby(W, T, prob, cfg=with_(base, **change))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    _check(b, _run_reference(prob))


# ------------------------------------------------------------------------------------------------
# The layer through the megakernel
# ------------------------------------------------------------------------------------------------

CASES = {
    # name: (W, T, H, I, E_local, k, shared, route, ring slots); tests/golden holds these and more, bitwise
    "ep2-shared": (2, 7, 48, 40, 2, 3, True, "random", 2),
    "ep2-one-rank": (2, 12, 32, 16, 2, 2, True, "one_rank", 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megakernel_matches_reference(case, monkeypatch):
    W, T, H, I, E_local, k, shared, route, slots = CASES[case]
    _small_tiles(monkeypatch)
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=hash(case) % 1000, route=route)
    _check(_run_tabby(W, T, prob, cfg=mega(ring_rows=slots * BM)), _run_reference(prob))


@pytest.mark.parametrize("route,tma", [("random", False), ("one_expert", False), ("one_expert", True)])
def test_megakernel_y_bitwise_equals_sync_free_path(route, tma, monkeypatch, sync_free):
    # 2 slots; one_expert: 2*24*2 = 96 rows -> 6 tiles into expert 0 of rank 0 (the ring wraps 3 times);
    # tma: operands through tensor descriptors (ring slots as TMA coordinates)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 24, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=11, route=route)
    y0 = sync_free(("y", W, T, H, I, E_local, k, 11, route, 16), lambda: _run_y(W, T, prob, CFG))
    assert torch.equal(y0, _run_y(W, T, prob, mega(tma=tma)))


@pytest.mark.parametrize("H,I,cols,tma,save", [(64, 40, 2, False, False), (64, 40, 4, True, False),
                                               (48, 40, 3, True, True)])
def test_down_tickets_of_several_column_tiles(H, I, cols, tma, save, monkeypatch, sync_free):
    # One down ticket (with TMA in one K loop whose epilogue pushes each column tile) runs several
    # column tiles: 3 or 4 per row tile here (H / 16); half tiles on, the ring wraps. Same K order per
    # output element: y is bitwise the sync-free one; with saved rows the gradients match the reference.
    _small_tiles(monkeypatch)
    W, T, E_local, k = 2, 21, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=17, route="random")
    cfg = with_(mega(tma=tma, ring_rows=4 * BM, down_cols=cols), save_for_backward=save)
    assert heuristics.down_cols(I, H // 16, cols) == cols
    y0 = sync_free(("y", W, T, H, I, E_local, k, 17, "random", 16), lambda: _run_y(W, T, prob, CFG))
    assert torch.equal(y0, _run_y(W, T, prob, cfg))
    if save:
        _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))


def test_megakernel_tma_with_shared_expert_matches_reference(monkeypatch):
    # the shared expert through descriptors too: x rows past T read as zeros (x has 9 rows, one 16-row tile)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 9, 32, 24, 3, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=5, route="random")
    _check(_run_tabby(W, T, prob, cfg=mega(tma=True)), _run_reference(prob))


@pytest.mark.parametrize("slots,prefetch,lag,split,group,save", [(2, 0, 1, 4, 1, True), (3, 2, 2, 2, 1, False),
                                                                (6, 0, 1, 1, 3, True)])
def test_megakernel_ring_wraps_many_times_bitwise_deterministic(slots, prefetch, lag, split, group, save,
                                                                monkeypatch, sync_free):
    # every token of every rank to expert 0: 2*40*2 = 160 rows = 10 tiles through a 2-, 3- or 6-slot
    # ring (wraps 5, 3 or 1 times), fills 0 or 2 groups ahead, shared expert, a grid of 4; all outputs
    # and gradients bitwise equal over runs
    _small_tiles(monkeypatch, BN=32, BK=16)
    W, T, H, I, E_local, k = 2, 40, 32, 32, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=3, route="one_expert")
    cfg = with_(mega(programs=4, ring_rows=slots * BM, prefetch=prefetch, down_lag=lag, fill_split=split,
                     group_m=group), save_for_backward=save)  # save: the backward uses what the kernel kept
    a = _run_tabby(W, T, prob, cfg=cfg)
    _check(a, _run_reference(prob))
    b = _run_tabby(W, T, prob, cfg=cfg)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the sync-free path: routed part bitwise equal (no shared here)
    ref = sync_free(("grads", W, T, H, I, E_local, k, 3, "one_expert", 32), lambda: _run_tabby(W, T, prob, cfg=CFG))
    for name in ("dw", "dw0", "dw1", "dw2"):
        assert torch.equal(a[name], ref[name]), name


def test_megakernel_split_mode_runs_when_the_ring_holds_every_tile(monkeypatch):
    # comm_programs=1: program 0 pulls every tile, the others compute. Under the interpreter the
    # programs run in pid order, so the comm program must never wait for a slot: ring >= num_tiles.
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 10, 32, 16, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, shared=True, seed=4)
    cfg = mega(ring_rows=8 * BM, comm_programs=1)
    got = _run_tabby(W, T, prob, cfg=cfg)
    _check(got, _run_reference(prob))
    assert torch.equal(got["y"], _run_tabby(W, T, prob, cfg=with_(cfg, comm_programs=0))["y"])


@pytest.mark.parametrize("save", [True, False])
def test_megakernel_backward_recomputes_only_without_saved_rows(save, monkeypatch):
    # save_for_backward: the kernel fills xs, g|u and the row weights and the backward uses them
    # (no "bwd:recompute" stage); without it the backward replays dispatch and gate/up. Both correct.
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 12, 32, 24, 2, 2
    x, idx, wts, ws, sh, dy = make_problem(W, T, H, I, E_local, k, shared=True, seed=21, route="random")
    cfg = with_(mega(), save_for_backward=save)
    stages = []

    class Marks:
        def mark(self, name):
            stages.append(name)

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        leaves = [t.clone().requires_grad_(True) for t in (x[rows], wts[rows], *(w[r * E_local:(r + 1) * E_local]
                                                                                 for w in ws))]
        y = moe_with_probe(leaves[0], idx[rows], leaves[1], *leaves[2:], shared=sh, group=group, config=cfg,
                           probe=Probe(stage_timer=Marks()))
        y.backward(dy[rows])
        return y.detach()

    ys = run_ranks(W, rank_fn)
    assert rel_err(torch.cat(ys), _run_reference((x, idx, wts, ws, sh, dy))["y"]) < 2e-2
    assert "fwd:megakernel" in stages
    assert ("bwd:recompute" in stages) == (not save)


def _ragged_problem():
    """EP2, two experts per rank with 25, 12, 17 and 22 rows: several tiles of 16 rows, tails of at
    most half a tile and of more. Returns (W, T, problem, rows per global expert)."""
    W, T, H, I, E_local, k = 2, 19, 32, 24, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=0, route="random")
    return W, T, prob, torch.bincount(prob[1].flatten(), minlength=W * E_local).tolist()


@pytest.mark.parametrize("tma", [False, True])
def test_half_tiles_equal_full_tiles_and_match_the_reference(tma, monkeypatch):
    # an expert's last tile with at most tile_m/2 rows is computed as a half-height tile; y is
    # bitwise the same as with full tiles, and the saved rows (padding rows left unwritten) give the
    # reference's gradients
    _small_tiles(monkeypatch)
    W, T, prob, counts = _ragged_problem()
    tails = [c % BM for c in counts]
    assert any(0 < r <= BM // 2 for r in tails) and any(r > BM // 2 for r in tails), counts
    cfg = mega(tma=tma)
    half = _run_y(W, T, prob, cfg)
    _check(_run_tabby(W, T, prob, cfg=cfg), _run_reference(prob))
    monkeypatch.setattr(heuristics, "half_tiles", lambda tile_m, interpret: False)
    assert torch.equal(_run_y(W, T, prob, cfg), half)


@pytest.mark.parametrize("save", [True, False])
def test_padding_tiles_of_aligned_experts_change_nothing(save, monkeypatch):
    # each expert's row tiles padded to a multiple of 1, 2 or 3 (padding tiles are tickets that wait
    # and signal but compute nothing); y is bitwise the same, and the backward (saved rows, or
    # recomputed ones) skips the padding tiles and matches the reference
    _small_tiles(monkeypatch)
    W, T, prob, counts = _ragged_problem()
    assert any(-(-c // BM) % 2 for c in counts), counts  # align 2 pads some expert
    if save:  # (the forward alone once)
        ys = [_run_y(W, T, prob, mega(align_tiles=a)) for a in (1, 3)]
        assert torch.equal(ys[0], ys[1])
    _check(_run_tabby(W, T, prob, cfg=with_(mega(align_tiles=3), save_for_backward=save)), _run_reference(prob))


def test_pipelined_fill_loop_gives_the_same_rows(monkeypatch, sync_free):
    # fill_stages: the fills' column loop as a pipelined tl.range (the interpreter runs it as a plain
    # loop; test_megakernel_compile.py checks that sm_90 gets async copies): y bitwise equal to the
    # sync-free path (which has no fills: the problem and y of test_megakernel_y_bitwise_equals_sync_free_path),
    # with 16-column fill steps (three per row of 48 columns)
    _small_tiles(monkeypatch)
    W, T, H, I, E_local, k = 2, 24, 48, 40, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=11, route="random")
    y0 = sync_free(("y", W, T, H, I, E_local, k, 11, "random", 16), lambda: _run_y(W, T, prob, CFG))
    monkeypatch.setattr(heuristics, "fill_cols", lambda H: 16)
    assert torch.equal(y0, _run_y(W, T, prob, mega(fill_stages=3)))


# ------------------------------------------------------------------------------------------------
# The ticket trace (measurement only: Probe.trace_events)
# ------------------------------------------------------------------------------------------------

def test_trace_records_every_ticket_once(monkeypatch):
    # one rank, program 0 takes every ticket under the interpreter; the recorded kinds count the
    # fills (4 parts per row tile), gate/ups and downs of every row tile, the shared expert's tiles
    # and the order's empty tickets
    _small_tiles(monkeypatch)
    T, H, I, E, k = 21, 32, 24, 3, 2
    prob = make_problem(1, T, H, I, E, k, shared=True, seed=4, route="random")
    probe, = _run_y(1, T, prob, mega(group_m=1), trace_events=256)
    tr, plan = probe.trace, probe.plan
    assert tr is not None and tr.shape == (3, megakernel.TRACE_HEAD.value + 4 * 256)
    n = int(tr[0, 0])
    assert tr[1:, 0].tolist() == [0, 0]  # programs 1, 2 found no ticket left
    codes = tr[0, megakernel.TRACE_HEAD.value:].reshape(256, 4)[:n, 0].tolist()
    a = plan.align_tiles  # each expert's row tiles padded to a multiple of a (padding tiles are tickets too)
    idx = prob[1]
    nt = sum(-(-c // (BM * a)) * a for c in torch.bincount(idx.flatten(), minlength=E).tolist())
    G, D = -(-I // 16), -(-H // 16)  # _small_tiles: 16-column tiles
    D_routed = D // plan.mega.down_cols  # down tickets per row tile (2 column tiles each by default)
    assert D_routed == 1
    n_sh = -(-T // BM)
    kinds = megakernel.TRACE_KINDS
    count = {name: codes.count(c) for c, name in enumerate(kinds)}
    assert (count["fill"], count["gate/up"], count["down"]) == (nt * plan.mega.fill_split, nt * G, nt * D_routed)
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
    probes = _run_y(W, T, prob, mega(group_m=1), trace_events=256)
    idx, k = prob[1], prob[1].shape[1]
    kinds = megakernel.TRACE_KINDS
    for r in range(W):
        tr, plan = probes[r].trace, probes[r].plan
        FS = plan.mega.fill_split
        codes = tr[0, megakernel.TRACE_HEAD.value:].reshape(256, 4)[:int(tr[0, 0]), 0].tolist()
        sched = schedule_reference(idx.reshape(W, T, k), r, E_local, BM, align=plan.align_tiles)
        parts = sched["row_src"][:int(sched["num_tiles"]) * BM].long().reshape(-1, BM // FS)
        remote = ((parts >= 0) & (parts // (T * k) != r)).any(dim=1)
        assert 0 < int(remote.sum()) < len(parts), r  # the case has both kinds on each rank
        assert codes.count(kinds.index("fill remote")) == int(remote.sum()), r
        assert codes.count(kinds.index("fill")) == len(parts) - int(remote.sum()), r


# ------------------------------------------------------------------------------------------------
# Local rows read from x by the gate/up tiles (on by default with TMA), and the token pull
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W,route,save,align", [(2, "random", True, 1), (2, "one_rank", False, 1),
                                                (1, "random", True, 2)])
def test_local_rows_from_x_are_bitwise_the_filled_ones(W, route, save, align, monkeypatch):
    """Gate/up gathering this rank's rows from x (and the fills copying only the others') gives the
    same y and, with saved rows, the same gradients, bitwise: the backward fills the missing rows
    of xs from x. EP2 routings with local and remote rows in one tile, every row local or remote
    (one_rank), one expert; padding tiles."""
    _small_tiles(monkeypatch)
    T, H, I, k = 13, 32, 24, 3
    E_local = 2 if W == 2 else 4
    prob = make_problem(W, T, H, I, E_local, k, seed=23, route=route)
    base = with_(mega(tma=True, ring_rows=4 * BM, local_rows=False, align_tiles=align), save_for_backward=save)
    _assert_bitwise_and_right(W, T, prob, base, local_rows=True)


@pytest.mark.parametrize("W,route,save,shared", [(2, "random", True, False), (2, "one_rank", False, False),
                                                 (1, "random", True, True), (3, "random", True, False)])
def test_token_pull_is_bitwise_the_default(W, route, save, shared, monkeypatch):
    """Gate/up gathering every A row from x or the peers' copied x (no fills), tiles of this rank's
    rows first, gives y and the gradients of the fills bitwise (each tile computes the same rows in
    the same K order; only the ticket order and the rows' source buffers differ). EP1, EP2, EP3 (a
    rank with other ranks' rows on both sides of its own), every row from one rank, one expert, ring
    only and saved rows (the backward gathers from the tokens), half tiles, padding tiles, the shared
    expert, a ring of 4 slots that wraps; checked against the reference too."""
    _small_tiles(monkeypatch)
    T, H, I, k = 13, 32, 24, 3
    E_local = 2 if W >= 2 else 4
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=37, route=route)
    base = with_(mega(tma=True, ring_rows=4 * BM, align_tiles=2, pull_tokens=False), save_for_backward=save)
    _assert_bitwise_and_right(W, T, prob, base, pull_tokens=True)


@pytest.mark.parametrize("pull", [True, False])
def test_one_rank_s_x_misaligned_is_copied_not_a_fallback(pull, monkeypatch):
    """Local rows and the token pull gather A rows from x: a rank whose x is not 16-byte aligned
    gathers from an aligned copy (every rank takes part in the token pull: the peers' copies wait
    for its flag); y and the gradients stay bitwise those of aligned inputs."""
    _small_tiles(monkeypatch)
    T, H, I, k, W = 13, 32, 24, 3, 2
    prob = make_problem(W, T, H, I, 2, k, shared=True, seed=41, route="random")
    cfg = mega(tma=True, ring_rows=4 * BM, pull_tokens=pull)
    a = _run_tabby(W, T, prob, cfg=cfg)
    pulls = []
    orig = forward_mega._pull_tokens
    monkeypatch.setattr(forward_mega, "_pull_tokens", lambda ws, *args: pulls.append(ws.rank) or orig(ws, *args))
    b = _run_tabby(W, T, prob, cfg=cfg, misaligned={1})
    assert sorted(pulls) == ([0, 1] if pull else [])  # both ranks pulled (the interpreter would not hang)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    _check(b, _run_reference(prob))


# ------------------------------------------------------------------------------------------------
# One rank, the launcher directly: counters, error records, refusals
# ------------------------------------------------------------------------------------------------

def _plan(H=32, I=32, slots=2, prefetch=1, fill_split=1, programs=2, **kw) -> MegaPlan:
    """A MegaPlan of 16-row tiles with 16 x 16 GEMM tiles (one group per slot, 8 warps, pointer loads)."""
    cfg = GemmConfig(BM=BM, BN=16, BK=16, num_warps=8, num_stages=3)
    fields = dict(H=H, I=I, I_s=0, tile_m=BM, n_slots=slots, group_m=1, prefetch=prefetch, down_lag=1,
                  fill_split=fill_split, fill_cols=heuristics.fill_cols(H), fill_stages=1, programs=programs,
                  comm_programs=0, num_warps=8, num_stages=3, gate_up=cfg, down=cfg, shared_gate_up=None,
                  shared_down=None, down_cols=1, tma=False, half_tiles=False, local_rows=False, token_pull=False)
    fields.update(kw)
    return MegaPlan(**fields)


def _one_rank(T=40, H=32, I=32, E_local=2, k=2, route="one_expert", order=False, **plan_kw):
    """One rank's workspace, schedule, plan and buffers (default: 80 rows into expert 0: 5 tiles)."""
    x, idx, wts, (wg, wu, wd), _, _ = make_problem(1, T, H, I, E_local, k, seed=0, route=route)
    ws = Workspace(WorkspaceKey(T, H, k, E_local, I, 1, x.dtype, "cpu"), 0)
    ws.x_pub.copy_(x)
    ws.idx_pub.copy_(idx)
    sched = alloc_schedule(1, T, k, E_local, BM, x.device, order=order)
    launch_schedule(sched, ws.ptrs["idx_pub"], ws.err, 0)
    plan = _plan(H=H, I=I, **plan_kw)
    bufs = megakernel.alloc(plan, T, sched.n_tiles_max, x.dtype, x.device)
    peers = megakernel.Peers(x_ptrs=ws.ptrs["x_pub"], y_ptrs=ws.ptrs["y_in"], w_ptrs=ws.ptrs["w_pub"],
                             flag_ptrs=ws.ptrs["flags"], my_flags=ws.flags, x_slot=FWD_X_READY, done_slot=FWD_DONE,
                             x_pull_slot=FWD_X_PULL, done_wait=False)
    return dict(ws=ws, sched=sched, plan=plan, bufs=bufs, w=(wg, wu, wd), x=x, peers=peers, TK=T * k)


def _launch(p, budget=1 << 20, zero=True, **kw):
    ws = p["ws"]
    wg, wu, wd = p["w"]
    args = dict(x=p["x"], w_gate=wg, w_up=wu, w_down=wd, peers=p["peers"], err=ws.err, epoch=ws.epoch[FWD:],
                rank=0, wait_budget=budget, zero_counters=zero)
    args.update(kw)
    megakernel.launch(args.pop("plan", p["plan"]), args.pop("bufs", p["bufs"]), args.pop("sched", p["sched"]), **args)


def _kept(p):
    """Full-size buffers for what a differentiated forward keeps."""
    R, H = p["sched"].row_src.numel(), p["x"].shape[1]
    I = p["w"][0].shape[1]
    return megakernel.Kept(xs=p["x"].new_zeros((R, H)), gu=p["x"].new_zeros((R, 2 * I)),
                           row_w=torch.zeros(R, dtype=torch.float32))


@pytest.mark.parametrize("prefetch,split", [(0, 1), (1, 4)])
def test_megakernel_counters_and_pushed_rows(prefetch, split):
    p = _one_rank(prefetch=prefetch, fill_split=split)  # 80 rows into expert 0: 5 tiles, 2 slots
    _launch(p)
    nt = int(p["sched"].num_tiles)
    assert nt == 5
    NS, G, D = 2, 2, 2  # I / 16, H / 16
    lay = p["bufs"].layout
    c = p["bufs"].counters
    assert c[lay.ready:lay.ready + NS].tolist() == [3 * split, 2 * split]  # tiles 0, 2, 4 in slot 0; 1, 3 in 1
    assert c[lay.gu_done:lay.gu_done + NS].tolist() == [G * 3, G * 2]
    assert c[lay.dn_done:lay.dn_done + NS].tolist() == [D * 3, D * 2]
    assert int(c[lay.ticket]) == prefetch * split + nt * (split + G + D) + 2  # every ticket, one more per program
    assert int(c[lay.programs_done]) == 2
    # the pushed rows equal those of the sync-free launches (pull, gate_up, down_push), bitwise
    sched, ws = p["sched"], p["ws"]
    xs = p["x"].new_empty((sched.R_max, p["x"].shape[1]))
    comm.pull_rows_kernel[(4,)](sched.row_src, sched.num_tiles, ws.ptrs["x_pub"], xs, xs.shape[1], p["TK"], sched.k,
                                ws.ptrs["x_pub"], xs, BR=16, BH=32, WITH_WEIGHTS=False, TILE_ROWS=BM, ROWS_16B=True)
    cfg = p["plan"].gate_up
    h = gemm.gate_up_swiglu(xs, p["w"][0], p["w"][1], sched.tile_expert, sched.num_tiles, config=cfg)
    y_ref = torch.zeros_like(ws.y_in)
    gemm.down_push(h, p["w"][2], sched.tile_expert, sched.num_tiles, sched.row_src,
                   torch.tensor([y_ref.data_ptr()], dtype=torch.int64), p["TK"], config=p["plan"].down)
    assert torch.equal(ws.y_in, y_ref)
    ws.check_errors()


@pytest.mark.parametrize("which,code", [("gu_done", sync.ERR_WAIT_RING_SLOT), ("ready", sync.ERR_WAIT_TILE)])
def test_megakernel_impossible_wait_is_an_error_record(which, code):
    p = _one_rank()
    idx = getattr(p["bufs"].layout, which) + 1
    c = p["bufs"].counters
    c.zero_()
    c[idx] = -1000  # slot 1 can never be filled (gu_done) / never looks filled (ready)
    _launch(p, budget=50, zero=False)  # returns: bounded waits
    rec = p["ws"].err.tolist()
    assert rec[0] == code and rec[2] == idx
    with pytest.raises(TabbyDeviceError, match="timed out"):
        p["ws"].check_errors()


def test_split_mode_under_the_interpreter_refuses_a_ring_smaller_than_the_tiles():
    p = _one_rank(programs=3, comm_programs=1, prefetch=0)  # 5 tiles, 2 slots
    with pytest.raises(ValueError, match="holds every tile"):
        _launch(p)


def test_per_tile_fill_counters_count_each_tile_and_leave_the_slot_counters():
    p = _one_rank(fill_split=2)  # 80 rows into expert 0: 5 tiles, 2 slots
    kept = _kept(p)
    _launch(p, kept=kept)
    nt, NS, n_max = int(p["sched"].num_tiles), 2, p["sched"].n_tiles_max
    lay = p["bufs"].layout
    c = p["bufs"].counters
    assert c[lay.tile_ready:lay.tile_ready + n_max].tolist() == [2] * nt + [0] * (n_max - nt)
    assert c[lay.ready:lay.ready + NS].tolist() == [0, 0]  # the ring's fill counters: unused
    assert c[lay.gu_done:lay.gu_done + NS].tolist() == [2 * 3, 2 * 2]  # G = 2 per tile
    p["ws"].check_errors()
    # the kept rows are the rows the fills of the ring-only forward copy, bitwise; so are the pushed rows
    q = _one_rank(fill_split=2)
    _launch(q)
    assert torch.equal(p["ws"].y_in, q["ws"].y_in)
    real = p["sched"].row_src[:nt * BM] >= 0
    assert torch.equal(kept.xs[:nt * BM][real], p["x"][(p["sched"].row_src[:nt * BM][real] // 2).long()])


def test_per_tile_fill_counter_never_reached_is_an_error_record():
    p = _one_rank()
    idx = p["bufs"].layout.tile_ready + 1
    c = p["bufs"].counters
    c.zero_()
    c[idx] = -1000  # tile 1 never looks filled: its gate/up tiles time out
    _launch(p, budget=50, zero=False, kept=_kept(p))
    rec = p["ws"].err.tolist()
    assert rec[0] == sync.ERR_WAIT_TILE and rec[2] == idx
    with pytest.raises(TabbyDeviceError, match="timed out"):
        p["ws"].check_errors()


def test_kernel_sets_x_ready_and_done_after_every_program():
    """Program 0 sets the x-ready flag before any fill; every program counts itself done and the
    last one sets DONE."""
    p = _one_rank()
    ws = p["ws"]
    ws.epoch[FWD] = 5
    _launch(p, plan=_plan(programs=3))
    assert int(p["bufs"].counters[p["bufs"].layout.programs_done]) == 3
    assert int(ws.flags[FWD_X_READY]) == 5 and int(ws.flags[FWD_DONE]) == 5
    ws.check_errors()


def test_kernel_x_ready_wait_is_bounded():
    """An x-ready flag that never reaches the epoch is an error record naming it, not a hang: here
    the signal table points elsewhere, so program 0's signal never lands on the flag waited for."""
    p = _one_rank()
    ws = p["ws"]
    ws.epoch[FWD] = 3
    sink = torch.zeros_like(ws.flags)
    peers = p["peers"]._replace(flag_ptrs=torch.tensor([sink.data_ptr()], dtype=torch.int64), done_wait=True)
    _launch(p, budget=50, peers=peers)
    rec = ws.err.tolist()
    assert rec[0] == sync.ERR_WAIT_PEER_READY and rec[2] == FWD_X_READY * 1 + 0
    assert int(sink[FWD_X_READY]) == 3 and int(sink[FWD_DONE]) == 3  # what the kernel did set
    with pytest.raises(TabbyDeviceError, match="timed out"):
        ws.check_errors()


def test_local_rows_are_left_unfilled_in_the_kept_rows():
    """With local rows the fills leave this rank's rows of the kept xs unwritten (the backward
    fills them in from x) and still keep their router weights; a plan with local rows but no TMA
    cannot be made."""
    with pytest.raises(ValueError, match="local_rows"):
        _plan(local_rows=True)
    p = _one_rank(route="random", tma=True, local_rows=True)
    ws, sched = p["ws"], p["sched"]
    ws.w_pub.fill_(0.5)
    kept = _kept(p)
    kept.xs.fill_(7.0)
    _launch(p, kept=kept)
    n = int(sched.num_tiles) * BM
    real = sched.row_src[:n] >= 0  # one rank: every real row is local
    assert real.any() and (kept.xs[:n][real] == 7.0).all()  # not copied
    assert (kept.row_w[:n][real] == 0.5).all()  # their router weights are kept
    ws.check_errors()


def test_launcher_refuses_operands_the_plan_cannot_use():
    p = _one_rank(tma=True, local_rows=True)
    wg, wu, wd = p["w"]
    # a TMA operand not 16-byte aligned: the error names it
    buf = torch.empty(wd.numel() + 1, dtype=wd.dtype)
    wd_off = buf[1:].view(wd.shape)
    wd_off.copy_(wd)
    with pytest.raises(ValueError, match="w_down"):
        _launch(p, w_down=wd_off)
    # local rows from an x that is not 16-byte aligned: the caller copies it, the launcher refuses
    xbuf = torch.empty(p["x"].numel() + 1, dtype=p["x"].dtype)
    x_off = xbuf[1:].view(p["x"].shape)
    with pytest.raises(ValueError, match="local_rows"):
        _launch(p, x=x_off)
    # buffers of another plan; tokens without a plan that pulls them
    with pytest.raises(ValueError, match="another plan"):
        _launch(p, bufs=megakernel.alloc(_plan(slots=4), 40, p["sched"].n_tiles_max, p["x"].dtype, p["x"].device))
    with pytest.raises(ValueError, match="token pull"):
        _launch(p, tokens=p["x"].new_zeros(p["x"].shape))
    p["ws"].check_errors()  # nothing launched


def test_token_pull_wait_is_bounded_and_releases_the_copy_stream():
    """A copy that never lands (``pulled`` never set: a peer that never publishes) is an error record
    naming the counter, not a hang; the last program then sets this rank's FWD_X_PULL flags, so a copy
    stream waiting on them (GPU: ``streamops.wait_geq``, unbounded) goes on. The flags table points
    elsewhere here, so only that release can set this rank's own flags."""
    p = _one_rank(route="random", order=True, tma=True, local_rows=True, token_pull=True)
    ws = p["ws"]
    sink = torch.zeros_like(ws.flags)
    ws.epoch[FWD] = 2
    _launch(p, budget=50, peers=p["peers"]._replace(flag_ptrs=torch.tensor([sink.data_ptr()], dtype=torch.int64)),
            tokens=p["x"].new_zeros(p["x"].shape))
    lay = p["bufs"].layout
    rec = ws.err.tolist()
    assert rec[0] == sync.ERR_WAIT_PEER_READY and rec[2] == lay.pulled and rec[3] == 1
    assert int(ws.flags[FWD_X_PULL * 1]) == 1  # released by the last program
    # what the last program signalled; the peers' FWD_X_PULL flags are the host stream's, not program 0's
    assert int(sink[FWD_DONE]) == 2 and int(sink[FWD_X_PULL]) == 0
    with pytest.raises(TabbyDeviceError, match="timed out"):
        ws.check_errors()


def test_counter_layout_of_the_buffers():
    p = _one_rank()
    assert p["bufs"].layout == counter_layout(2, 0, p["sched"].n_tiles_max)
    assert p["bufs"].counters.numel() == p["bufs"].layout.total
