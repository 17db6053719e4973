"""The whole Tabby layer (forward and backward) on the CPU: ranks as threads, kernels interpreted.

Each case runs W simulated ranks and compares values and every gradient with the reference
layer on the concatenated inputs (fp32 compute), and checks bitwise determinism.
"""
import pytest
import torch

import tabby
from tabby.functional.config import MoEConfig, Tuning
from tabby.functional.moe import moe

from harness import make_problem, rel_err, run_ranks

SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)  # routed tiles and dispatch blocks
CFG = MoEConfig(megakernel=False, tuning=Tuning(**SMALL))  # the sync-free path


def _run_tabby(W, T, prob, cfg=CFG, E_local=None, misaligned=()):
    """Every rank's y and gradients, concatenated; ranks in ``misaligned`` get an x that starts
    one element past a 16-byte boundary (contiguous, not 16-byte aligned)."""
    x, idx, wts, ws, sh, dy = prob
    E_local = ws[0].shape[0] // W

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        xr = x[rows].clone()
        if r in misaligned:
            buf = xr.new_empty(xr.numel() + 1)
            buf[1:].copy_(xr.flatten())
            xr = buf[1:].view(xr.shape)
            assert xr.is_contiguous() and xr.data_ptr() % 16
        xr.requires_grad_(True)
        wr = wts[rows].clone().requires_grad_(True)
        wl = [w[r * E_local:(r + 1) * E_local].clone().requires_grad_(True) for w in ws]
        shl = [w.clone().requires_grad_(True) for w in sh] if sh is not None else None
        y = moe(xr, idx[rows], wr, *wl, shared=shl, group=group, config=cfg)
        y.backward(dy[rows])
        return dict(y=y.detach(), dx=xr.grad, dw=wr.grad, dws=[w.grad for w in wl],
                    dsh=[w.grad for w in shl] if shl else [])

    res = run_ranks(W, rank_fn)
    out = dict(y=torch.cat([r["y"] for r in res]), dx=torch.cat([r["dx"] for r in res]),
               dw=torch.cat([r["dw"] for r in res]))
    for i in range(3):
        out[f"dw{i}"] = torch.cat([r["dws"][i] for r in res])
    if sh is not None:
        for i in range(3):
            out[f"dsh{i}"] = sum(r["dsh"][i].float() for r in res)
    return out


def _run_reference(prob):
    x, idx, wts, ws, sh, dy = prob
    leaves = [t.clone().requires_grad_(True) for t in (x, wts, *ws, *(sh or ()))]
    y = tabby.moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], shared=leaves[5:] or None)
    y.backward(dy)
    out = dict(y=y.detach(), dx=leaves[0].grad, dw=leaves[1].grad)
    for i in range(3):
        out[f"dw{i}"] = leaves[2 + i].grad
    if sh is not None:
        for i in range(3):
            out[f"dsh{i}"] = leaves[5 + i].grad
    return out


def _check(got, want, tol=2e-2):
    errs = {name: rel_err(got[name], want[name]) for name in want}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errs})"
    return errs


CASES = {
    # name: (W, T, H, I, E_local, k, shared, route)
    "ep1": (1, 9, 32, 24, 3, 2, False, "random"),
    "ep2-shared": (2, 7, 48, 40, 2, 3, True, "random"),
    "ep2-k1": (2, 10, 32, 16, 3, 1, False, "random"),
    "ep2-one-expert": (2, 6, 32, 16, 2, 2, False, "one_expert"),
    "ep2-one-rank": (2, 8, 32, 16, 2, 2, False, "one_rank"),
    "ep4": (4, 5, 32, 16, 2, 2, False, "random"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tabby_cpu_matches_reference(case):
    W, T, H, I, E_local, k, shared, route = CASES[case]
    prob = make_problem(W, T, H, I, E_local, k, shared=shared, seed=hash(case) % 1000, route=route)
    _check(_run_tabby(W, T, prob), _run_reference(prob))


def test_tabby_cpu_bitwise_deterministic_across_calls():
    """The same inputs give the same bits after a call with other inputs (each run its own simulated
    group and workspaces; reuse of one workspace over many calls: tests/test_soak.py)."""
    W, T, H, I, E_local, k = 2, 6, 32, 16, 2, 2
    prob = make_problem(W, T, H, I, E_local, k, seed=5)
    a = _run_tabby(W, T, prob)
    other = make_problem(W, T, H, I, E_local, k, seed=6)  # a different call in between
    _run_tabby(W, T, other)
    b = _run_tabby(W, T, prob)
    for name in a:
        assert torch.equal(a[name], b[name]), name



_MEGA_PULL = MoEConfig(megakernel=True, tuning=Tuning(**SMALL, ring_rows=32, programs=3, tma=True, align_tiles=2,
                                                    pull_tokens=True))


@pytest.mark.parametrize("cfg", [CFG, MoEConfig(megakernel=True, save_for_backward=False,
                                                tuning=Tuning(**SMALL, ring_rows=32, programs=3)), _MEGA_PULL],
                         ids=["sync-free", "mega-recompute", "mega-token-pull"])
def test_backward_buffers_freed_early_give_the_same_bits(cfg, monkeypatch):
    """tabby.moe's eager backward owns the kept rows: it writes dg | du over g | u and frees each
    routed buffer once its last launch is queued, the weight gradients in the order that peaks lower
    (``gate_up_wgrad_first``). Both orders, and the backward operator's (torch.ops.tabby.moe called
    directly: it only reads the kept rows), give the same bits."""
    from tabby.functional import memory
    from tabby.functional.config import config_string
    from tabby.functional.resolve import group_name

    def operator(x, idx, w, wg, wu, wd, shared=None, group=None, config=None):  # its backward reads the rows
        sh = tuple(shared) if shared is not None else (None, None, None)
        return torch.ops.tabby.moe(x, idx, w, wg, wu, wd, *sh, group_name(group), config_string(config), True)[0]

    W, T, H, I, E_local, k = 2, 11, 32, 24, 2, 3
    prob = make_problem(W, T, H, I, E_local, k, seed=41)
    runs = {}
    for first in (True, False):
        monkeypatch.setattr(memory, "gate_up_wgrad_first", lambda *a, first=first: first)
        monkeypatch.setattr(memory, "_CACHE", {})  # (the description reads the order too)
        runs[first] = _run_tabby(W, T, prob, cfg=cfg)
    monkeypatch.setitem(globals(), "moe", operator)  # _run_tabby through the operator called directly
    runs["op"] = _run_tabby(W, T, prob, cfg=cfg)
    for name in runs[True]:
        assert torch.equal(runs[True][name], runs[False][name]), name
        assert torch.equal(runs[True][name], runs["op"][name]), name
    _check(runs[True], _run_reference(prob))

def test_memory_report_sizes_the_worst_case():
    from tabby.functional.memory import memory_report
    from tabby.functional.plan import make_plan
    from tabby.validate import MoEDims

    d = MoEDims(T=16384, H=2048, k=8, E_local=64, I=768, world_size=2, I_shared=0)

    def report(**kw):
        config = MoEConfig(megakernel=kw.pop("megakernel", True), save_for_backward=kw.pop("save", True),
                           tuning=Tuning(**kw))
        return memory_report(make_plan(d, config, torch.device("cpu")))

    rep = report(megakernel=False)
    # Every (token, k) of both ranks plus tile padding per expert, rounded to the tile.
    assert "R_max=270336 rows" in rep and "kept per layer for the backward 1850.1 MiB" in rep
    assert "11.0 MiB ring" in report(ring_rows=2048, save=False)
    rep = report(ring_rows=2048, pull_tokens=False)
    assert "megakernel ring 11.0 MiB" in rep and "keeps 1850.1 MiB per layer" in rep
    # the token pull (on by default here: 16 row tiles per expert and source rank) keeps every
    # rank's tokens [W*T, H] instead of the routed rows [R_max, H] (1056 MiB less, 128 MiB more),
    # and gathers the rows in the backward (no new buffer at the transient's high point: the
    # operator's backward gathers them into dys's buffer, the eager one writes dg|du over g|u; 1056 MiB
    # less than a buffer of their own); the same backward transient as without it
    rep = report(ring_rows=2048)
    assert "keeps 922.1 MiB per layer" in rep and "backward transient 2251.2 MiB" in rep
    # experts of few tiles padded to 2 (align_tiles): one more tile per expert in the worst case
    rep = report(ring_rows=2048, align_tiles=2, pull_tokens=False)
    assert "R_max=278528 rows" in rep and "keeps 1906.1 MiB per layer" in rep


@pytest.mark.parametrize("mega", [False, True])
def test_a_peer_that_never_publishes_x_is_reported(mega, monkeypatch):
    # x has its own ready flag (FWD_X_READY, so that its copy can overlap the schedule): a rank that
    # never raises it must be waited for, boundedly, and named in the error, not read half-copied
    from tabby.functional import steps
    from tabby.functional.workspace import FWD_X_READY, N_SLOTS, TabbyDeviceError

    real = steps._signal
    monkeypatch.setattr(steps, "_signal", lambda ws, slot, *a, **kw: None if (slot == FWD_X_READY and ws.rank == 1)
                        else real(ws, slot, *a, **kw))
    W, T, H, I, E_local, k = 2, 6, 32, 16, 2, 2
    x, idx, wts, ws, _, _ = make_problem(W, T, H, I, E_local, k, seed=7)
    cfg = MoEConfig(megakernel=mega, max_wait_polls=20, debug=True, tuning=Tuning(**SMALL, ring_rows=32))

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        with torch.no_grad():
            return moe(x[rows], idx[rows], wts[rows], *(w[r * E_local:(r + 1) * E_local] for w in ws), group=group,
                       config=cfg)

    with pytest.raises(RuntimeError) as info:
        run_ranks(W, rank_fn)
    err = info.value.__cause__
    assert isinstance(err, TabbyDeviceError) and "publish its inputs" in str(err)
    assert f"flag {FWD_X_READY * W + 1} expected >= 1" in str(err)  # slot FWD_X_READY, source rank 1
    assert FWD_X_READY < N_SLOTS
