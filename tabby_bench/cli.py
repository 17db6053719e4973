"""Command line: ``tabby bench ...`` and ``tabby profile ...`` (also ``python -m tabby ...``)."""
from __future__ import annotations

import argparse
import sys


def _list(text: str) -> list:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list:
    try:
        return [int(t) for t in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tabby", description="Tabby: expert-parallel MoE layer for Hopper GPUs.")
    sub = p.add_subparsers(dest="command")
    b = sub.add_parser("bench", help="correctness and speed of every implementation on the DESIGN.md shapes",
                       description="Check every implementation against the fp32 reference and time it. "
                                   "Without a GPU: the TINY shape on the CPU (errors only, no timings).")
    b.add_argument("--shapes", type=_list, default=None, help="comma list of shape names (default: all six)")
    b.add_argument("--tokens", type=_ints, default=[4096, 16384], help="tokens per GPU, comma list (default 4096,16384)")
    b.add_argument("--ep", type=_ints, default=None, help="EP sizes, comma list (default: the number of GPUs)")
    b.add_argument("--impls", type=_list, default=None, help="implementations, comma list (default: all registered except opt-in ones)")
    b.add_argument("--passes", type=_list, default=["fwd", "fwd+bwd"], help="fwd,fwd+bwd (default both)")
    b.add_argument("--dtype", default="bf16", choices=["bf16"])
    b.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5)")
    b.add_argument("--iters", type=int, default=20, help="timed iterations (default 20)")
    b.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness checks")
    b.add_argument("--out", default="bench/results", help="output folder (default bench/results)")
    b.add_argument("--tag", default="", help="label in the output file names")
    pr = sub.add_parser("profile", help="time every stage of Tabby's forward and backward",
                        description="Per-stage times (CUDA events between launches), median over iterations, "
                                    "max over ranks. 'tiny' runs on the CPU under the Triton interpreter.")
    _one_shape_run_args(pr, "JSON file for the per-stage times")
    pr.add_argument("--mega", action="store_true",
                    help="profile the default layer (the forward megakernel) instead of the sync-free path")
    pr.add_argument("--fwd-only", action="store_true",
                    help="forward passes only (under autograd, as the bench's forward), no backward")
    tu = sub.add_parser("tune", help="time the forward megakernel's variants (GPU)",
                        description="Forward time of megakernel variants (comm programs C, prefetch P, ring rows R, "
                                    "programs N, down lag L, fill split S, row-tile group M, ablations A) against "
                                    "the sync-free path and the floor; see tabby/tune.py.")
    _one_shape_run_args(tu, "JSON file for the results")
    tu.add_argument("--variants", type=lambda s: s.split(";"), default=None,
                    help="semicolon list, e.g. 'sync-free;mega;mega:C=16,R=4096' (default: a sweep)")
    tu.add_argument("--best-out", default=None,
                    help="write the best mega variant's knobs (for TABBY_MEGA_VARIANT) to this file")
    tu.add_argument("--trace", type=int, default=0, metavar="N",
                    help="after timing each mega variant, run it twice recording up to N tickets per program "
                         "(the second run's trace: the first compiles the traced kernel) and print where the "
                         "programs spent their time; with --out, also draw each "
                         "timeline (trace-*.png beside the JSON) (default 0: off)")
    tu.add_argument("--grad", action="store_true",
                    help="time the forward under autograd with inputs that require grad, as the bench does "
                         "(the megakernel then also keeps what the backward needs)")
    return p


def _one_shape_run_args(sub_parser, out_help: str) -> None:
    """The options `tabby profile` and `tabby tune` share (one shape, one size, one EP by default)."""
    sub_parser.add_argument("--shapes", type=_list, default=["qwen3-30b-a3b"], help="comma list of shape names")
    sub_parser.add_argument("--tokens", type=_ints, default=[16384], help="tokens per GPU, comma list")
    sub_parser.add_argument("--ep", type=_ints, default=[1], help="EP sizes, comma list")
    sub_parser.add_argument("--warmup", type=int, default=3)
    sub_parser.add_argument("--iters", type=int, default=10)
    sub_parser.add_argument("--out", default=None, help=out_help)


def bench_config(args, parser):
    """Validate the options into a :class:`tabby.bench.Config` (errors go through ``parser.error``)."""
    import torch

    from . import bench
    from .shapes import SHAPES

    names = args.shapes or list(SHAPES)
    bad = [n for n in names if n not in SHAPES]
    if bad:
        parser.error(f"unknown shape(s) {', '.join(bad)}; known: {', '.join(SHAPES)}")
    impls = args.impls or [n for n, impl in bench.IMPLS.items() if getattr(impl, "in_default", True)]
    bad = [n for n in impls if n not in bench.IMPLS]
    if bad:
        parser.error(f"unknown implementation(s) {', '.join(bad)}; registered: {', '.join(bench.IMPLS)}")
    bad = [p for p in args.passes if p not in bench.PASSES]
    if bad or not args.passes:
        parser.error(f"--passes takes fwd and/or fwd+bwd, got {','.join(args.passes)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    eps = args.ep or [max(gpus, 1)]
    if gpus and max(eps) > gpus:
        parser.error(f"--ep {max(eps)} needs {max(eps)} GPUs, found {gpus}")
    if min(eps) < 1 or any(t < 1 for t in args.tokens) or args.iters < 1 or args.warmup < 0:
        parser.error("--ep and --tokens must be positive, --iters >= 1, --warmup >= 0")
    return bench.Config(shapes=[SHAPES[n] for n in names], tokens=args.tokens, eps=eps, impls=impls,
                        passes=args.passes, dtype=args.dtype, warmup=args.warmup, iters=args.iters,
                        check=args.check, out=args.out, tag=args.tag)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "profile":
        from . import profile
        from .profile import PROFILE_SHAPES

        bad = [n for n in args.shapes if n not in PROFILE_SHAPES]
        if bad:
            parser.error(f"unknown shape(s) {', '.join(bad)}; known: {', '.join(PROFILE_SHAPES)}")
        profile.run(args.shapes, args.tokens, args.ep, args.iters, args.warmup, args.out, mega=args.mega,
                    fwd_only=args.fwd_only)
        return 0
    if args.command == "tune":
        from . import tune
        from .shapes import SHAPES

        bad = [n for n in args.shapes if n not in SHAPES]
        if bad:
            parser.error(f"unknown shape(s) {', '.join(bad)}")
        try:
            for v in args.variants or []:
                tune.parse_variant(v)
        except ValueError as e:
            parser.error(str(e))
        tune.run(args.shapes, args.tokens, args.ep, args.variants, args.warmup, args.iters, args.out, args.best_out,
                 args.trace, args.grad)
        return 0
    if args.command != "bench":
        parser.print_help()
        return 2
    from . import bench

    bench.run(bench_config(args, parser))
    return 0


if __name__ == "__main__":
    sys.exit(main())
