"""The frozen cases of the saved-output test (``test_golden.py``): inputs made by a generator of
their own (so that a change to the shared test helpers cannot change them), and the settings of
each case in the terms of ``tabby.MoEConfig`` / ``tabby.Tuning``.

Every case runs forward and backward on W thread-simulated ranks (or one rank) under the
interpreter; ``golden.pt`` holds y and every gradient, bitwise.
"""
import torch

# name: dict(W, T, H, I, E (local experts), k, shared, route, small (16x16 GEMM tiles), path, tuning)
# tuning keys are ``tabby.Tuning`` fields.
CASES = {
    "mega-ep1-shared": dict(W=1, T=9, H=32, I=24, E=3, k=2, shared=True, route="random", small=True,
                            path="megakernel", tuning=dict(ring_rows=32, programs=3)),
    "mega-ep2-shared": dict(W=2, T=7, H=48, I=40, E=2, k=3, shared=True, route="random", small=True,
                            path="megakernel", tuning=dict(ring_rows=32, programs=3)),
    "mega-ep2-one-expert": dict(W=2, T=20, H=32, I=16, E=2, k=2, shared=False, route="one_expert", small=True,
                                path="megakernel", tuning=dict(ring_rows=32, programs=3)),
    "mega-ep2-one-rank": dict(W=2, T=12, H=32, I=16, E=2, k=2, shared=True, route="one_rank", small=False,
                              path="megakernel", tuning=dict(ring_rows=48, programs=3)),
    "mega-ep2-tma-local-rows": dict(W=2, T=12, H=48, I=40, E=2, k=2, shared=True, route="random", small=True,
                                    path="megakernel", tuning=dict(ring_rows=64, programs=3, tma=True)),
    "mega-ep2-token-pull": dict(W=2, T=24, H=32, I=16, E=2, k=2, shared=True, route="random", small=True,
                                path="megakernel", tuning=dict(ring_rows=32, programs=3, tma=True, pull_tokens=True)),
    "mega-ep2-recompute": dict(W=2, T=7, H=48, I=40, E=2, k=3, shared=True, route="random", small=True,
                               path="megakernel", save_for_backward=False, tuning=dict(ring_rows=32, programs=3)),
    "mega-ep1-split": dict(W=1, T=9, H=32, I=24, E=3, k=2, shared=False, route="random", small=True,
                           path="megakernel", tuning=dict(ring_rows=256, programs=3, comm_programs=1)),
    "mega-ep2-four-warps": dict(W=2, T=21, H=64, I=40, E=2, k=2, shared=False, route="random", small=True,
                                path="megakernel", tuning=dict(ring_rows=64, programs=3, tma=True, num_warps=4,
                                                               fill_stages=3, down_cols=2)),
    "mega-ep4": dict(W=4, T=5, H=32, I=16, E=2, k=2, shared=True, route="random", small=True,
                     path="megakernel", tuning=dict(ring_rows=32, programs=3)),
    "sync-free-ep2-shared": dict(W=2, T=7, H=48, I=40, E=2, k=3, shared=True, route="random", small=True,
                                 path="sync-free", tuning={}),
    "sync-free-ep4-one-expert": dict(W=4, T=5, H=32, I=16, E=2, k=2, shared=False, route="one_expert", small=False,
                                     path="sync-free", tuning={}),
}
# every case: tile_m 16 and the sync-free dispatch's 16-row x 64-column blocks over 4 programs
BASE_TUNING = dict(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)


def make_inputs(W, T, H, I, E, k, shared, route, seed):
    """Global inputs for W ranks: x [W*T, H], idx [W*T, k], weights [W*T, k], expert weights over
    W*E experts, the shared expert or None, dy [W*T, H] (bf16)."""
    g = torch.Generator().manual_seed(seed)
    n, bf = W * E, torch.bfloat16
    x = torch.randn(W * T, H, generator=g).to(bf)
    if route == "random":
        vals, idx = torch.randn(W * T, n, generator=g).topk(k, dim=1)
    elif route == "one_expert":
        idx = torch.zeros(W * T, k, dtype=torch.int64)
        vals = torch.randn(W * T, k, generator=g)
    elif route == "one_rank":
        vals, idx = torch.randn(W * T, E, generator=g).topk(min(k, E), dim=1)
        idx = idx + (W - 1) * E
    else:
        raise ValueError(route)
    wts = torch.softmax(vals, dim=1)
    s = lambda *sz: (torch.randn(*sz, generator=g) / sz[-1] ** 0.5).to(bf)  # noqa: E731
    ws = (s(n, I, H), s(n, I, H), s(n, H, I))
    sh = (s(24, H), s(24, H), s(H, 24)) if shared else None
    dy = torch.randn(W * T, H, generator=g).to(bf)
    return x, idx, wts, ws, sh, dy


def run_case(case, moe, group_of, config):
    """y and every gradient of ``case`` (concatenated over ranks; shared-expert gradients summed in
    rank order): ``moe`` the layer, ``group_of(rank, thread_group)`` the group argument."""
    from harness import run_ranks

    c = CASES[case]
    W, T, E = c["W"], c["T"], c["E"]
    x, idx, wts, ws, sh, dy = make_inputs(W, T, c["H"], c["I"], E, c["k"], c["shared"], c["route"],
                                          seed=sorted(CASES).index(case))

    def rank_fn(r, group):
        rows = slice(r * T, (r + 1) * T)
        xr = x[rows].clone().requires_grad_(True)
        wr = wts[rows].clone().requires_grad_(True)
        wl = [w[r * E:(r + 1) * E].clone().requires_grad_(True) for w in ws]
        shl = [w.clone().requires_grad_(True) for w in sh] if sh is not None else None
        y = moe(xr, idx[rows], wr, *wl, shared=shl, group=group, config=config)
        y.backward(dy[rows])
        return dict(y=y.detach(), dx=xr.grad, dw=wr.grad, dws=[w.grad for w in wl],
                    dsh=[w.grad for w in shl] if shl else [])

    res = run_ranks(W, rank_fn)
    out = {name: torch.cat([r[name] for r in res]) for name in ("y", "dx", "dw")}
    for i in range(3):
        out[f"dw{i}"] = torch.cat([r["dws"][i] for r in res])
        if sh is not None:
            acc = res[0]["dsh"][i].float()
            for r in res[1:]:
                acc = acc + r["dsh"][i].float()
            out[f"dsh{i}"] = acc
    return out
