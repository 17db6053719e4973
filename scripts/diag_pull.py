"""Diagnose a wrong forward on the GPU, call by call (session 14: the token pull at qwen3-30b-a3b
16384 EP2 gave y = NaN in the bench's process, not in a fresh one).

    python3 scripts/diag_pull.py SHAPE T "spec1;spec2;..."

A spec is a config in `tabby tune` knob syntax ("" the default, "PT=0", "PT=1,V=8"), optionally
prefixed "SHAPE@T:" to run another shape first in the same process (its own workspace, streams
and allocations), e.g. "qwen3-30b-a3b@4096:;qwen3-30b-a3b@16384:PT=1". Each spec runs REPS times
(env, default 3) forward and backward on the bench's inputs; printed per call: the forward's
relative error against moe_reference, NaN and wrong rows of y, NaNs in the gradients, the device
error records; with the token pull, whether the pulled tokens equal the peers' x. At the end every
SHAPE/T call's y and gradients are compared bitwise with the last spec's first call. POISON_GB=N
(env) fills N GiB of the caching allocator with NaN before each call (reads of unwritten memory
then show).
"""
import os
import sys

import torch
import torch.distributed as dist

from tabby.launch import launch


def _worker(rank, world, shape_name, T, variants, reps):
    import tabby
    from tabby.bench import make_inputs
    from tabby.functional.config import MoEConfig
    from tabby.functional import workspace as wsmod
    from tabby.shapes import SHAPES
    from tabby.tune import parse_variant
    from tabby.reference import moe_reference

    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    prepared = {}

    def inputs(name, t):
        if (name, t) not in prepared:
            shape = SHAPES[name]
            inp = make_inputs(shape, t, world, rank, dev)
            with torch.no_grad():
                y_ref = moe_reference(*(a.detach() for a in inp.args()[:6]), group=group)
            peers = [make_inputs(shape, t, world, r, dev).x.detach() for r in range(world)]
            prepared[(name, t)] = (inp, y_ref, peers)
        return prepared[(name, t)]
    poison = int(os.environ.get("POISON_GB", "0"))
    results = {}
    for spec in variants:
        name, t, v = shape_name, T, spec
        if "@" in spec:
            where, v = spec.split(":", 1)
            name, t = where.split("@")[0], int(where.split("@")[1])
        inp, y_ref, peers = inputs(name, t)
        _, knobs = parse_variant("mega:" + v)
        cfg = MoEConfig(megakernel=True, **knobs)
        for rep in range(reps):
            if poison:  # the caching allocator hands out NaN-filled memory next (as in a long bench process)
                junk = torch.full((poison << 29,), float("nan"), dtype=torch.bfloat16, device=dev)
                del junk
            y = tabby.moe(*inp.args(), group=group, config=cfg)
            saved = getattr(y.grad_fn, "saved", None)
            if getattr(saved, "missing", "") == "tokens":
                torch.cuda.synchronize()
                xt = saved.xs
                for src in range(world):
                    if src != rank:
                        got = xt[src * t:(src + 1) * t]
                        bad_rows = (got != peers[src]).any(dim=1).sum().item()
                        wsx = [w for w in wsmod._CACHE.values() if w.key.T == t][0]
                        pv = wsx.peer_buffer("x_pub", src)
                        pv_bad = (pv != peers[src]).any(dim=1).sum().item()
                        print(f"[rank {rank}] {name}@{t} '{v}' call {rep}: xt rows of rank {src} wrong: {bad_rows}/{t}; "
                              f"peer x_pub view wrong rows now: {pv_bad}; view ptr {pv.data_ptr():#x} base "
                              f"{int(wsx.ptrs['x_pub'][src]):#x}; X_PULL flags {wsx.flags[5].tolist()}", flush=True)
            grads = torch.autograd.grad(y, inp.leaves(), inp.dy, allow_unused=True, materialize_grads=True)
            y = y.detach().float()
            torch.cuda.synchronize()
            err = ((y - y_ref.float()).norm() / y_ref.float().norm()).item()
            bad = ~torch.isfinite(y).all(dim=1)
            nbad = int(bad.sum())
            rows = bad.nonzero().flatten()
            wrong = ((y - y_ref.float()).abs().amax(dim=1) > 0.05 * y_ref.float().abs().amax()).sum().item()
            errs = []
            for ws in list(wsmod._CACHE.values()):
                try:
                    ws.check_errors()
                except Exception as e:  # noqa: BLE001
                    errs.append(str(e)[:200])
            gnan = [int((~torch.isfinite(g)).sum()) for g in grads]
            print(f"[rank {rank}] {shape_name} T={T} variant '{name}@{t}:{v}' call {rep}: err={err:.4g} nan_rows={nbad} "
                  f"wrong_rows={wrong} first_nan={rows[:4].tolist()} last_nan={rows[-4:].tolist()} "
                  f"grad_nans={gnan} device_errors={errs}", flush=True)
            if t == T and name == shape_name:
                results[(spec, rep)] = (y, [g.detach() for g in grads])
            del y, grads
    base = results[(variants[-1], 0)]
    for key, (y, grads) in results.items():
        same = [bool(torch.equal(y, base[0]))] + [bool(torch.equal(a, b)) for a, b in zip(grads, base[1])]
        diff = [float((a.float() - b.float()).norm() / (b.float().norm() + 1e-30)) for a, b in zip(grads, base[1])]
        print(f"[rank {rank}] {key} vs {(variants[-1], 0)}: bitwise y,dx,dtw,dwg,dwu,dwd={same} grad_rel_diff="
              f"{[round(d, 4) for d in diff]}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    shape, T, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(";")
    launch(_worker, shape, T, variants, int(os.environ.get("REPS", "3")))
