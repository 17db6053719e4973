"""``tabby bench`` without a GPU: Tabby's layer on the CPU, checked, at EP1, EP2 and EP4.

Tabby's kernels run under the Triton interpreter on CPU tensors, its expert-parallel ranks as
threads of one process (``tabby.functional.threads.run_ranks``), so the whole protocol of both
paths (the forward megakernel, "tabby", and the path of separate launches, "tabby-sync-free")
runs as it does across GPUs. The reference (``moe_reference`` over ranks) and the torch-a2a anchor
run over gloo processes; torch-symm and the floor need a GPU.

For each (shape, EP) one global problem (every rank's tokens, every expert, one shared expert
replicated on every rank) is split among the ranks. Each implementation runs forward and backward
twice on it and is compared with the definition, ``moe_reference`` on the whole problem in fp64:
the relative error (Frobenius) of y and of every gradient (dx, d topk_weights, the expert and
shared-expert weights), and whether the second run repeats the first bit for bit.

The work spreads over a few gloo processes (at least the largest EP): the collectives of the
reference and torch-a2a first, then Tabby's cases, each in one process, longest first. Wall times
are the interpreter's and say nothing about GPU speed; they appear only in the progress lines.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass

import torch

from .check import TOLERANCE
from .launch import launch
from .records import base_record, default_out_dir, file_stem, header_line, machine_info, markdown_table
from .shapes import Shape

CPU_SHAPES = {s.name: s for s in [
    Shape("tiny", 8, 64, 32, 2, I_shared=32),  # a shared expert, run inside the megakernel
    Shape("tiny-top4", 8, 128, 64, 4),  # no shared expert, four experts per token
]}
# EP sizes each shape runs at by default (``--ep`` sets one list for all). The interpreter's cost
# grows with the ranks (the megakernel's two runs at EP4 take about 50 s of one core), so the
# second shape stops at EP2 and the default run stays under two minutes on two cores.
CPU_EPS = {"tiny": (1, 2, 4), "tiny-top4": (1, 2)}
CPU_TOKENS = (32,)  # tokens per rank
CPU_IMPLS = ("reference", "torch-a2a", "tabby", "tabby-sync-free")
GPU_ONLY = ("floor", "torch-symm")
_TABBY_COST = {"tabby": 12.0, "tabby-sync-free": 7.0}  # interpreter seconds per rank (both runs), to share the work

GRAD_NAMES = ("dx", "dtopk_weights", "dw_gate", "dw_up", "dw_down", "dshared_gate", "dshared_up", "dshared_down")


# ----------------------------------------------------------------------------------------------
# One global problem, split among the ranks
# ----------------------------------------------------------------------------------------------

@dataclass
class Problem:
    shape: Shape
    T: int  # tokens per rank
    ep: int
    x: torch.Tensor  # [ep*T, H] bf16
    topk_idx: torch.Tensor  # [ep*T, k]
    topk_weights: torch.Tensor  # [ep*T, k] fp32
    w_gate: torch.Tensor  # [E, I, H] bf16
    w_up: torch.Tensor
    w_down: torch.Tensor  # [E, H, I]
    shared: tuple | None  # the shared expert, replicated on every rank
    dy: torch.Tensor  # [ep*T, H] bf16

    def rank_leaves(self, rank: int) -> list:
        """Rank ``rank``'s differentiable inputs as fresh leaves: x, topk_weights, its experts' weights,
        the shared expert's."""
        t, e = slice(rank * self.T, (rank + 1) * self.T), slice(rank * self.E_local, (rank + 1) * self.E_local)
        parts = [self.x[t], self.topk_weights[t], self.w_gate[e], self.w_up[e], self.w_down[e], *(self.shared or ())]
        return [p.clone().requires_grad_(True) for p in parts]

    @property
    def E_local(self) -> int:
        return self.shape.E // self.ep

    def rank_call(self, fn, rank: int, group, repeats: int = 2) -> list:
        """``repeats`` runs of ``fn`` (moe_reference's signature) forward and backward on rank ``rank``'s
        part: per run {name: tensor} of y and the gradients."""
        t = slice(rank * self.T, (rank + 1) * self.T)
        out = []
        for _ in range(repeats):
            leaves = self.rank_leaves(rank)
            x, tw, wg, wu, wd = leaves[:5]
            shared = tuple(leaves[5:]) or None
            y = fn(x, self.topk_idx[t], tw, wg, wu, wd, shared=shared, group=group)
            grads = torch.autograd.grad(y, leaves, self.dy[t], allow_unused=True, materialize_grads=True)
            out.append(dict(zip(("y",) + GRAD_NAMES, (y.detach(),) + tuple(g.detach() for g in grads))))
        return out

    def assemble(self, per_rank: list) -> dict:
        """The whole problem's y and gradients from every rank's: tokens and experts concatenated,
        the shared expert's gradients summed over ranks."""
        out = {}
        for name in per_rank[0]:
            parts = [r[name] for r in per_rank]
            out[name] = (torch.stack([p.double() for p in parts]).sum(0) if name.startswith("dshared")
                         else torch.cat(parts))
        return out

    def reference(self) -> dict:
        """``moe_reference`` on the whole problem in fp64 (one process): the definition."""
        from tabby.reference import moe_reference

        leaves = [t.double().requires_grad_(True) for t in
                  (self.x, self.topk_weights, self.w_gate, self.w_up, self.w_down, *(self.shared or ()))]
        x, tw, wg, wu, wd = leaves[:5]
        y = moe_reference(x, self.topk_idx, tw, wg, wu, wd, shared=tuple(leaves[5:]) or None,
                          compute_dtype=torch.float64)
        grads = torch.autograd.grad(y, leaves, self.dy.double())
        return dict(zip(("y",) + GRAD_NAMES, (y.detach(),) + tuple(g.detach() for g in grads)))


def make_problem(shape: Shape, T: int, ep: int) -> Problem:
    """The (shape, T, EP) problem, the same in every process (seeded by its name)."""
    from .shapes import make_routing, make_weights

    gen = torch.Generator().manual_seed(zlib.crc32(f"cpu/{shape.name}/{T}/{ep}".encode()))
    x = torch.randn(ep * T, shape.H, generator=gen).to(torch.bfloat16)
    idx, tw = make_routing(ep * T, shape.E, shape.k, generator=gen)
    (wg, wu, wd), sh = make_weights(shape, shape.E, generator=gen)
    dy = torch.randn(ep * T, shape.H, generator=gen).to(torch.bfloat16)
    return Problem(shape, T, ep, x, idx, tw, wg, wu, wd, sh, dy)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def compare(runs: list, ref: dict) -> dict:
    """Errors of the first run against the reference, and which tensors the second run changed."""
    first, second = runs[0], runs[-1]
    errors = {n: rel_err(first[n], ref[n]) for n in first if n in ref}
    changed = [n for n in first if not torch.equal(first[n], second[n])]
    return dict(errors=errors, repeat_changed=changed)


# ----------------------------------------------------------------------------------------------
# The cases and the worker processes
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    shape: Shape
    T: int
    ep: int
    impl: str

    @property
    def cost(self) -> float:
        return self.ep * _TABBY_COST.get(self.impl, 0.1)


def plan_cases(shapes, tokens, eps, impls) -> list:
    """Every (shape, T, EP, impl); ``eps`` None: each shape's ``CPU_EPS``."""
    return [Case(s, T, ep, impl) for s in shapes for T in tokens for ep in (eps or CPU_EPS.get(s.name, (1,)))
            for impl in impls]


def assign(cases: list, workers: int) -> list:
    """Tabby's cases spread over ``workers`` processes, longest first, each to the least loaded."""
    load, out = [0.0] * workers, [[] for _ in range(workers)]
    for c in sorted((c for c in cases if c.impl.startswith("tabby")), key=lambda c: -c.cost):
        w = min(range(workers), key=load.__getitem__)
        load[w] += c.cost
        out[w].append(c)
    return out


def _quiet() -> None:
    """The interpreter's numpy warnings (overflow in padding lanes, scalar conversion) are noise here."""
    warnings.filterwarnings("ignore", module=r"triton\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    torch.set_num_threads(1)


class _Progress:
    """Each process appends its records to its own file and prints a line per record; the line's
    number comes from a file every process appends one byte to."""

    def __init__(self, tmp: str, rank: int, total: int):
        self.path = os.path.join(tmp, f"records-{rank}.jsonl")
        self.counter = os.path.join(tmp, "done")
        self.total = total

    def emit(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        with open(self.counter, "a") as f:
            f.write(".")
        i = os.path.getsize(self.counter)
        print(f"[{i}/{self.total}] {progress_line(rec)}", flush=True)


def _record(case: Case, result: dict | None, error: str | None, wall_s: float) -> dict:
    r = base_record(case.impl, case.shape, case.T, case.ep, "fwd+bwd", "bf16")
    r.update(wall_s=round(wall_s, 2), repeat_bitwise=None, repeat_changed=[])
    if error is not None:
        r.update(correct=False, error=error)
        return r
    r["errors"] = result["errors"]
    r["repeat_changed"] = result["repeat_changed"]
    r["repeat_bitwise"] = not result["repeat_changed"]
    r["correct"] = all(v <= TOLERANCE["bf16"] for v in r["errors"].values())
    return r


def _collective_cases(rank: int, world: int, cases: list, progress: _Progress) -> None:
    """The reference and torch-a2a, over gloo groups of ranks [0, ep); rank 0 compares."""
    import torch.distributed as dist

    from tabby.reference import moe_reference

    from .anchors.torch_a2a import moe_torch_a2a

    fns = {"reference": moe_reference, "torch-a2a": moe_torch_a2a}
    groups = {}
    for ep in sorted({c.ep for c in cases}):  # every rank creates every group, in the same order
        groups[ep] = None if ep == 1 else (dist.group.WORLD if ep == world else dist.new_group(list(range(ep))))
    for case in cases:
        if rank >= case.ep:
            continue
        t0 = time.perf_counter()
        problem = make_problem(case.shape, case.T, case.ep)
        group = groups[case.ep]
        err, runs = None, None
        try:
            runs = problem.rank_call(fns[case.impl], rank, group)
        except Exception as e:  # noqa: BLE001 -- recorded; every rank of the group fails alike
            err = f"{type(e).__name__}: {e}"
        every = [(runs, err)]
        if group is not None:
            every = [None] * case.ep
            dist.all_gather_object(every, (runs, err), group=group)
        if rank != 0:
            continue
        err = next((e for _, e in every if e), None)
        result = None
        if err is None:
            whole = [problem.assemble([r[i] for r, _ in every]) for i in range(2)]
            result = compare(whole, problem.reference())
        progress.emit(_record(case, result, err, time.perf_counter() - t0))


def _tabby_case(case: Case, tuning: str = "") -> dict:
    import tabby
    from tabby.functional.config import MoEConfig, Tuning
    from tabby.functional.threads import run_ranks

    problem = make_problem(case.shape, case.T, case.ep)
    config = MoEConfig(megakernel=case.impl == "tabby", tuning=Tuning.parse(tuning))

    def fn(*args, **kw):
        return tabby.moe(*args, **kw, config=config)

    per_rank = run_ranks(case.ep, lambda rank, group: problem.rank_call(fn, rank, group))
    tabby.check_errors()
    whole = [problem.assemble([runs[i] for runs in per_rank]) for i in range(2)]
    return compare(whole, problem.reference())


def cpu_worker(rank: int, world: int, collective: list, mine: list, tmp: str, total: int, tuning: str) -> None:
    _quiet()
    progress = _Progress(tmp, rank, total)
    _collective_cases(rank, world, collective, progress)
    for case in mine[rank]:
        t0 = time.perf_counter()
        try:
            result, err = _tabby_case(case, tuning), None
        except Exception as e:  # noqa: BLE001 -- recorded, the others go on
            result, err = None, f"{type(e).__name__}: {e}"[:2000]
        progress.emit(_record(case, result, err, time.perf_counter() - t0))


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def _worst_grad(errors: dict) -> tuple:
    grads = {k: v for k, v in errors.items() if k != "y"}
    if not grads:
        return None, None
    name = max(grads, key=grads.get)
    return name, grads[name]


def progress_line(r: dict) -> str:
    head = f"{r['shape']} EP{r['ep']} {r['impl']}:"
    if r.get("error"):
        return f"{head} ERROR {r['error'].splitlines()[0][:300]}  ({r['wall_s']:.1f} s)"
    name, worst = _worst_grad(r["errors"])
    repeat = "repeats bitwise" if r["repeat_bitwise"] else "repeat DIFFERS in " + ", ".join(r["repeat_changed"])
    return (f"{head} y err {r['errors']['y']:.1e}, worst gradient {name} {worst:.1e}, {repeat}, "
            f"{'correct' if r['correct'] else 'WRONG'}  ({r['wall_s']:.1f} s)")


def format_table(records: list) -> str:
    head = ["shape", "T/rank", "EP", "impl", "y err", "worst grad err", "repeat", "correct"]
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["shape"], str(r["tokens_per_gpu"]), str(r["ep"]), r["impl"], "-", "-", "-", "error"])
            continue
        name, worst = _worst_grad(r["errors"])
        rows.append([r["shape"], str(r["tokens_per_gpu"]), str(r["ep"]), r["impl"], f"{r['errors']['y']:.1e}",
                     f"{worst:.1e} ({name})", "bitwise" if r["repeat_bitwise"] else "DIFFERS",
                     "yes" if r["correct"] else "NO"])
    return markdown_table(head, rows, right={1, 2, 4})


def run(cfg) -> dict:
    """The CPU demonstration for a ``bench.Config``: its shapes must be CPU shapes (``CPU_SHAPES``)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the workers: tabby runs on CPU tensors
    t_start = time.perf_counter()
    impls = [n for n in cfg.impls if n in CPU_IMPLS]
    cases = plan_cases(cfg.shapes, cfg.tokens, cfg.eps, impls)
    world = max(max(c.ep for c in cases), min(os.cpu_count() or 1, 4))
    collective = [c for c in cases if not c.impl.startswith("tabby")]
    mine = assign(cases, world)
    skipped = [n for n in cfg.impls if n not in CPU_IMPLS]
    print(f"tabby bench on the CPU ({os.cpu_count()} cores; no GPU found): {len(cases)} checks of forward and "
          f"backward against moe_reference in fp64, each run twice, in {world} processes. Tabby runs under "
          f"the Triton interpreter with simulated ranks (threads); wall times are the interpreter's.",
          flush=True)
    if skipped:
        print(f"(not on the CPU: {', '.join(skipped)} need a GPU)", flush=True)
    if cfg.tuning:
        print(f"tabby rows with Tuning({cfg.tuning})", flush=True)
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    os.environ.update({k: "1" for k in threads})  # one thread per worker process: they share the cores
    try:
        with tempfile.TemporaryDirectory(prefix="tabby-bench-cpu-") as tmp:
            launch(cpu_worker, collective, mine, tmp, len(cases), cfg.tuning, nprocs=world, cpu=True)
            records = []
            for name in sorted(os.listdir(tmp)):
                if name.startswith("records-"):
                    with open(os.path.join(tmp, name)) as f:
                        records += [json.loads(line) for line in f]
    finally:
        for k, v in threads.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    order = {(c.shape.name, c.T, c.ep, c.impl): i for i, c in enumerate(cases)}
    records.sort(key=lambda r: order[(r["shape"], r["tokens_per_gpu"], r["ep"], r["impl"])])
    info = machine_info()
    result = dict(schema="tabby-bench/1", mode="cpu", **info,
                  config=dict(shapes=[s.name for s in cfg.shapes], tokens=cfg.tokens,
                              ep=sorted({c.ep for c in cases}), impls=impls,
                              passes=["fwd+bwd"], dtype="bf16", tolerance=TOLERANCE["bf16"], reference="fp64",
                              tuning=cfg.tuning),
                  dense_matmul=None, dense_matmul_tflops=None, records=records)
    out = cfg.out or default_out_dir()
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, file_stem(info, cfg.tag))
    shapes = "; ".join(f"{s.name}: {s.describe()}" for s in cfg.shapes)
    table = format_table(records)
    legend = (f"Errors: relative (Frobenius) against moe_reference in fp64 on the whole problem, forward (y) and "
              f"the worst gradient; correct: every error <= {TOLERANCE['bf16']:g} (bf16). repeat: a second forward "
              f"and backward gives the same bits. reference: moe_reference over the ranks (fp32 math, bf16 "
              f"results: the rounding floor).")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# tabby bench: {info['machine']}\n\n{header_line(info)}\n\n{shapes}\n\n{legend}\n\n{table}\n")
    wrong = [r for r in records if not r["correct"] or r.get("repeat_bitwise") is False]
    print(f"\n{shapes}\n{legend}\n\n{table}\n")
    print(f"{len(records) - len(wrong)} of {len(records)} checks passed in {time.perf_counter() - t_start:.0f} s. "
          f"Timings need a GPU.", flush=True)
    print(f"wrote {stem}.json, {stem}.md", flush=True)
    if wrong:
        result["failed"] = len(wrong)
    return result
