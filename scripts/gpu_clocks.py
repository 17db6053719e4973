"""The GPU's SM clock, power and throttle reasons while each benchmark record was timed.

    python3 scripts/gpu_clocks.py gpu-clocks.csv RESULT.json [RESULT.json ...]

``gpu-clocks.csv``: ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
clocks_throttle_reasons.active --format=csv -lms 100`` (``device_run.sh fp8-bench`` writes it); the
results: ``tabby bench`` files (or their partial ``.jsonl``), whose records carry ``t_start`` / ``t_end`` (epoch seconds, the
timed run's warmup included). Prints a table, one row per record: its samples, the median and
lowest SM clock, the median and highest power, and the throttle reasons seen (nvidia-smi's bits).
The device's clock is taken as UTC (the lent machines run in UTC).
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from datetime import datetime, timezone

# clocks_throttle_reasons.active bits (nvidia-smi -q -d PERFORMANCE names them)
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal",
           0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


def reasons(mask: int) -> list[str]:
    """The names of the throttle reasons set in ``mask`` (unknown bits by value)."""
    out = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return out + ([hex(rest)] if rest else [])


def _number(field: str) -> float:
    """'1980 MHz' -> 1980.0, '655.20 W' -> 655.2; '[N/A]' -> nan."""
    try:
        return float(field.strip().split()[0])
    except (ValueError, IndexError):
        return float("nan")


def read_samples(path: str) -> list[tuple[float, float, float, int]]:
    """(epoch seconds, SM MHz, watts, throttle mask) per line of an nvidia-smi CSV log; lines that do
    not parse (nvidia-smi's header, a cut last line) are skipped."""
    out = []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5:
                continue
            try:
                t = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
                mask = int(row[4].strip(), 16)
            except ValueError:
                continue
            out.append((t.timestamp(), _number(row[1]), _number(row[2]), mask))
    return out


def per_record(samples, records) -> list[dict]:
    """For each record with ``t_start`` / ``t_end``: its samples' clock and power figures."""
    rows = []
    for r in records:
        if r.get("t_start") is None or r.get("t_end") is None:
            continue
        inside = [s for s in samples if r["t_start"] <= s[0] <= r["t_end"]]
        row = dict(impl=r.get("impl"), shape=r.get("shape"), pass_=r.get("pass"), ms=r.get("ms"),
                   ms_min=r.get("ms_min"), samples=len(inside))
        if inside:
            mhz = [s[1] for s in inside]
            watts = [s[2] for s in inside]
            mask = 0
            for s in inside:
                mask |= s[3]
            row.update(mhz_median=statistics.median(mhz), mhz_min=min(mhz), w_median=statistics.median(watts),
                       w_max=max(watts), reasons=reasons(mask))
        rows.append(row)
    return rows


def table(rows) -> str:
    """The rows as a markdown table."""
    head = "| shape | impl | pass | ms (median / min) | samples | SM MHz median / min | W median / max | throttle reasons |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        ms = f"{r['ms']:.2f} / {r['ms_min']:.2f}" if r.get("ms") is not None else "-"
        if r["samples"]:
            clk = f"{r['mhz_median']:.0f} / {r['mhz_min']:.0f}"
            pw = f"{r['w_median']:.0f} / {r['w_max']:.0f}"
            why = ", ".join(r["reasons"]) or "none"
        else:
            clk = pw = why = "-"
        lines.append(f"| {r['shape']} | {r['impl']} | {r['pass_']} | {ms} | {r['samples']} | {clk} | {pw} | {why} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    samples = read_samples(argv[0])
    records = []
    for path in argv[1:]:
        with open(path) as f:
            if path.endswith(".jsonl"):  # a bench's partial file: a record a line, among other objects
                records += [r for r in map(json.loads, filter(str.strip, f)) if "impl" in r]
            else:
                records += json.load(f)["records"]
    print(table(per_record(samples, records)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
