"""Benchmark records: one per (shape, tokens per GPU, EP, pass, implementation); their ratios, the
table, the chart, the machine header, and where the files go.

A result file (``tabby-bench/1``) holds the machine header (:func:`machine_info`: GPU, torch,
triton, commit, date, command line), the run's configuration and the records.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone

import torch

from .check import TOLERANCE
from .shapes import Shape, flops

PASSES = ("fwd", "fwd+bwd")
ANCHORS = ("torch-a2a", "torch-symm", "torch-fp8", "torchao-fp8")  # the baselines "vs anchor" compares with (same precision)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_out_dir() -> str:
    """Where results go unless ``--out`` says otherwise: outside any source tree."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tabby", "bench")


def base_record(impl, shape: Shape, T: int, ep: int, pass_: str, dtype: str) -> dict:
    """``dtype``: the layer's inputs; the implementation's ``precision`` (its GEMMs' operands, bf16
    unless it says otherwise) sets the tolerance."""
    precision = getattr(impl, "precision", dtype)
    return dict(impl=impl.name if not isinstance(impl, str) else impl, shape=shape.name, E=shape.E, H=shape.H,
                I=shape.I, k=shape.k, I_shared=shape.I_shared, ep=ep, tokens_per_gpu=T, dtype=dtype, **{"pass": pass_},
                precision=precision, ms=None, tflops=None, flops=flops(shape, T, pass_), correct=None, errors={},
                tolerance=TOLERANCE[precision],
                ratio_to_floor=None, speedup_vs_best_anchor=None, peak_mem_gb=None, host_ms=None, error=None,
                tuning=getattr(impl, "tuning", ""))


def bracket_floor(first: list, last: list) -> list:
    """The floor's records with ``ms`` the mean of its time measured first and last among a shape's
    implementations (``ms_first``, ``ms_last``; per pass).

    Under sustained load the GPU's clock drops (docs/performance.md, "How it is measured"): timed only first,
    the floor would be measured on the coolest GPU and every other implementation on a warmer one;
    timed before and after them, its figure is the floor at mid-run."""
    for r, r2 in zip(first, last):
        r["ms_first"], r["ms_last"] = r["ms"], r2["ms"]
        r["ms_iters_last"] = r2.get("ms_iters")
        if r["ms"] is None or r2["ms"] is None:
            continue
        r["ms"] = (r["ms"] + r2["ms"]) / 2
        r["ms_min"] = min(r["ms_min"], r2["ms_min"])
        r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        r["peak_mem_gb"] = max(r["peak_mem_gb"], r2["peak_mem_gb"])
    return first


def finalize(records: list) -> None:
    """Fill ratio_to_floor (against the bf16 floor) and speedup_vs_best_anchor (the fastest correct
    anchor of the row's precision) in place."""
    def key(r):
        return (r["shape"], r["tokens_per_gpu"], r["ep"], r["pass"])

    def anchor_key(r):
        return key(r) + (r.get("precision", "bf16"),)

    floor, best = {}, {}
    for r in records:
        if r["ms"] is None or r["correct"] is False:
            continue
        if r["impl"] == "floor":
            floor[key(r)] = r["ms"]
        if r["impl"] in ANCHORS:
            best[anchor_key(r)] = min(best.get(anchor_key(r), math.inf), r["ms"])
    for r in records:
        if r["ms"] is None:
            continue
        if key(r) in floor:
            r["ratio_to_floor"] = r["ms"] / floor[key(r)]
        if anchor_key(r) in best:
            r["speedup_vs_best_anchor"] = best[anchor_key(r)] / r["ms"]


def _cell(v, fmt):
    return "-" if v is None else format(v, fmt)


def markdown_table(head: list, rows: list, right: set) -> str:
    """Aligned markdown pipes; columns in ``right`` right-aligned."""
    width = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, width))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(width)) + "|"
    return "\n".join([line(head), sep] + [line(row) for row in rows])


def format_table(records: list) -> str:
    """A readable table: one row per record. "host ms": the host's time per call (Python and
    launches); where it reaches "ms" the pass waited for the host, not the GPU."""
    head = ["shape", "T/GPU", "EP", "pass", "impl", "ms", "host ms", "TFLOP/s", "x floor", "vs anchor", "correct"]
    rows = []
    for r in records:
        ok = "error" if r.get("error") and r["correct"] is False and not r["errors"] else (
            "-" if r["correct"] is None else ("yes" if r["correct"] else "NO"))
        rows.append([r["shape"], str(r["tokens_per_gpu"]), str(r["ep"]), r["pass"], r["impl"],
                     _cell(r["ms"], ".3f"), _cell(r.get("host_ms"), ".3f"), _cell(r["tflops"], ".1f"),
                     _cell(r["ratio_to_floor"], ".2f"), _cell(r["speedup_vs_best_anchor"], ".2f"), ok])
    return markdown_table(head, rows, right={1, 2, 5, 6, 7, 8, 9})


def progress_line(r: dict) -> str:
    head = f"{r['shape']} T={r['tokens_per_gpu']} EP{r['ep']} {r['pass']:<7} {r['impl']}:"
    parts = []
    if r.get("ms") is not None:
        parts.append(f"{r['ms']:.3f} ms  {r['tflops']:.1f} TFLOP/s  peak {r['peak_mem_gb']:.1f} GB")
    if r.get("correct") is not None:
        worst = max(r["errors"].values()) if r["errors"] else float("nan")
        parts.append(("correct" if r["correct"] else "WRONG") + f" (max rel err {worst:.2e})")
    if r.get("error"):
        parts.append("ERROR " + r["error"].splitlines()[0][:300])
    return head + " " + "  ".join(parts)


def git_commit() -> tuple:
    """(commit, dirty); TABBY_GIT_COMMIT names it where the tree's .git is absent or stale (the device
    machine's copy of the tree: pass the commit computed where it was made)."""
    if os.environ.get("TABBY_GIT_COMMIT"):
        return os.environ["TABBY_GIT_COMMIT"], None
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown", None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), (bool(dirty.stdout.strip()) if dirty.returncode == 0 else None)
    except Exception:  # noqa: BLE001 -- no git: still write results
        return "unknown", None


def machine_info() -> dict:
    import triton

    host = socket.gethostname()
    if torch.cuda.is_available():
        name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
        machine = f"{name} x {count} / {host}"
    else:
        name, count, machine = None, 0, f"CPU ({os.cpu_count()} cores) / {host}"
    commit, dirty = git_commit()
    return dict(machine=machine, hostname=host, gpu_name=name, gpu_count=count, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, git_commit=commit, git_dirty=dirty,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), argv=list(sys.argv),
                env={k: v for k, v in os.environ.items() if k.startswith("TABBY_")})


def write_script_table(out: str, stem: str, title: str, rows: list, columns: list, argv: dict) -> dict:
    """A measuring script's results: ``out/stem.json`` (machine, torch, commit, date, ``argv``, the
    rows) and ``out/stem.md`` (``title``, then a table of ``columns``: (header, function of a row ->
    its cell text)). Returns the JSON's header."""
    commit, _ = git_commit()
    head = dict(machine=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", torch=torch.__version__,
                commit=commit[:12] if commit != "unknown" else commit,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), argv=argv)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(dict(head, rows=rows), f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(f"# {title}: {head['machine']}, commit {head['commit']}, {head['date']}\n\n")
        f.write("| " + " | ".join(h for h, _ in columns) + " |\n|" + "---|" * len(columns) + "\n")
        for r in rows:
            f.write("| " + " | ".join(cell(r) for _, cell in columns) + " |\n")
    return head


def header_line(info: dict) -> str:
    return (f"torch {info['torch']}, triton {info['triton']}, commit {info['git_commit']}"
            f"{' (dirty)' if info['git_dirty'] else ''}, {info['date']}")


def file_stem(info: dict, tag: str) -> str:
    if info["gpu_count"]:
        m = re.search(r"\b([a-z]+\d+[a-z]*)\b", info["gpu_name"].lower())
        kind = f"{info['gpu_count']}x{m.group(1) if m else 'gpu'}"
    else:
        kind = "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return "-".join(["bench", kind] + ([tag] if tag else []) + [stamp])


def plot(records: list, dense_tflops, path: str) -> bool:
    """Bar chart of TFLOP/s per impl, grouped by shape (and EP), one panel per (pass, T). False if no data."""
    timed = [r for r in records if r["tflops"] is not None]
    if not timed:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pass"], r["tokens_per_gpu"]) for r in timed}, key=lambda pt: (PASSES.index(pt[0]), pt[1]))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    multi_ep = len({r["ep"] for r in timed}) > 1
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len({r['shape'] for r in timed}) * (
        1 + multi_ep)), 3.6 * len(panels)), squeeze=False)
    for ax, (p, T) in zip(axes[:, 0], panels):
        rs = [r for r in timed if r["pass"] == p and r["tokens_per_gpu"] == T]
        groups = list(dict.fromkeys((r["shape"], r["ep"]) for r in rs))
        width = 0.8 / max(1, len(impls))
        for j, name in enumerate(impls):
            xs, hs, bad = [], [], []
            for i, g in enumerate(groups):
                r = next((r for r in rs if (r["shape"], r["ep"]) == g and r["impl"] == name), None)
                if r is not None:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    hs.append(r["tflops"])
                    bad.append(r["correct"] is False)
            bars = ax.bar(xs, hs, width, label=name)
            for b, wrong in zip(bars, bad):
                if wrong:
                    b.set_hatch("//")
        if dense_tflops:
            ax.axhline(dense_tflops, color="gray", linestyle="--", linewidth=1, label="dense bf16 matmul")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{s}\nEP{e}" if multi_ep else s for s, e in groups], fontsize=8)
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{p}, {T} tokens/GPU (hatched: failed the correctness check)", fontsize=10)
        ax.legend(fontsize=7, ncol=min(len(impls) + 1, 5), loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def read_jsonl(path: str) -> tuple:
    """(records, notes) of a JSON-lines file; notes are the lines with a "kind"."""
    recs, notes = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                obj = json.loads(line)
                (notes if obj.get("kind") else recs).append(obj)
    return recs, notes


def append_history(result_path: str, history: str) -> int:
    """Append the records of one result file to the history file ``history`` (one line per record,
    with commit and date), by scripts/results_history.py's ``append``; returns the lines added."""
    script = os.path.join(REPO, "scripts", "results_history.py")
    if not os.path.exists(script):
        raise FileNotFoundError(f"--history needs {script} (a checkout of the repository)")
    spec = importlib.util.spec_from_file_location("tabby_results_history", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from pathlib import Path

    return module.append([result_path], Path(history))
