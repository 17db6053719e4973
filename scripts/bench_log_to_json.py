#!/usr/bin/env python3
"""Rebuild a bench JSON and table from the progress log of a run that was stopped before it
wrote them (e.g. at the device's time limit). Every figure comes from the log's lines.

Usage: scripts/bench_log_to_json.py LOG MACHINE_TXT COMMIT DATE OUT_STEM
"""
import json
import re
import sys

from tabby import bench
from tabby.shapes import SHAPES

LINE = re.compile(r"^\[(\d+)/(\d+)\] (\S+) T=(\d+) EP(\d+) (\S+)\s+(\S+): ([\d.]+) ms\s+([\d.]+) TFLOP/s\s+"
                  r"peak ([\d.]+) GB\s+(correct|WRONG|INCORRECT|FAIL\w*)(?: \(max rel err ([\d.e+-]+)\))?")


def main(log, machine_txt, commit, date, stem):
    records, total = [], None
    dense = None
    for line in open(log):
        m = LINE.match(line.strip())
        if m:
            i, total, shape, T, ep, pass_, impl, ms, tf, peak, status, err = m.groups()
            s = SHAPES[shape]
            records.append(dict(impl=impl, shape=shape, E=s.E, H=s.H, I=s.I, k=s.k, I_shared=s.I_shared,
                                ep=int(ep), tokens_per_gpu=int(T), dtype="bf16", pass_=pass_, ms=float(ms),
                                tflops=float(tf), correct=status == "correct",
                                max_rel_err=float(err) if err else None, peak_mem_gb=float(peak)))
        d = re.match(r"dense bf16 matmul 8192\^3: ([\d.]+) ms, ([\d.]+) TFLOP/s", line.strip())
        if d:
            dense = dict(m=8192, n=8192, k=8192, ms=float(d.group(1)), tflops=float(d.group(2)))
    for r in records:
        r["pass"] = r.pop("pass_")
    bench.finalize(records)
    machine = open(machine_txt).read()
    gpus = [ln for ln in machine.splitlines() if ln.startswith("NVIDIA")]
    result = dict(schema="tabby-bench/1", mode="gpu", source=f"rebuilt from the progress log {log}: the run "
                  f"stopped at its time limit after {len(records)} of {total} measurements",
                  machine=f"{gpus[0].split(',')[0]} x {len(gpus)}" if gpus else "unknown", gpu_count=len(gpus),
                  machine_txt=machine, git_commit=commit, date=date, dense_matmul=dense,
                  dense_matmul_tflops=dense["tflops"] if dense else None, records=records)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# tabby bench (partial, rebuilt from its log): {result['machine']}\n\ncommit {commit}, {date}; "
                f"{len(records)} of {total} measurements\n\n" + bench.format_table(records) + "\n")
    bench.plot(records, result["dense_matmul_tflops"], stem + ".png")
    print(bench.format_table(records))


if __name__ == "__main__":
    main(*sys.argv[1:])
