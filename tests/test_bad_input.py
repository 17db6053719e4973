"""Bad input to tabby.moe, every kind (the table of docs/reliability.md): each gets a clear error,
raised at once on every rank where it can be seen on the host, or recorded on the device and
raised by ``tabby.check_errors`` where seeing it would need a host sync; after it, the next good
call is right. Also what is not an error: T = 0 (an empty result) and non-finite values (they
propagate as in the reference).
"""
import threading

import pytest
import torch

import tabby
from tabby import MoEConfig, MoEInputError, TabbyDeviceError, Tuning
from tabby.functional.threads import run_ranks

from harness import make_problem, rel_err

SMALL = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
PATHS = {"megakernel": MoEConfig(tuning=Tuning(**SMALL, ring_rows=32)),
         "separate": MoEConfig(megakernel=False, tuning=Tuning(**SMALL))}


def _args(T=6, H=32, I=16, E_local=3, k=2, shared=False, seed=0):
    x, idx, wts, ws, sh, _ = make_problem(1, T, H, I, E_local, k, shared=shared, seed=seed)
    return dict(x=x, topk_idx=idx, topk_weights=wts, w_gate=ws[0], w_up=ws[1], w_down=ws[2], shared=sh)


def _shared_wrong(a):
    sh = make_problem(1, 6, 32, 16, 3, 2, shared=True)[4]
    a["shared"] = (sh[0], sh[1][:5], sh[2])


# row of docs/reliability.md -> (how the arguments are spoiled, the error's words)
HOST_CHECKED = {
    "x dtype": (lambda a: a.update(x=a["x"].float()), "x has dtype torch.float32; supported: torch.bfloat16"),
    "weight dtype": (lambda a: a.update(w_up=a["w_up"].half()),
                     "w_up has dtype torch.float16 but x has torch.bfloat16"),
    "topk_idx dtype": (lambda a: a.update(topk_idx=a["topk_idx"].float()), "topk_idx must be int32 or int64"),
    "topk_weights dtype": (lambda a: a.update(topk_weights=a["topk_weights"].long()), "must be floating point"),
    "not a tensor": (lambda a: a.update(w_gate=a["w_gate"].tolist()), "w_gate must be a torch.Tensor, got list"),
    "device": (lambda a: a.update(topk_weights=a["topk_weights"].to("meta")), "all tensors must be on one device"),
    "x shape": (lambda a: a.update(x=a["x"][None]), "x must be [T, H], got shape (1, 6, 32)"),
    "topk_idx rows": (lambda a: a.update(topk_idx=a["topk_idx"][:5]), "topk_idx must be [T=6, k], got shape (5, 2)"),
    "topk_weights shape": (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]),
                           "topk_weights must be [T=6, k=2] like topk_idx"),
    "k = 0": (lambda a: a.update(topk_idx=a["topk_idx"][:, :0], topk_weights=a["topk_weights"][:, :0]),
              "at least one column"),
    "no experts": (lambda a: a.update(w_gate=a["w_gate"][:0], w_up=a["w_up"][:0], w_down=a["w_down"][:0]),
                   "no experts (E_local = 0)"),
    "w_gate hidden": (lambda a: a.update(w_gate=a["w_gate"][:, :, :8]), "w_gate is [E_local, I, H] with H=8"),
    "w_down layout": (lambda a: a.update(w_down=a["w_down"].transpose(1, 2)), "w_down must be [E_local=3, H=32, I=16]"),
    "shared shape": (_shared_wrong, "shared w_up_s must be [I_s=24, H=32]"),
    "config type": (lambda a: a.update(config={"megakernel": False}), "config must be a tabby.MoEConfig"),
}


@pytest.mark.parametrize("row", sorted(HOST_CHECKED))
def test_host_checked_bad_input_raises_input_error(row):
    a = _args()
    spoil, words = HOST_CHECKED[row]
    spoil(a)
    with pytest.raises(MoEInputError) as info:
        tabby.moe(**a)
    assert words in str(info.value)


def _reference(a, dy=None):
    leaves = {n: a[n].detach().clone().requires_grad_(True) for n in ("x", "topk_weights", "w_gate", "w_up", "w_down")}
    y = tabby.moe_reference(leaves["x"], a["topk_idx"], leaves["topk_weights"], leaves["w_gate"], leaves["w_up"],
                            leaves["w_down"], shared=a.get("shared"))
    if dy is not None:
        y.backward(dy)
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _tabby(a, config, dy=None, group=None):
    leaves = {n: a[n].detach().clone().requires_grad_(True) for n in ("x", "topk_weights", "w_gate", "w_up", "w_down")}
    y = tabby.moe(leaves["x"], a["topk_idx"], leaves["topk_weights"], leaves["w_gate"], leaves["w_up"],
                  leaves["w_down"], shared=a.get("shared"), group=group, config=config)
    if dy is not None:
        y.backward(dy)
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _assert_close(got, want):
    (y, g), (y_ref, g_ref) = got, want
    assert rel_err(y, y_ref) < 2e-2
    for n in g_ref:
        assert rel_err(g[n], g_ref[n]) < 2e-2, n


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bad_id", [12, -1])
def test_expert_id_out_of_range_is_a_device_error_then_the_next_call_is_right(path, bad_id):
    a = _args(E_local=4, seed=3)
    bad = dict(a, topk_idx=a["topk_idx"].clone())
    bad["topk_idx"][4, 1] = bad_id
    tabby.check_errors()  # nothing pending from earlier tests
    with torch.no_grad():
        tabby.moe(**bad, config=PATHS[path])  # no host sync: the id is checked on the device
    with pytest.raises(TabbyDeviceError, match=rf"expert id {bad_id} at flat position 9 .* outside \[0, E=4\)"):
        tabby.check_errors()
    tabby.check_errors()  # the record was cleared
    dy = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    _assert_close(_tabby(a, PATHS[path], dy), _reference(a, dy))
    tabby.check_errors()


@pytest.mark.parametrize("path", list(PATHS))
def test_expert_id_out_of_range_at_ep2_is_raised_on_every_rank_then_the_next_call_is_right(path):
    W, T, H, I, E_local, k = 2, 5, 32, 16, 2, 2
    x, idx, wts, ws, _, dy = make_problem(W, T, H, I, E_local, k, seed=4)
    bad_idx = idx.clone()
    bad_idx[T + 2, 0] = 4  # rank 1's token 2: E = 4
    cfg = MoEConfig(megakernel=PATHS[path].megakernel, debug=True, tuning=PATHS[path].tuning)

    def rank_fn(r, group):
        rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
        a = dict(x=x[rows], topk_idx=bad_idx[rows], topk_weights=wts[rows], w_gate=ws[0][ex], w_up=ws[1][ex],
                 w_down=ws[2][ex])
        try:
            with torch.no_grad():
                tabby.moe(**a, group=group, config=cfg)
            err = None
        except TabbyDeviceError as e:
            err = str(e)
        good = _tabby(dict(a, topk_idx=idx[rows]), cfg, dy[rows], group=group)
        return err, good

    res = run_ranks(W, rank_fn)
    for r, (err, _) in enumerate(res):  # every rank's schedule reads every rank's routing
        assert err is not None and "expert id 4" in err and "outside [0, E=4)" in err, (r, err)
    a = dict(x=x, topk_idx=idx, topk_weights=wts, w_gate=ws[0], w_up=ws[1], w_down=ws[2])
    y_ref, g_ref = _reference(a, dy)
    y = torch.cat([g[0] for _, g in res])
    assert rel_err(y, y_ref) < 2e-2
    assert rel_err(torch.cat([g[1]["x"] for _, g in res]), g_ref["x"]) < 2e-2
    assert rel_err(torch.cat([g[1]["w_down"] for _, g in res]), g_ref["w_down"]) < 2e-2


def _spawn_each(W, fn):
    """Run ``fn(rank, group)`` on W simulated ranks; returns each rank's result or raised error."""
    def body(r, group):
        try:
            return fn(r, group)
        except Exception as e:  # noqa: BLE001 - the test looks at each rank's error
            return e

    return run_ranks(W, body, timeout=120)


MISMATCH = {  # what rank 1 passes differently -> (T, H, E_local, I) of rank 1
    "T": (7, 32, 2, 16), "H": (5, 48, 2, 16), "E_local": (5, 32, 3, 16), "I": (5, 32, 2, 24),
    "T = 0 on one rank": (0, 32, 2, 16),
}


@pytest.mark.parametrize("row", list(MISMATCH))
def test_ranks_that_disagree_on_shapes_raise_on_every_rank(row):
    shapes = {0: (5, 32, 2, 16), 1: MISMATCH[row]}
    cfg = PATHS["separate"]

    def rank_fn(r, group):
        T, H, E_local, I = shapes[r]
        a = _args(T=T, H=H, I=I, E_local=E_local, seed=r)
        a["topk_idx"] = a["topk_idx"] % (2 * E_local) if T else a["topk_idx"]
        with torch.no_grad():
            return tabby.moe(**a, group=group, config=cfg)

    for r, e in enumerate(_spawn_each(2, rank_fn)):
        assert isinstance(e, MoEInputError) and "disagree on the layer's shapes" in str(e), (r, e)
        assert f"rank 1: T={shapes[1][0]}, H={shapes[1][1]}" in str(e)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("W", [1, 2])
def test_no_tokens_gives_an_empty_result_and_gradients(path, W):
    """T = 0 on every rank (ranks agree on T): y [0, H], dx [0, H], router-weight gradients [0, k],
    zero weight gradients, as the reference; the call takes part in the group's shape agreement."""
    H, I, E_local, k = 32, 16, 2, 2

    def one_rank(r, group):
        a = _args(T=0, H=H, I=I, E_local=E_local, k=k, shared=True, seed=r)
        sh = tuple(t.clone().requires_grad_(True) for t in a["shared"])
        leaves = {n: a[n].clone().requires_grad_(True) for n in ("x", "topk_weights", "w_gate", "w_up", "w_down")}
        y = tabby.moe(leaves["x"], a["topk_idx"], leaves["topk_weights"], leaves["w_gate"], leaves["w_up"],
                      leaves["w_down"], shared=sh, group=group, config=PATHS[path])
        y.float().sum().backward()
        return y, {n: t.grad for n, t in leaves.items()}, [t.grad for t in sh], leaves, sh, a

    res = [one_rank(0, None)] if W == 1 else run_ranks(W, one_rank)
    for y, grads, sh_grads, leaves, sh, a in res:
        assert y.shape == (0, H) and y.dtype == torch.bfloat16
        ref = tabby.moe_reference(leaves["x"], a["topk_idx"], leaves["topk_weights"], leaves["w_gate"],
                                  leaves["w_up"], leaves["w_down"], shared=sh)
        assert ref.shape == y.shape
        assert grads["x"].shape == (0, H) and grads["topk_weights"].shape == (0, k)
        for n in ("w_gate", "w_up", "w_down"):
            assert grads[n].shape == leaves[n].shape and not grads[n].any(), n
        assert all(g is not None and g.shape == t.shape and not g.any() for g, t in zip(sh_grads, sh))


def _finite_rows(t):
    return torch.isfinite(t.float()).all(dim=1)


@pytest.mark.parametrize("path", list(PATHS))
def test_non_finite_values_propagate_as_in_the_reference(path):
    """NaN or Inf in x, and NaN in a router weight, are not errors: they reach the rows of y (and
    of dx) that the reference's reach, and no other row; the other rows match the reference."""
    a = _args(T=8, E_local=4, seed=9)
    a["x"] = a["x"].clone()
    a["x"][1, 3] = float("nan")
    a["x"][5, 0] = float("inf")
    a["topk_weights"] = a["topk_weights"].clone()
    a["topk_weights"][6, 1] = float("nan")
    dy = torch.randn(8, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    y, g = _tabby(a, PATHS[path], dy)
    y_ref, g_ref = _reference(a, dy)
    tabby.check_errors()
    ok = _finite_rows(y_ref)
    assert ok.tolist() == [True, False, True, True, True, False, False, True]
    assert torch.equal(_finite_rows(y), ok)
    assert rel_err(y[ok], y_ref[ok]) < 2e-2
    # the backward: the same rows of dx, the same experts' weight gradients, are not finite
    assert torch.equal(_finite_rows(g["x"]), _finite_rows(g_ref["x"])) and not _finite_rows(g_ref["x"]).all()
    fin = _finite_rows(g_ref["x"])
    assert rel_err(g["x"][fin], g_ref["x"][fin]) < 2e-2
    for n in ("w_gate", "w_up", "w_down"):
        per_expert = lambda t: torch.isfinite(t.float()).flatten(1).all(dim=1)  # noqa: E731
        assert torch.equal(per_expert(g[n]), per_expert(g_ref[n])), n
    # the workspace is unharmed: a finite call after it is right
    b = _args(T=8, E_local=4, seed=10)
    with torch.no_grad():
        assert rel_err(tabby.moe(**b, config=PATHS[path]), tabby.moe_reference(**b)) < 2e-2


def test_thread_helper_sees_every_rank():
    """(The helper above returns every rank's error, not only the first.)"""
    seen = []
    lock = threading.Lock()

    def fn(r, group):
        with lock:
            seen.append(r)
        raise MoEInputError(f"rank {r}")

    res = _spawn_each(3, fn)
    assert sorted(seen) == [0, 1, 2] and [str(e) for e in res] == ["rank 0", "rank 1", "rank 2"]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_rank_without_tokens_pads_to_the_group_T_with_weight_0_tokens(path):
    """The recipe of docs/reliability.md for a rank with no tokens of its own in a group whose
    other ranks have some (ranks must agree on T): pass T zero tokens routed with weight 0 to a
    local expert. Its output rows are 0; the other ranks' y is bitwise what it is with any tokens on
    that rank; the weight gradients are the reference's on the other ranks' tokens alone."""
    W, T, H, I, E_local, k = 2, 6, 32, 16, 2, 2
    x, idx, wts, ws, _, dy = make_problem(W, T, H, I, E_local, k, seed=12)
    pad_x, pad_idx, pad_w = x.new_zeros(T, H), torch.full((T, k), E_local, dtype=idx.dtype), wts.new_zeros(T, k)

    def run(padded):
        def rank_fn(r, group):
            rows, ex = slice(r * T, (r + 1) * T), slice(r * E_local, (r + 1) * E_local)
            a = dict(x=x[rows], topk_idx=idx[rows], topk_weights=wts[rows], w_gate=ws[0][ex], w_up=ws[1][ex],
                     w_down=ws[2][ex])
            if padded and r == 1:
                a.update(x=pad_x, topk_idx=pad_idx, topk_weights=pad_w)
            d = torch.zeros_like(dy[rows]) if padded and r == 1 else dy[rows]  # padding rows get no gradient
            return _tabby(a, PATHS[path], d, group=group)

        return run_ranks(W, rank_fn)

    real, padded = run(False), run(True)
    assert torch.equal(real[0][0], padded[0][0])  # rank 0's y
    assert not padded[1][0].any()
    a0 = dict(x=x[:T], topk_idx=idx[:T], topk_weights=wts[:T], w_gate=ws[0], w_up=ws[1], w_down=ws[2])
    y_ref, g_ref = _reference(a0, dy[:T])  # rank 0's tokens alone, over both ranks' experts
    assert rel_err(padded[0][0], y_ref) < 2e-2
    assert rel_err(padded[0][1]["x"], g_ref["x"]) < 2e-2
    for n in ("w_gate", "w_up", "w_down"):
        got = torch.cat([padded[0][1][n], padded[1][1][n]])
        assert rel_err(got, g_ref[n]) < 2e-2, n
    assert not padded[1][1]["x"].any() and not padded[1][1]["topk_weights"].any()
