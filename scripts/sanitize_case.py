"""A tiny forward + backward of tabby.moe on every path, EP1, for compute-sanitizer (scripts/sanitize.sh).

Runs the megakernel (keeping the routed rows, and recomputing them in the backward) and the path
of separate launches on one small shape (T=64, H=128, I=64, E=4, k=2 by default), reads the device
error record and checks y and the gradients against the reference (so that a run that the
sanitizer slowed or disturbed is not counted as clean when its results are wrong). Exit status 0
when every path ran right, 1 otherwise.

    python scripts/sanitize_case.py [--device cuda] [--shared]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# the repository's tabby, also where it is not installed (python scripts/<this>.py from the root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--I", type=int, default=64)
    ap.add_argument("--E", type=int, default=4)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--shared", action="store_true", help="with a shared expert")
    ap.add_argument("--paths", default="megakernel,recompute,separate")
    ap.add_argument("--programs", type=int, default=None,
                    help="the megakernel's persistent grid (Tuning(programs=...)); fewer programs if a "
                         "sanitizer's instrumentation keeps them from all being resident at once")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import tabby

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = args.T, args.H, args.I, args.E, args.k
    x = torch.randn(T, H, generator=g).bfloat16()
    scores, idx = torch.randn(T, E, generator=g).topk(k, dim=1)
    wts = torch.softmax(scores, dim=1)
    ws = [(torch.randn(*s, generator=g) / s[-1] ** 0.5).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]
    sh = [(torch.randn(*s, generator=g) / s[-1] ** 0.5).bfloat16() for s in ((32, H), (32, H), (H, 32))] \
        if args.shared else []
    dy = torch.randn(T, H, generator=g).bfloat16()

    def run(layer, **kw):
        leaves = [t.detach().to(device, copy=True).requires_grad_(True) for t in (x, wts, *ws, *sh)]
        y = layer(leaves[0], idx.to(device), leaves[1], *leaves[2:5], shared=tuple(leaves[5:]) or None, **kw)
        y.backward(dy.to(device))
        return [y.detach().double().cpu()] + [t.grad.double().cpu() for t in leaves]

    ref = run(tabby.moe_reference)
    names = ["y", "dx", "dtopk", "dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down"]
    tuning = tabby.Tuning(programs=args.programs)
    configs = {"megakernel": tabby.MoEConfig(tuning=tuning),
               "recompute": tabby.MoEConfig(save_for_backward=False, tuning=tuning),
               "separate": tabby.MoEConfig(megakernel=False)}
    failed = []
    for path in args.paths.split(","):
        t0 = time.time()
        try:
            got = run(tabby.moe, config=configs[path])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            tabby.check_errors()
            errs = {n: ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for n, a, b in zip(names, got, ref)}
            bad = {n: e for n, e in errs.items() if not e < 2e-2}
            status = "ok" if not bad else f"WRONG {bad}"
        except Exception as e:  # noqa: BLE001 - the next path still runs; the exit status says it failed
            status = f"ERROR {type(e).__name__}: {e}"
        if status != "ok":
            failed.append(path)
        print(f"sanitize_case: {path}: {status} ({time.time() - t0:.1f} s)", flush=True)
    print(f"sanitize_case: {'FAILED ' + ','.join(failed) if failed else 'ok'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
