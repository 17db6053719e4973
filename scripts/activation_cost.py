#!/usr/bin/env python3
"""What an experts' activation costs against plain SwiGLU (the goal: at most 3% of the layer's time):
the layer's forward and forward + backward at bench shapes with each ``tabby.Activation`` kind, one
GPU, the kinds interleaved round by round (so that clock drift falls on all alike), medians. In bf16
also the experts' forms that take the plan's other path (separate launches, bf16.py's kernels):
SwiGLU with biases, and gpt-oss's experts as transformers stores them (its activation, biases,
the weights read in place from gate_up_proj [E, H, 2I] with g and u interleaved and down_proj
[E, I, H]).

    PYTHONPATH=. python3 scripts/activation_cost.py --shapes qwen3-30b-a3b@ep8,gpt-oss-120b@ep8 --out DIR
    PYTHONPATH=. python3 scripts/activation_cost.py --shapes gpt-oss-120b@ep8 --profile gpt-oss,gpt-oss-as-stored

Writes DIR/activation-cost.json and .md (machine, commit, date, every median); with ``--profile`` it
instead prints, for each named form, its forward + backward's CUDA kernels (torch.profiler, ms a
call, the largest first), to see where one form's extra time goes.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import tabby
from tabby.activation import Activation
from tabby_bench.records import write_script_table
from tabby_bench.shapes import make_inputs, shape_named
from tabby_bench.timing import time_iterations

KINDS = {"swiglu": Activation(), "swiglu-clamp": Activation("swiglu-clamp", limit=10.0),
         "swiglu-clamp-out": Activation("swiglu-clamp-out", limit=7.0),
         "gpt-oss": Activation("gpt-oss", limit=7.0, alpha=1.702), "geglu": Activation("geglu")}


FORMS = {"swiglu+biases": " with biases", "gpt-oss-as-stored": " with biases, weights kn-paired (gpt-oss's)"}


def experts_forms(inp) -> dict:
    """FORMS' (weights, biases) makers: the same experts' weights, their biases leaves of their own;
    gpt-oss's as views of a fused gate_up [E, H, 2I] (g, u interleaved) and down [E, I, H]."""
    E, I, H = inp.w_gate.shape
    with torch.no_grad():
        gate_up = torch.stack([inp.w_gate, inp.w_up], 2).flatten(1, 2).transpose(1, 2).contiguous()
        down = inp.w_down.transpose(1, 2).contiguous()
    gate_up.requires_grad_(True)
    down.requires_grad_(True)
    leaf = lambda *size: (torch.randn(*size, device=gate_up.device) * 0.1).bfloat16().requires_grad_(True)  # noqa: E731
    b_gate, b_up, b_down, b_gate_up = leaf(E, I), leaf(E, I), leaf(E, H), leaf(E, 2 * I)

    def gpt_oss():
        g, u = gate_up.unflatten(2, (I, 2)).unbind(3)
        bg, bu = b_gate_up.unflatten(1, (I, 2)).unbind(2)
        return (g.transpose(1, 2), u.transpose(1, 2), down.transpose(1, 2)), (bg, bu, b_down)

    return {"swiglu+biases": lambda: ((inp.w_gate, inp.w_up, inp.w_down), (b_gate, b_up, b_down)),
            "gpt-oss-as-stored": gpt_oss}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b@ep8,gpt-oss-120b@ep8,kimi-k2@ep8")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", default="", help="forms to profile (fwd+bwd, bf16) instead of timing, e.g. "
                                                  "gpt-oss,gpt-oss-as-stored")
    a = ap.parse_args()
    if a.profile:
        return profile_forms(a)
    rows = []
    for name in a.shapes.split(","):
        shape = shape_named(name)
        inp = make_inputs(shape, a.tokens, 1, 0, "cuda")
        forms = experts_forms(inp)
        for precision in a.precisions.split(","):
            for pass_ in ("fwd", "fwd+bwd"):
                variants = dict(KINDS)
                if precision == "bf16":
                    variants.update({v: KINDS["swiglu" if v == "swiglu+biases" else "gpt-oss"] for v in FORMS})
                times = {k: [] for k in variants}
                for _ in range(a.rounds):
                    for kind, act in variants.items():
                        cfg = tabby.MoEConfig(activation=act, precision=precision)
                        weights, biases = forms[kind]() if kind in FORMS else ((inp.w_gate, inp.w_up, inp.w_down),
                                                                               None)

                        def run(cfg=cfg, weights=weights, biases=biases):
                            y = tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, *weights, config=cfg, biases=biases)
                            if pass_ == "fwd+bwd":
                                torch.autograd.backward(y, inp.dy)

                        times[kind] += time_iterations(run, 2, a.iters)
                base = statistics.median(times["swiglu"])
                for kind in variants:
                    ms = statistics.median(times[kind])
                    rows.append(dict(shape=name, tokens=a.tokens, precision=precision, pass_=pass_, kind=kind,
                                     activation=str(variants[kind]) + FORMS.get(kind, ""), ms=ms,
                                     vs_swiglu=ms / base))
                    print(f"{name:<18} {precision:<5} {pass_:<8} {kind:<17} {ms:8.3f} ms  {ms / base:6.3f}x swiglu",
                          flush=True)
                for t in inp.leaves():
                    t.grad = None
                forms = experts_forms(inp)  # (their gradients dropped)
        del inp
        torch.cuda.empty_cache()
    write_script_table(a.out, "activation-cost", "the experts' activations against SwiGLU", rows, [
        ("shape", lambda r: r["shape"]), ("T", lambda r: str(r["tokens"])), ("precision", lambda r: r["precision"]),
        ("pass", lambda r: r["pass_"]), ("activation", lambda r: r["activation"]), ("ms", lambda r: f"{r['ms']:.3f}"),
        ("x SwiGLU", lambda r: f"{r['vs_swiglu']:.3f}")], vars(a))

def profile_forms(a, calls: int = 3, top: int = 14):
    """Each ``--profile`` form's fwd + bwd kernels at each shape: CUDA ms a call by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    variants = dict(KINDS, **{v: KINDS["swiglu" if v == "swiglu+biases" else "gpt-oss"] for v in FORMS})
    for name in a.shapes.split(","):
        inp = make_inputs(shape_named(name), a.tokens, 1, 0, "cuda")
        forms = experts_forms(inp)
        for kind in a.profile.split(","):
            cfg = tabby.MoEConfig(activation=variants[kind])
            weights, biases = forms[kind]() if kind in FORMS else ((inp.w_gate, inp.w_up, inp.w_down), None)

            def run():
                y = tabby.moe(inp.x, inp.topk_idx, inp.topk_weights, *weights, config=cfg, biases=biases)
                torch.autograd.backward(y, inp.dy)

            time_iterations(run, 2, 1)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    run()
                torch.cuda.synchronize()
            kernels = sorted(((e.key, e.device_time_total / 1e3 / calls) for e in prof.key_averages()
                              if e.device_time_total > 0), key=lambda kv: -kv[1])
            print(f"{name} {kind}: {sum(ms for _, ms in kernels):.3f} ms of kernels a call", flush=True)
            for key, ms in kernels[:top]:
                print(f"  {ms:8.3f}  {key[:110]}", flush=True)


if __name__ == "__main__":
    main()
