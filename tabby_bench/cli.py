"""Command line: ``tabby bench``, ``tabby tune`` and ``tabby profile`` (also ``python -m tabby_bench ...``)."""
from __future__ import annotations

import argparse
import os
import sys


def _list(text: str) -> list:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list:
    try:
        return [int(t) for t in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None


def _tuning(text: str) -> str:
    """A ``Tuning.parse`` text, checked now and kept as text (the workers parse it again)."""
    from tabby.functional.config import Tuning
    from tabby.validate import MoEInputError

    try:
        return Tuning.parse(text).describe()
    except MoEInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tabby", description="Tabby's tools: benchmark, variant sweep, stage profile, end-to-end training.")
    sub = p.add_subparsers(dest="command")
    b = sub.add_parser("bench", help="correctness and speed of every implementation on the benchmark shapes",
                       description="On GPUs: check every implementation against the fp32 reference and time it "
                                   "on the benchmark shapes. Without a GPU: check Tabby's two paths, the reference "
                                   "and torch-a2a on small shapes at EP1, EP2 and EP4 (simulated ranks), forward "
                                   "and gradients, and that a second run repeats the first bit for bit.")
    b.add_argument("--shapes", type=_list, default=None,
                   help="comma list of shape names, or NAME@epN for the experts one rank of NAME holds at EP N "
                        "(default: every benchmark shape; without a GPU the small CPU shapes)")
    b.add_argument("--tokens", type=_ints, default=None,
                   help="tokens per GPU, comma list (default 4096,16384; without a GPU 32 per rank)")
    b.add_argument("--ep", type=_ints, default=None,
                   help="EP sizes, comma list (default: the number of GPUs; without a GPU 1,2,4 for tiny and 1,2 for "
                        "tiny-top4)")
    b.add_argument("--impls", type=_list, default=None,
                   help="implementations, comma list (default: every registered one)")
    b.add_argument("--passes", type=_list, default=["fwd", "fwd+bwd"], help="fwd,fwd+bwd (default both; GPU)")
    b.add_argument("--dtype", default="bf16", choices=["bf16"])
    b.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5; GPU)")
    b.add_argument("--iters", type=int, default=20, help="timed iterations (default 20; GPU)")
    b.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness checks (GPU)")
    b.add_argument("--weights", default="new", choices=["new", "fixed"],
                   help="new: every timed call from a new weight version, as one forward per optimizer step (the "
                        "FP8 rows quantize their weights each call; default); fixed: one version, as microbatches "
                        "between steps (tabby-fp8 reuses its FP8 weight copies)")
    b.add_argument("--tuning", type=_tuning, default="",
                   help="a tabby.Tuning for both tabby rows, e.g. 'group_m=2,tma=0' (default: the heuristics)")
    b.add_argument("--out", default=None, help="output folder (default ~/.cache/tabby/bench)")
    b.add_argument("--tag", default="", help="label in the output file names")
    b.add_argument("--history", default=None, metavar="PATH",
                   help="also append the records to this history file (e.g. bench/results/history.jsonl; GPU)")
    b.add_argument("-v", "--verbose", action="store_true",
                   help="show the library's INFO log (workspace and memory reports) without a GPU too")
    pr = sub.add_parser("profile", help="time every stage of Tabby's forward and backward",
                        description="Per-stage times (CUDA events between launches), median over iterations, "
                                    "max over ranks; then each GEMM stage's TFLOP/s beside the floor's (bf16 "
                                    "torch._grouped_mm on the same routed rows) and the dense matmul's. 'tiny' runs "
                                    "on the CPU under the Triton interpreter (floor and dense not measured).")
    _one_shape_run_args(pr, "JSON file for the per-stage times")
    pr.add_argument("--mega", action="store_true",
                    help="profile the default layer (the forward megakernel) instead of the sync-free path")
    pr.add_argument("--fwd-only", action="store_true",
                    help="forward passes only (under autograd, as the bench's forward), no backward")
    pr.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "fp8-forward"],
                    help="MoEConfig.precision of the profiled layer (FP8: the sync-free path, not with --mega)")
    tu = sub.add_parser("tune", help="time Tabby's variants (GPU)",
                        description="Forward time of Tabby's variants against the sync-free path and the floor. "
                                    "A variant is floor, sync-free or mega, with tabby.Tuning fields after a colon "
                                    "(mega:group_m=2,tma=0), save_for_backward=0, or ablate=N (measurement only); "
                                    "see tabby_bench/tune.py.")
    _one_shape_run_args(tu, "JSON file for the results")
    tu.add_argument("--variants", type=lambda s: [v.strip() for v in s.split(";") if v.strip()], default=None,
                    help="semicolon list, e.g. 'floor;mega;mega:group_m=2;mega:tma=0;sync-free' (default: a sweep)")
    tu.add_argument("--best-out", default=None,
                    help="write the best mega variant's Tuning text (for tabby bench --tuning) to this file")
    tu.add_argument("--trace", type=int, default=0, metavar="N",
                    help="after timing each mega variant, run it twice recording up to N tickets per program "
                         "(the second run's trace) and print where the programs spent their time; with --out, "
                         "also draw each timeline (trace-*.png beside the JSON) (default 0: off)")
    tu.add_argument("--grad", action="store_true",
                    help="time the forward under autograd with inputs that require grad, as the bench does "
                         "(the megakernel then also keeps what the backward needs)")
    tr = sub.add_parser("train", help="end-to-end training of an MoE model, Tabby vs grouped_mm",
                        description="Train a transformers MoE model (Qwen3-MoE- or DeepSeek-V3-shaped) or torchtitan's "
                                    "Qwen3-MoE (torchtitan-qwen3-moe) on a generated "
                                    "corpus with each experts backend and step mode; report tokens/s, MFU, peak "
                                    "memory, the MoE blocks' share of the step, the loss curves and whether two "
                                    "Tabby runs agree bit for bit. Without a GPU: --models tiny-qwen3-moe, eager.")
    tr.add_argument("--models", type=_list, default=None,
                    help="comma list (default qwen3-moe,deepseek-v3-16b; without a GPU tiny-qwen3-moe)")
    tr.add_argument("--experts", type=_list, default=["grouped_mm", "tabby"],
                    help="experts backends, comma list (default grouped_mm,tabby)")
    tr.add_argument("--modes", type=_list, default=None,
                    help="eager, compile, graph (the whole step as a CUDA graph); default eager,compile,graph "
                         "(without a GPU eager)")
    tr.add_argument("--steps", type=int, default=None, help="steps of the eager runs (default 200; CPU 4)")
    tr.add_argument("--mode-steps", type=int, default=None, help="steps of the compile and graph runs (default 60)")
    tr.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16384; CPU 64)")
    tr.add_argument("--seq-len", type=int, default=None, help="sequence length (default 4096; CPU 32)")
    tr.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant (default 1e-3)")
    tr.add_argument("--warmup", type=int, default=None, help="steps left out of tokens/s (default 10; CPU 1)")
    tr.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    tr.add_argument("--no-repeat", dest="repeat", action="store_false",
                    help="skip the second deterministic Tabby run (bitwise check), the baseline's repeat at the same "
                         "seed and its second seed (its noise)")
    tr.add_argument("--tabby-config", default="", help="a tabby.MoEConfig text, e.g. 'megakernel=0' (default: the "
                                                         "defaults; without a GPU the sync-free path, small tiles)")
    tr.add_argument("--out", default=None, help="output folder (default ~/.cache/tabby/bench)")
    tr.add_argument("--tag", default="", help="label in the output file names")
    tr.add_argument("--profile", action="store_true",
                    help="also write each run's GPU time by operator and kernel (2 steps, torch.profiler) to kernels-*.txt "
                         "in --out")
    return p


def train_config(args, parser, gpus: int):
    """Validate the options into a :class:`tabby_bench.train.TrainConfig`."""
    from . import train
    from .train import BACKENDS, MODELS, MODES, TrainConfig

    models = args.models or (["qwen3-moe", "deepseek-v3-16b"] if gpus else ["tiny-qwen3-moe"])
    modes = args.modes or (list(MODES) if gpus else ["eager"])
    for what, given, known in (("model", models, MODELS), ("experts backend", args.experts, BACKENDS),
                               ("mode", modes, MODES)):
        bad = [g for g in given if g not in known]
        if bad or not given:
            parser.error(f"unknown {what}(s) {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    if not gpus and modes != ["eager"]:
        parser.error("without a GPU only --modes eager runs (compile and graph need CUDA)")
    cpu = not gpus
    cfg = TrainConfig(models=models, backends=args.experts, modes=modes,
                      steps=args.steps or (4 if cpu else 200), mode_steps=args.mode_steps or (4 if cpu else 60),
                      tokens=args.tokens or (64 if cpu else 16384), seq_len=args.seq_len or (32 if cpu else 4096),
                      lr=args.lr, warmup_steps=args.warmup if args.warmup is not None else (1 if cpu else 10),
                      log_every=args.log_every, repeat=args.repeat, out=args.out, tag=args.tag,
                      tabby_config=args.tabby_config or (train.CPU_TABBY_CONFIG if cpu else ""),
                      profile_dir=(args.out or None) if args.profile and gpus else None)
    if cfg.steps < 2 or cfg.mode_steps < 2 or cfg.tokens < 1 or cfg.seq_len < 1 or cfg.warmup_steps < 0:
        parser.error("--steps and --mode-steps must be >= 2, --tokens and --seq-len positive, --warmup >= 0")
    if cfg.tabby_config:
        from tabby.functional.moe import parse_config
        from tabby.validate import MoEInputError

        try:
            parse_config(cfg.tabby_config)
        except (MoEInputError, ValueError) as e:
            parser.error(f"--tabby-config: {e}")
    if cfg.tokens % min(cfg.seq_len, cfg.tokens):
        parser.error(f"--tokens {cfg.tokens} must be a multiple of --seq-len {cfg.seq_len}")
    return cfg


def _one_shape_run_args(sub_parser, out_help: str) -> None:
    """The options `tabby profile` and `tabby tune` share (one shape, one size, one EP by default)."""
    sub_parser.add_argument("--shapes", type=_list, default=["qwen3-30b-a3b"], help="comma list of shape names")
    sub_parser.add_argument("--tokens", type=_ints, default=[16384], help="tokens per GPU, comma list")
    sub_parser.add_argument("--ep", type=_ints, default=[1], help="EP sizes, comma list")
    sub_parser.add_argument("--warmup", type=int, default=3)
    sub_parser.add_argument("--iters", type=int, default=10)
    sub_parser.add_argument("--out", default=None, help=out_help)


def _shapes(names, known: dict, parser, where: str) -> list:
    """The shapes named (``shapes.shape_named``: a known name, or NAME@epN for one rank's experts)."""
    from .shapes import shape_named

    found, bad = [], []
    for n in names:
        try:
            found.append(shape_named(n, known))
        except KeyError:
            bad.append(n)
        except ValueError as e:
            parser.error(f"shape {n}: {e}")
    if bad:
        parser.error(f"unknown shape(s) {', '.join(bad)}; {where}: {', '.join(known)} (or NAME@epN: the experts one "
                     f"rank of NAME holds at EP N)")
    return found


def bench_config(args, parser, gpus: int):
    """Validate the options into a :class:`tabby_bench.bench.Config` (errors go through ``parser.error``)."""
    from . import bench
    from .impls import IMPLS, default_impls
    from .records import PASSES

    if gpus:
        from .shapes import SHAPES

        shapes = _shapes(args.shapes or list(SHAPES), SHAPES, parser, "known")
        tokens, eps = args.tokens or [4096, 16384], args.ep or [gpus]
        impls = args.impls or default_impls()
        bad = [n for n in impls if n not in IMPLS]
        if bad:
            parser.error(f"unknown implementation(s) {', '.join(bad)}; registered: {', '.join(IMPLS)}")
        if max(eps) > gpus:
            parser.error(f"--ep {max(eps)} needs {max(eps)} GPUs, found {gpus}")
    else:
        from .cpu_demo import CPU_IMPLS, CPU_SHAPES, CPU_TOKENS, GPU_ONLY

        shapes = _shapes(args.shapes or list(CPU_SHAPES), CPU_SHAPES, parser, "without a GPU the CPU shapes")
        tokens, eps = args.tokens or list(CPU_TOKENS), args.ep  # None: each shape's CPU_EPS
        impls = args.impls or list(CPU_IMPLS)
        bad = [n for n in impls if n not in CPU_IMPLS + GPU_ONLY]
        if bad:
            parser.error(f"unknown implementation(s) {', '.join(bad)}; without a GPU: {', '.join(CPU_IMPLS)}")
        bad = [s.name for s in shapes for ep in eps or () if s.E % ep]
        if bad:
            parser.error(f"--ep {','.join(map(str, eps))}: the experts of {', '.join(sorted(set(bad)))} do not "
                         f"divide evenly")
    bad = [p for p in args.passes if p not in PASSES]
    if bad or not args.passes:
        parser.error(f"--passes takes fwd and/or fwd+bwd, got {','.join(args.passes)}")
    if min(eps or [1]) < 1 or any(t < 1 for t in tokens) or args.iters < 1 or args.warmup < 0:
        parser.error("--ep and --tokens must be positive, --iters >= 1, --warmup >= 0")
    return bench.Config(shapes=shapes, tokens=tokens, eps=eps, impls=impls, passes=args.passes, dtype=args.dtype,
                        warmup=args.warmup, iters=args.iters, check=args.check, out=args.out, tag=args.tag,
                        tuning=args.tuning, history=args.history, weights=args.weights)


def main(argv=None) -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:  # Tabby's kernels then run under the Triton interpreter (set before tabby is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import log

    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure(info=bool(gpus) or getattr(args, "verbose", False))
    if args.command == "profile":
        from . import profile

        _shapes(args.shapes, profile.PROFILE_SHAPES, parser, "known")
        if args.mega and args.precision != "bf16":
            parser.error("--precision fp8 / fp8-forward runs on the sync-free path: drop --mega")
        profile.run(args.shapes, args.tokens, args.ep, args.iters, args.warmup, args.out, mega=args.mega,
                    fwd_only=args.fwd_only, precision=args.precision)
        return 0
    if args.command == "tune":
        from . import tune
        from .shapes import SHAPES

        _shapes(args.shapes, SHAPES, parser, "known")
        try:
            for v in args.variants or []:
                tune.parse_variant(v)
        except ValueError as e:
            parser.error(str(e))
        tune.run(args.shapes, args.tokens, args.ep, args.variants, args.warmup, args.iters, args.out, args.best_out,
                 args.trace, args.grad)
        return 0
    if args.command == "train":
        from . import train

        result = train.run(train_config(args, parser, gpus))
        return 1 if result.get("failed") else 0
    if args.command != "bench":
        parser.print_help()
        return 2
    from . import bench

    result = bench.run(bench_config(args, parser, gpus))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
