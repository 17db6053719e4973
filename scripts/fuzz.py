"""Property-based fuzzing of tabby.moe against tabby.moe_reference, values and every gradient.

Each case is drawn from its seed alone (``draw_case``): the EP size, T (0 and 1 included), H, I,
E_local, k, a shared expert or not, the routing (uniform, Zipf-skewed, every token to one expert,
the experts of one rank left empty, repeated ids in a row), the magnitude of the expert and router
weights, the path (the megakernel or separate launches, keeping the routed rows or recomputing
them), on the CPU the ring size and tile height, and the experts' activation (SwiGLU or GeGLU: the
smooth ones; the clamped kinds' gradients jump at their bounds, tests/test_activation.py; relu2:
no gate), biases and the weights' layout (Tabby's, as its own tensors or as the halves of one fused
gate_up [E, 2I, H] (transformers' plain families); or transposed views of fused tensors, gpt-oss's
interleaved among them; biases, relu2 and the transposed layouts on the path of separate launches,
which runs them). A case passes when y and the gradients of x,
the router weights, the expert weights and the shared expert are within ``TOL`` (relative
Frobenius error) of the reference computed in fp64, with the shapes of the reference's.

    python scripts/fuzz.py --cases 200 --device cuda --out DIR        # one GPU: EP1 cases
    torchrun --nproc-per-node 2 scripts/fuzz.py --cases 100 --device cuda --out DIR   # EP2 over NCCL
    python scripts/fuzz.py --cases 20 --device cpu                    # simulated ranks (threads), interpreter
    python scripts/fuzz.py --seed 1234 --device cpu                   # one case again, from its seed

On the CPU, EP sizes above 1 run as simulated ranks (threads, ``tabby.functional.threads``); on
CUDA without torchrun only EP1 (threads cannot share one GPU's spin-waits), and under torchrun the
EP size is the world size. A failing case prints the command that reproduces it. ``--out DIR``
writes ``fuzz-summary.json`` (per-case results, failures with their seeds) and ``fuzz.log``
(rank 0's). Exit status: 0 when every case passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

# the repository's tabby, also where it is not installed (python scripts/<this>.py from the root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOL = 2e-2  # bf16 in and out against an fp64 reference (the tests' and the benchmark's tolerance)
ROUTES = ("uniform", "zipf", "one_expert", "empty_rank", "duplicates")
GPU_WIDTHS = ((256, 128), (512, 256), (1024, 512), (2048, 768), (200, 72))  # (H, I) on a GPU


@dataclass(frozen=True)
class Case:
    seed: int
    W: int  # EP size
    T: int  # tokens per rank (every rank the same: the layer's contract)
    H: int
    I: int
    E_local: int
    k: int
    shared: bool
    route: str
    expert_scale: float  # expert weights ~ N(0, 1) * scale / sqrt(fan_in)
    router_scale: float  # router weights: softmax of the top-k scores times this, signs random when negative
    megakernel: bool
    save_for_backward: bool
    tile_m: int | None  # None: the heuristic (GPU)
    ring_rows: int | None
    activation: str = "swiglu"  # tabby.Activation kind (smooth ones only; "relu2": no gate)
    biases: bool = False  # the routed experts' biases (the path of separate launches)
    layout: str = "nk"  # the weights as they lie (validate.LAYOUTS, or NK_FUSED; transposed: separate launches)


NK_FUSED = "nk-fused"  # Tabby's layout ("nk") as the halves of one fused gate_up [E, 2I, H]


def draw_case(seed: int, worlds=(1, 2), small: bool = True) -> Case:
    """The case of ``seed``: ``worlds`` the EP sizes to draw from; ``small``: the interpreter's sizes
    and tiles (CPU), else a GPU's (default tiles, larger shapes)."""
    rng = random.Random(seed)
    W = rng.choice(worlds)
    t_max, e_max = (24, 4) if small else (600, 16)
    T = rng.choice([0, 1] + [rng.randint(2, t_max) for _ in range(6)])
    if small:  # widths: mostly multiples of 8 (tensor descriptors need them), sometimes not
        H = 8 * rng.randint(2, 8) if rng.random() < 0.8 else 4 * rng.randint(3, 16) + 2
        I = 8 * rng.randint(1, 6) if rng.random() < 0.8 else 4 * rng.randint(2, 12) + 2
    else:  # a few widths: each one compiles its kernels (they are compile-time constants)
        H, I = rng.choice(GPU_WIDTHS)
    E_local = rng.randint(1, e_max)
    E = W * E_local
    route = rng.choice(ROUTES)
    if route in ("uniform", "zipf"):
        k = rng.randint(1, min(E, 6))
    elif route == "empty_rank":
        free = E - (E_local if W > 1 else E_local // 2)
        if free < 1:
            route, k = "duplicates", rng.randint(1, 4)
        else:
            k = rng.randint(1, min(free, 6))
    else:
        k = rng.randint(1, 6)
    megakernel = rng.random() < 0.5
    tile_m = rng.choice([16, 32]) if small else None
    if not megakernel:
        ring_rows = None
    elif small:  # 2 slots (every slot recycled), 4, or 16
        ring_rows = tile_m * rng.choice([2, 4, 16])
    else:
        ring_rows = rng.choice([None, None, 256, 1024])
    fields = dict(seed=seed, W=W, T=T, H=H, I=I, E_local=E_local, k=k, shared=rng.random() < 0.4, route=route,
                  expert_scale=rng.choice([1.0, 1.0, 1e-3, 30.0]),
                  router_scale=rng.choice([1.0, 1.0, 1e-3, 10.0, -1.0]), megakernel=megakernel,
                  save_for_backward=rng.random() < 0.7, tile_m=tile_m, ring_rows=ring_rows)
    # drawn last, so that every earlier field of a seed stays what it was
    fields.update(activation=rng.choice(["swiglu", "swiglu", "geglu"]), biases=not megakernel and rng.random() < 0.4)
    if not megakernel and not fields["biases"] and rng.random() < 0.3:  # ungated experts (separate launches)
        fields["activation"] = "relu2"
    fields["layout"] = "nk" if megakernel else rng.choice(["nk", "kn", "kn-paired"])
    if fields["activation"] == "relu2" and fields["layout"] == "kn-paired":  # (no gate to interleave with)
        fields["layout"] = "kn"
    if fields["layout"] == "nk" and fields["activation"] != "relu2" and rng.random() < 0.5:  # (drawn last)
        fields["layout"] = NK_FUSED
    return Case(**fields)


def _routing(c: Case, g: torch.Generator):
    """topk_idx [W*T, k] int64 and topk_weights [W*T, k] fp32 of the case's routing."""
    N, E, k = c.W * c.T, c.W * c.E_local, c.k
    if c.route == "uniform":
        scores, idx = torch.randn(N, E, generator=g).topk(k, dim=1)
    else:
        scores = torch.randn(N, k, generator=g)
        if c.route == "zipf":  # expert popularity ~ 1 / rank^1.2 over a random order of the experts
            p = torch.empty(E)
            p[torch.randperm(E, generator=g)] = 1.0 / torch.arange(1, E + 1, dtype=torch.float) ** 1.2
            idx = torch.multinomial(p.expand(N, E), k, replacement=False, generator=g) if N else \
                torch.zeros(0, k, dtype=torch.int64)
        elif c.route == "one_expert":
            e = int(torch.randint(E, (1,), generator=g))
            idx = torch.full((N, k), e, dtype=torch.int64)
        elif c.route == "empty_rank":  # no token of any rank routed to one rank's experts (W = 1: to half of them)
            if c.W > 1:
                r = int(torch.randint(c.W, (1,), generator=g))
                allowed = torch.tensor([e for e in range(E) if e // c.E_local != r])
            else:
                allowed = torch.arange(c.E_local // 2, E)
            pick = torch.rand(N, len(allowed), generator=g).topk(k, dim=1).indices
            idx = allowed[pick]
        elif c.route == "duplicates":  # ids drawn with replacement: a row may name one expert twice
            idx = torch.randint(E, (N, k), generator=g)
        else:
            raise ValueError(c.route)
    wts = torch.softmax(scores, dim=1) * abs(c.router_scale)
    if c.router_scale < 0:
        wts = wts * (torch.randint(2, wts.shape, generator=g) * 2 - 1)
    return idx.to(torch.int64), wts.float()


def make_inputs(c: Case):
    """Global inputs of the case on the CPU: x, idx, weights [W*T, ...], expert weights over
    W*E_local experts, the shared expert or None, dy (all from the seed)."""
    g = torch.Generator().manual_seed(c.seed)
    E = c.W * c.E_local
    x = torch.randn(c.W * c.T, c.H, generator=g).bfloat16()
    idx, wts = _routing(c, g)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * c.expert_scale / shape[-1] ** 0.5).bfloat16()

    experts = (w(E, c.I, c.H), w(E, c.I, c.H), w(E, c.H, c.I))
    I_s = 8 * (1 + c.seed % 3) if c.tile_m is not None else 128  # (GPU: one width, one compile)
    shared = (w(I_s, c.H), w(I_s, c.H), w(c.H, I_s)) if c.shared else None
    dy = torch.randn(c.W * c.T, c.H, generator=g).bfloat16()
    biases = None
    if c.biases:  # (drawn after the rest: a case without biases keeps its inputs)
        biases = tuple((torch.randn(E, n, generator=g) * c.expert_scale).bfloat16() for n in (c.I, c.I, c.H))
    return x, idx, wts, experts, shared, dy, biases


def config_of(c: Case):
    from tabby import MoEConfig, Tuning

    from tabby.activation import Activation

    small = {} if c.tile_m is None else dict(tile_m=c.tile_m, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4)
    ring = {} if c.ring_rows is None else dict(ring_rows=c.ring_rows)
    return MoEConfig(megakernel=c.megakernel, save_for_backward=c.save_for_backward, debug=True,
                     tuning=Tuning(**small, **ring), activation=Activation(c.activation))


GRADS = ("dx", "dtopk", "dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down", "db_gate", "db_up", "db_down")


def reference_results(c: Case, inputs, device="cpu") -> dict:
    """y and every gradient of the whole (all ranks') problem, by the reference in fp64 on
    ``device``; returned on the CPU."""
    import tabby

    from tabby.activation import Activation

    x, idx, wts, experts, shared, dy, biases = inputs
    leaf = lambda t: t.detach().to(device, torch.float64, copy=True).requires_grad_(True)  # noqa: E731
    leaves = [leaf(t) for t in (x, wts, *experts, *(shared or ()))]
    bl = [leaf(t) for t in biases] if biases is not None else None
    act = Activation(c.activation)
    w_gate = leaves[2] if act.gated else None
    y = tabby.moe_reference(leaves[0], idx.to(device), leaves[1], w_gate, *leaves[3:5], shared=tuple(leaves[5:]) or None,
                            compute_dtype=torch.float64, activation=act, biases=bl)
    y.backward(dy.to(device, torch.float64))
    out = dict(y=y.detach(), dx=leaves[0].grad, dtopk=leaves[1].grad, dw_gate=leaves[2].grad,
               dw_up=leaves[3].grad, dw_down=leaves[4].grad)
    if not act.gated:
        del out["dw_gate"]
    if shared is not None:
        out.update(ds_gate=leaves[5].grad, ds_up=leaves[6].grad, ds_down=leaves[7].grad)
    if bl is not None:
        out.update(db_gate=bl[0].grad, db_up=bl[1].grad, db_down=bl[2].grad)
    return {n: t.cpu() for n, t in out.items()}


def rank_results(c: Case, inputs, rank: int, group, device, config=None, layer=None) -> dict:
    """This rank's y and gradients (its tokens, its experts; its tokens' share of the shared
    expert's gradients) from ``tabby.moe`` (``layer``: another with its arguments), on the CPU."""
    import tabby

    layer = layer or tabby.moe

    x, idx, wts, experts, shared, dy, biases = inputs
    rows = slice(rank * c.T, (rank + 1) * c.T)
    ex = slice(rank * c.E_local, (rank + 1) * c.E_local)

    def leaf(t):  # a fresh leaf on the device (the inputs stay as they are for the reference)
        return t.detach().to(device, copy=True).requires_grad_(True)

    xr, wr = leaf(x[rows]), leaf(wts[rows])
    params, weights, weight_grads = laid_out([w[ex] for w in experts], c.layout, leaf)
    if c.activation == "relu2":  # ungated: no w_gate
        weights = (None, *weights[1:])
    sl = [leaf(w) for w in shared] if shared is not None else None
    bl = [leaf(b[ex]) for b in biases] if biases is not None else None
    kw = dict(biases=tuple(bl)) if bl is not None else {}
    y = layer(xr, idx[rows].to(device), wr, *weights, shared=sl, group=group, config=config or config_of(c), **kw)
    y.backward(dy[rows].to(device))
    dw_gate, dw_up, dw_down = weight_grads()
    out = dict(y=y.detach(), dx=xr.grad, dtopk=wr.grad, dw_gate=dw_gate, dw_up=dw_up, dw_down=dw_down)
    if c.activation == "relu2":
        del out["dw_gate"]
    if sl is not None:
        out.update(ds_gate=sl[0].grad, ds_up=sl[1].grad, ds_down=sl[2].grad)
    if bl is not None:
        out.update(db_gate=bl[0].grad, db_up=bl[1].grad, db_down=bl[2].grad)
    return {n: (t.cpu() if t is not None else None) for n, t in out.items()}


def laid_out(experts, layout: str, leaf):
    """(the parameters, the layer's (w_gate, w_up, w_down), a function giving their gradients in
    Tabby's shapes) for the experts (w_gate, w_up [E, I, H], w_down [E, H, I]) stored as ``layout``:
    Tabby's, as they are; ``NK_FUSED`` w_gate and w_up the halves of one gate_up [E, 2I, H]
    (transformers' plain families: each half's experts 2I rows apart); "kn" a gate_up [E, H, 2I]
    (gate columns first) and down [E, I, H]; "kn-paired" the same with g and u interleaved
    (gpt-oss's), the weights views of them."""
    if layout == "nk":
        params = [leaf(w) for w in experts]
        return params, tuple(params), lambda: tuple(p.grad for p in params)
    wg, wu, wd = experts
    I = wg.shape[1]
    if layout == NK_FUSED:
        gate_up, down = leaf(torch.cat([wg, wu], 1)), leaf(wd)
        return [gate_up, down], (*gate_up.unflatten(1, (2, I)).unbind(1), down), lambda: (
            gate_up.grad[:, :I], gate_up.grad[:, I:], down.grad)
    paired = layout == "kn-paired"
    fused = torch.stack([wg, wu], 2).flatten(1, 2) if paired else torch.cat([wg, wu], 1)  # [E, 2I, H]
    gate_up, down = leaf(fused.transpose(1, 2).contiguous()), leaf(wd.transpose(1, 2).contiguous())
    g, u = gate_up.unflatten(2, (I, 2)).unbind(3) if paired else gate_up.unflatten(2, (2, I)).unbind(2)

    def grads():
        d = gate_up.grad.transpose(1, 2)  # [E, 2I, H]
        dg, du = (d[:, 0::2], d[:, 1::2]) if paired else (d[:, :I], d[:, I:])
        return dg, du, down.grad.transpose(1, 2)

    return [gate_up, down], (g.transpose(1, 2), u.transpose(1, 2), down.transpose(1, 2)), grads


def concat_ranks(c: Case, per_rank: list[dict]) -> dict:
    """The ranks' results as one problem's: tokens and experts concatenated in rank order,
    shared-expert gradients summed in rank order."""
    out = {}
    for name in per_rank[0]:
        parts = [r[name] for r in per_rank]
        if any(p is None for p in parts):
            out[name] = None
        elif name.startswith("ds_"):
            out[name] = sum(p.double() for p in parts)
        else:
            out[name] = torch.cat(parts)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(got: dict, want: dict, tol: float = TOL) -> dict:
    """Relative errors of every output; raises AssertionError naming each one that is missing,
    of another shape, not finite where the reference is, or over ``tol``."""
    errs, bad = {}, []
    for name, ref in want.items():
        t = got.get(name)
        if t is None:
            bad.append(f"{name}: no gradient (reference has shape {tuple(ref.shape)})")
            continue
        if tuple(t.shape) != tuple(ref.shape):
            bad.append(f"{name}: shape {tuple(t.shape)}, reference {tuple(ref.shape)}")
            continue
        t, ref = t.double(), ref.double()
        if not torch.equal(torch.isfinite(t), torch.isfinite(ref)):
            bad.append(f"{name}: non-finite values where the reference has none, or the reverse")
            continue
        e = rel_err(t, ref) if ref.numel() else 0.0
        errs[name] = e
        if not e < tol:
            bad.append(f"{name}: relative error {e:.3g} > {tol}")
    if bad:
        raise AssertionError("; ".join(bad))
    return errs


def run_case_simulated(c: Case, device="cpu") -> dict:
    """Run ``c`` on simulated ranks (threads; EP1 directly) and compare with the reference; returns
    the relative errors, raises AssertionError (or the layer's error) on a failure."""
    import tabby
    from tabby.functional.threads import run_ranks

    inputs = make_inputs(c)
    if c.W == 1:
        per_rank = [rank_results(c, inputs, 0, None, device)]
    else:
        per_rank = run_ranks(c.W, lambda r, group: rank_results(c, inputs, r, group, device))
    tabby.check_errors()
    return compare(concat_ranks(c, per_rank), reference_results(c, inputs, device))


def run_case_distributed(c: Case, device, layer=None) -> dict:
    """Run ``c`` with this process as one rank of the default process group (torchrun, CUDA): each
    rank checks its own tokens' and experts' outputs; the shared expert's gradients are summed
    over the ranks first. Every rank raises if any rank failed. ``layer``: instead of ``tabby.moe``."""
    import torch.distributed as dist

    import tabby

    rank = dist.get_rank()
    inputs = make_inputs(c)

    def agree(err):  # a collective: every rank raises if any rank failed
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, err)
        failed = [f for f in flags if f]
        if failed:
            raise AssertionError(" | ".join(failed))

    err, got = None, None
    try:
        got = rank_results(c, inputs, rank, dist.group.WORLD, device, layer=layer)
        tabby.check_errors()
    except Exception as e:  # noqa: BLE001
        err = f"rank {rank}: {type(e).__name__}: {e}"
    agree(err)
    for name in list(got):  # the shared expert's gradients: every rank's tokens' share, summed
        if name.startswith("ds_") and got[name] is not None:
            t = got[name].to(device).double()
            dist.all_reduce(t)
            got[name] = t.cpu()
    err, errs = None, {}
    try:
        want = reference_results(c, inputs, device)
        rows = slice(rank * c.T, (rank + 1) * c.T)
        ex = slice(rank * c.E_local, (rank + 1) * c.E_local)
        mine = {n: (v[rows] if n in ("y", "dx", "dtopk") else v[ex] if n.startswith(("dw_", "db_")) else v)
                for n, v in want.items()}
        errs = compare(got, mine)
    except Exception as e:  # noqa: BLE001
        err = f"rank {rank}: {type(e).__name__}: {e}"
    agree(err)
    return errs


def kernel_kind(c: Case) -> tuple:
    """What decides which kernels a GPU case compiles (their compile-time constants)."""
    return (c.H, c.I, c.megakernel, c.save_for_backward, c.shared, c.ring_rows, c.T == 0, c.activation, c.biases,
            c.layout)


def precompile(seeds, worlds, budget_s: float, say) -> None:
    """Run one case of each kernel kind among ``seeds`` in its own process, up to ``os.cpu_count()``
    at once, so that Triton's cache holds their kernels before the timed cases start (each (H, I)
    pair compiles its kernels: serially, compilation is most of a GPU fuzz's time). A worker that
    fails is only reported here: its case runs again, and is judged, in the main loop."""
    reps = {}
    for seed in seeds:
        reps.setdefault(kernel_kind(draw_case(seed, worlds=worlds, small=False)), seed)
    todo = list(reps.values())
    t0 = time.time()
    running, failed, started = [], 0, 0
    while (todo or running) and time.time() - t0 < budget_s:
        while todo and len(running) < max(1, (os.cpu_count() or 2) - 1):
            seed = todo.pop(0)
            running.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--seed", str(seed),
                                             "--device", "cuda"], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
            started += 1
        time.sleep(0.5)
        for p in [p for p in running if p.poll() is not None]:
            failed += p.returncode != 0
            running.remove(p)
    for p in running:  # over the budget: the main loop compiles what is left
        p.kill()
        p.wait()
    say(f"precompiled: {started - len(running)} of {len(reps)} kernel kinds in {time.time() - t0:.0f} s"
        + (f" ({failed} worker cases failed: they run again below)" if failed else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20, help="cases to run (seeds --first .. --first + cases - 1)")
    ap.add_argument("--first", type=int, default=0, help="seed of the first case")
    ap.add_argument("--seed", type=int, default=None, help="run only the case of this seed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worlds", default="1,2", help="EP sizes to draw on the CPU (simulated ranks)")
    ap.add_argument("--out", default=None, help="folder for fuzz-summary.json and fuzz.log")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no case after this (the summary says how many ran)")
    ap.add_argument("--precompile", type=float, default=300.0, metavar="S",
                    help="one GPU: first compile the kernels the cases need, one case of each kind of "
                         "kernel in parallel processes, for at most S seconds (default 300; 0: none)")
    ap.add_argument("--max-wait-ms", type=float, default=None,
                    help="TABBY_MAX_WAIT_MS for the cases (GPU; a peer's first call compiles kernels)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.max_wait_ms is not None:
        os.environ["TABBY_MAX_WAIT_MS"] = str(args.max_wait_ms)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank = 0
    if distributed:
        import torch.distributed as dist

        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank = dist.get_rank()
        worlds = (dist.get_world_size(),)
        device = torch.device("cuda", local)
    elif args.device == "cpu":
        worlds = tuple(int(w) for w in args.worlds.split(","))
        device = torch.device("cpu")
    else:
        worlds = (1,)
        device = torch.device(args.device)
    small = device.type == "cpu"
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.cases))
    log_lines, results = [], []

    def say(line):
        if rank == 0:
            print(line, flush=True)
        log_lines.append(line)

    t_start = time.time()

    def write_summary(final):
        failed = [r for r in results if not r["ok"]]
        summary = dict(cases=len(results), planned=len(seeds), passed=len(results) - len(failed),
                       failed=len(failed), failed_seeds=[r["case"]["seed"] for r in failed], finished=final,
                       device=str(device), worlds=list(worlds), wall_s=round(time.time() - t_start, 1),
                       torch=torch.__version__, results=results)
        if args.out and rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fuzz-summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
            with open(os.path.join(args.out, "fuzz.log"), "w") as f:
                f.write("\n".join(log_lines) + "\n")
        return summary

    def budget_spent():
        spent = args.time_budget is not None and time.time() - t_start > args.time_budget
        if distributed and args.time_budget is not None:  # every rank stops before the same case
            import torch.distributed as dist

            flag = torch.tensor([int(spent)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            spent = bool(int(flag))
        return spent

    if device.type == "cuda" and not distributed and args.seed is None and args.precompile > 0:
        precompile(seeds, worlds, args.precompile, say)
        t_start = time.time()  # (the cases' budget starts after it)
    for seed in seeds:
        if budget_spent():
            say(f"time budget of {args.time_budget} s spent: {len(results)} of {len(seeds)} cases run")
            break
        c = draw_case(seed, worlds=worlds, small=small)
        t0 = time.time()
        try:
            errs = run_case_distributed(c, device) if distributed else run_case_simulated(c, device)
            ok, detail = True, {n: round(e, 6) for n, e in errs.items()}
        except Exception as e:  # noqa: BLE001 - a failing case is recorded, the next one runs
            ok, detail = False, f"{type(e).__name__}: {e}"
            if rank == 0:
                traceback.print_exc()
            import tabby

            try:  # a case that failed may leave an error record or a desynchronised workspace
                tabby.check_errors()
            except Exception:  # noqa: BLE001
                pass
            tabby.free_workspaces()
        wall = time.time() - t0
        results.append(dict(case=asdict(c), ok=ok, wall_s=round(wall, 2), detail=detail))
        tag = "ok  " if ok else "FAIL"
        say(f"{tag} seed={seed} W={c.W} T={c.T} H={c.H} I={c.I} E_local={c.E_local} k={c.k} shared={c.shared} "
            f"route={c.route} scales={c.expert_scale}/{c.router_scale} megakernel={c.megakernel} "
            f"save={c.save_for_backward} tile_m={c.tile_m} ring_rows={c.ring_rows} activation={c.activation} "
            f"biases={c.biases} layout={c.layout} {wall:.1f}s")
        if not ok:
            launcher = "torchrun --nproc-per-node %d " % worlds[0] if distributed else "python "
            say(f"     {detail}\n     reproduce: {launcher}scripts/fuzz.py --seed {seed} --device {device.type}"
                + ("" if distributed else f" --worlds {','.join(map(str, worlds))}"))
        write_summary(False)  # a run stopped from outside still leaves what it found
    summary = write_summary(True)
    failed = summary["failed"]
    say(f"fuzz: {summary['passed']}/{summary['cases']} cases passed in {summary['wall_s']} s"
        + (f"; failing seeds {summary['failed_seeds']}" if failed else ""))
    write_summary(True)
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
