"""Soak: thousands of forward + backward calls of tabby.moe with changing routings, checking that
the layer stays right over a long run.

Per call: one of ``--inputs`` prepared input sets (each its own routing: uniform, Zipf-skewed,
every token to one expert, one rank's experts left empty, repeated ids; drawn in a seeded order),
on one of the configurations (the megakernel, the megakernel recomputing the rows in the backward,
the path of separate launches), forward and backward. Checked:

- repeatability: y and every gradient bitwise equal to the first result of the same inputs and
  configuration;
- no device error: ``tabby.check_errors()`` every ``--check-every`` calls and at the end;
- no memory growth (CUDA): ``torch.cuda.memory_allocated`` at the checkpoints of the last third
  of the run no higher than in the first third (after the warm-up: every input set and
  configuration once), and the same for the peak of each window of calls
  (``max_memory_allocated``); ``memory_growth``.

    python scripts/soak.py --calls 5000 --out DIR                    # one GPU
    torchrun --nproc-per-node 2 scripts/soak.py --calls 3000 --out DIR  # EP2 over NCCL
    python scripts/soak.py --calls 12 --device cpu --T 8 --H 32 --I 16 --E 4 --k 2   # the logic, on the CPU

Writes ``soak-summary.json`` and ``soak.log`` to ``--out`` (rank 0). Exit status 0 when every check
passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

# the repository's tabby, also where it is not installed (python scripts/<this>.py from the root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUTES = ("uniform", "zipf", "one_expert", "empty_rank", "duplicates")
CONFIGS = ("megakernel", "recompute", "separate")
MEMORY_SLACK = 1 << 20  # bytes of allocator rounding allowed in the memory checks


def config_of(name: str, small: bool):
    from tabby import MoEConfig, Tuning

    tuning = Tuning(tile_m=16, dispatch_rows=16, dispatch_cols=64, dispatch_programs=4,
                    **({"ring_rows": 32} if name != "separate" else {})) if small else Tuning()
    return MoEConfig(megakernel=name != "separate", save_for_backward=name != "recompute", tuning=tuning)


def make_inputs(n: int, route: str, T: int, H: int, E: int, k: int, W: int, rank: int, device):
    """Input set ``n``: x, topk_idx, topk_weights, dy of this rank (routing ``route`` over E experts)."""
    g = torch.Generator().manual_seed(1000 * n + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    if route == "uniform":
        scores, idx = torch.randn(T, E, generator=g).topk(k, dim=1)
    else:
        scores = torch.randn(T, k, generator=g)
        if route == "zipf":
            p = 1.0 / torch.arange(1, E + 1, dtype=torch.float)[torch.randperm(E, generator=g)] ** 1.2
            idx = torch.multinomial(p.expand(T, E), k, replacement=False, generator=g)
        elif route == "one_expert":
            idx = torch.full((T, k), n % E, dtype=torch.int64)
        elif route == "empty_rank":  # the experts of rank n % W (W = 1: the first half) get no token
            E_local = E // W
            skip = set(range((n % W) * E_local, (n % W + 1) * E_local)) if W > 1 else set(range(E // 2))
            allowed = torch.tensor([e for e in range(E) if e not in skip])
            idx = allowed[torch.rand(T, len(allowed), generator=g).topk(min(k, len(allowed)), dim=1).indices]
            if idx.shape[1] < k:
                idx = torch.cat([idx, idx[:, :k - idx.shape[1]]], dim=1)
        else:  # duplicates
            idx = torch.randint(E, (T, k), generator=g)
    wts = torch.softmax(scores, dim=1)
    dy = torch.randn(T, H, generator=g).bfloat16()
    return [t.to(device) for t in (x, idx, wts.float(), dy)]


def memory_growth(allocated: list, peaks: list, baseline: int) -> tuple:
    """(growth of the allocated bytes, growth of the windows' peaks) over a run's checkpoints.

    The bytes held at a checkpoint may depend on which configuration ran last (a cache of one
    configuration's buffers); a leak grows with the calls. So with three checkpoints or more the
    largest value of the last third is compared with the largest of the first third; with fewer,
    the largest with the value after the warm-up (allocated) and with the first window (peaks)."""
    if len(allocated) >= 3:
        n = max(1, len(allocated) // 3)
        return max(allocated[-n:]) - max(allocated[:n]), max(peaks[-n:]) - max(peaks[:n])
    return max(allocated) - baseline, max(peaks) - peaks[0]


def one_call(layer, inputs, weights, group, config):
    """y and the gradients of x, the router weights and the expert weights of one call."""
    x, idx, wts, dy = inputs
    xl, wl = x.detach().requires_grad_(True), wts.detach().requires_grad_(True)
    y = layer(xl, idx, wl, *weights, group=group, config=config)
    grads = torch.autograd.grad(y, (xl, wl, *weights), dy)
    return (y.detach(),) + tuple(grads)


def run(args, layer=None) -> dict:
    """The soak of ``args`` (``parse_args``); ``layer`` replaces ``tabby.moe`` (tests). Returns the summary."""
    import tabby

    layer = layer or tabby.moe
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank, W, group = 0, 1, None
    if distributed:
        import torch.distributed as dist

        for key, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(key, val)
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank, W, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
        device = torch.device("cuda", local)
    else:
        device = torch.device(args.device)
    cuda = device.type == "cuda"
    small = not cuda
    E = args.E
    if E % W:
        raise SystemExit(f"--E {E} must be a multiple of the world size {W}")
    E_local = E // W
    g = torch.Generator().manual_seed(7 + rank)
    weights = [(torch.randn(*s, generator=g) / s[-1] ** 0.5).bfloat16().to(device).requires_grad_(True)
               for s in ((E_local, args.I, args.H), (E_local, args.I, args.H), (E_local, args.H, args.I))]
    input_sets = [make_inputs(n, ROUTES[n % len(ROUTES)], args.T, args.H, E, args.k, W, rank, device)
                  for n in range(args.inputs)]
    names = [c for c in args.configs.split(",") if c]
    configs = {n: config_of(n, small) for n in names}
    pairs = [(c, n) for c in names for n in range(args.inputs)]
    order = random.Random(args.seed)  # the same order on every rank
    lines = []

    def say(line):
        lines.append(line)
        if rank == 0:
            print(line, flush=True)

    first: dict = {}
    mismatches, errors, raised = [], [], []
    memory = dict(checked=cuda, baseline=None, checkpoints=[], window_peaks=[])
    t_start = time.time()
    say(f"soak: {args.calls} calls, T={args.T} H={args.H} I={args.I} E={E} k={args.k} EP{W}, configs {names}, "
        f"{args.inputs} input sets, device {device}")
    done = 0
    for i in range(args.calls):
        done = i + 1
        c, n = pairs[i] if i < len(pairs) else order.choice(pairs)  # every pair once first (the warm-up)
        # After an exception this rank calls no more; it still meets its peers at the next
        # checkpoint, where every rank stops (a rank that left would make its peers' calls time out).
        out = None
        if not raised:
            try:
                out = one_call(layer, input_sets[n], weights, group, configs[c])
            except Exception as e:  # noqa: BLE001 - recorded; the run stops at the next checkpoint
                raised.append(dict(call=i, config=c, inputs=n, error=f"{type(e).__name__}: {e}"))
                say(f"call {i}: {c} on input set {n} raised {type(e).__name__}: {e}")
        ref = first.get((c, n))
        if out is None:
            pass
        elif ref is None:
            first[(c, n)] = out
        elif not all(torch.equal(a, b) for a, b in zip(out, ref)):
            which = [nm for nm, a, b in zip(("y", "dx", "dtopk", "dw_gate", "dw_up", "dw_down"), out, ref)
                     if not torch.equal(a, b)]
            mismatches.append(dict(call=i, config=c, inputs=n, differs=which))
            say(f"call {i}: {c} on input set {n} differs from its first result in {which}")
        del out
        last = i == args.calls - 1
        if (i + 1) % args.check_every == 0 or last or i + 1 == len(pairs):
            try:
                tabby.check_errors()
            except tabby.TabbyDeviceError as e:
                errors.append(dict(call=i, error=str(e)))
                say(f"call {i}: device error: {e}")
            if cuda:
                torch.cuda.synchronize(device)
                alloc, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                if i + 1 == len(pairs):
                    memory["baseline"] = alloc  # after the warm-up: every first result is held
                else:
                    memory["checkpoints"].append(dict(call=i, allocated=alloc))
                    memory["window_peaks"].append(peak)
            say(f"call {i + 1}/{args.calls}: {len(mismatches)} mismatches, {len(errors)} device errors"
                + (f", allocated {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB" if cuda else "")
                + f", {time.time() - t_start:.0f} s")
            if not last:
                spent = (args.time_budget is not None and i + 1 >= len(pairs)
                         and time.time() - t_start > args.time_budget)
                stop = torch.tensor([int(spent) + 2 * int(bool(raised or errors))], device=device)
                if distributed:  # every rank stops at the same call
                    import torch.distributed as dist

                    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if int(stop) >= 2:
                    say(f"stopped after {i + 1} calls: a rank raised or recorded a device error")
                    break
                if int(stop) == 1:
                    say(f"time budget of {args.time_budget} s spent after {i + 1} calls")
                    break
    growth = None
    peak_growth = None
    if cuda and memory["checkpoints"] and memory["baseline"] is not None:
        growth, peak_growth = memory_growth([cp["allocated"] for cp in memory["checkpoints"]],
                                            memory["window_peaks"], memory["baseline"])
    memory.update(growth_bytes=growth, peak_growth_bytes=peak_growth)
    memory_ok = growth is None or (growth <= MEMORY_SLACK and peak_growth <= MEMORY_SLACK)
    ok = not mismatches and not errors and not raised and memory_ok
    if distributed:
        import torch.distributed as dist

        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        ok = int(flag) == 0
    summary = dict(ok=ok, calls=done, planned_calls=args.calls, rank=rank, world_size=W, device=str(device),
                   shape=dict(T=args.T, H=args.H, I=args.I, E=E, k=args.k), configs=names, input_sets=args.inputs,
                   mismatches=mismatches[:50], mismatch_count=len(mismatches), device_errors=errors[:50],
                   raised=raised[:50],
                   memory=memory, memory_ok=memory_ok, wall_s=round(time.time() - t_start, 1),
                   torch=torch.__version__)
    say(f"soak {'passed' if ok else 'FAILED'}: {len(mismatches)} mismatches, {len(errors)} device errors, "
        f"{len(raised)} exceptions, "
        f"memory growth {growth} bytes, peak growth {peak_growth} bytes, {summary['wall_s']} s")
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak-summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(args.out, "soak.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default=None, help="folder for soak-summary.json and soak.log")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--E", type=int, default=32, help="experts over all ranks")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--inputs", type=int, default=5, help="input sets (routings) cycled through")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--check-every", type=int, default=100, help="calls between error and memory checks")
    ap.add_argument("--seed", type=int, default=0, help="the order of the calls")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: stop calling after this (after the warm-up; the summary says how many ran)")
    args = ap.parse_args(argv)
    bad = set(args.configs.split(",")) - set(CONFIGS)
    if bad:
        ap.error(f"unknown configs {sorted(bad)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


def main(argv=None) -> int:
    return 0 if run(parse_args(argv))["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
