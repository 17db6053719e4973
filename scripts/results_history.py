#!/usr/bin/env python3
"""Append the records of `tabby bench` result files to bench/results/history.jsonl.

    python3 scripts/results_history.py bench/results/2xh200-ep2/bench-2xh200-ep2-20261130T221124Z.json
    python3 scripts/results_history.py --history /tmp/h.jsonl a.json b.json   # another history file

One line per record (a shape, token count, EP size, pass and implementation of one run):

    {"shape", "tokens", "ep", "pass", "impl", "ms", "tflops", "x_floor", "vs_anchor", "correct",
     "machine", "commit", "date", "source"}

``x_floor`` is the record's time over the compute-only floor's (same shape, tokens, EP, pass),
``vs_anchor`` the best correct anchor's time over the record's (None where the run had no anchor).
``source`` is the bench file's path relative to bench/results/ when it lies there, else its name.

The history is append-only: a source already in it is skipped (so running this twice appends
nothing), and the files given are appended in the order of their dates. Files without a date or
commit in their header (a run cut before its JSON was written, rebuilt from records) take the
commit from a 7-to-40-digit hex word in the file name (or ``--commit``) and the date from a
``YYYYMMDDTHHMMSSZ`` stamp in the name (or ``--date``).

Accepted inputs: a bench JSON (``{"schema": "tabby-bench/1", ..., "records": [...]}``) or a JSONL
file of bare records. The bench tool may also call :func:`append` directly.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
HISTORY = RESULTS / "history.jsonl"
FIELDS = ("shape", "tokens", "ep", "pass", "impl", "ms", "tflops", "x_floor", "vs_anchor", "correct",
          "machine", "commit", "date", "source")

_HEX = re.compile(r"(?<![0-9a-zA-Z])([0-9a-f]{7,40})(?![0-9a-zA-Z])")
_STAMP = re.compile(r"(\d{8})T(\d{4,6})Z")


def _round(value, digits):
    return None if value is None else round(float(value), digits)


def _iso_date(text: str | None) -> str | None:
    """An ISO 8601 date in UTC (``2026-11-30T22:11:24+00:00``) from the bench header's date or a
    file-name stamp; None if there is none."""
    if not text:
        return None
    m = _STAMP.fullmatch(text)
    if m:
        day, clock = m.group(1), m.group(2).ljust(6, "0")
        return datetime.strptime(day + clock, "%Y%m%d%H%M%S").replace(tzinfo=timezone.utc).isoformat()
    text = text.replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat()


def _machine(header: dict, name: str) -> str | None:
    """``NVIDIA H200 x 2``: the GPU and how many (the host name dropped)."""
    if header.get("gpu_name") and header.get("gpu_count"):
        return f"{header['gpu_name']} x {header['gpu_count']}"
    machine = header.get("machine")
    if machine:
        return machine.split(" / ")[0]
    m = re.search(r"(\d+)xh200", name)
    return f"NVIDIA H200 x {m.group(1)}" if m else None


def _source(path: Path) -> str:
    try:
        return path.resolve().relative_to(RESULTS).as_posix()
    except ValueError:
        return path.name


def read_bench(path: Path, commit: str | None = None, date: str | None = None) -> list[dict]:
    """The history lines of one bench file."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        header, records = {}, [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        header = json.loads(text)
        records = header.get("records", [])
    if commit is None:
        commit = header.get("git_commit")
        if not commit or not _HEX.fullmatch(str(commit)):
            # a hex word of the name with a letter in it (a date such as 20261130 is not a commit)
            commit = next((w for w in _HEX.findall(path.stem) if re.search("[a-f]", w)), None)
    if commit:
        commit = str(commit)[:7]
    stamp = _STAMP.search(path.name)
    date = _iso_date(date) or _iso_date(header.get("date")) or (_iso_date(stamp.group(0)) if stamp else None)
    machine, source = _machine(header, path.name), _source(path)
    lines = []
    for r in records:
        lines.append({
            "shape": r.get("shape"),
            "tokens": r.get("tokens_per_gpu"),
            "ep": r.get("ep"),
            "pass": r.get("pass"),
            "impl": r.get("impl"),
            "ms": _round(r.get("ms"), 4),
            "tflops": _round(r.get("tflops"), 1),
            "x_floor": _round(r.get("ratio_to_floor"), 3),
            "vs_anchor": _round(r.get("speedup_vs_best_anchor"), 3),
            "correct": r.get("correct"),
            "machine": machine,
            "commit": commit,
            "date": date,
            "source": source,
        })
    return lines


def _sources_in(history: Path) -> set[str]:
    if not history.exists():
        return set()
    return {json.loads(line)["source"] for line in history.read_text().splitlines() if line.strip()}


def append(paths, history: Path = HISTORY, commit: str | None = None, date: str | None = None) -> int:
    """Append every record of the bench files ``paths`` whose source is not in ``history`` yet;
    returns the number of lines appended."""
    seen = _sources_in(history)
    batches = []
    for p in map(Path, paths):
        lines = read_bench(p, commit=commit, date=date)
        if lines and lines[0]["source"] not in seen:
            batches.append(lines)
            seen.add(lines[0]["source"])
    batches.sort(key=lambda b: b[0]["date"] or "")
    n = 0
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a") as f:
        for lines in batches:
            for line in lines:
                f.write(json.dumps(line) + "\n")
                n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench JSON (or JSONL of records) files")
    ap.add_argument("--history", type=Path, default=HISTORY, help=f"history file (default {HISTORY})")
    ap.add_argument("--commit", default=None, help="commit of the runs, where their header has none")
    ap.add_argument("--date", default=None, help="date of the runs (ISO 8601), where their header has none")
    args = ap.parse_args(argv)
    n = append(args.files, args.history, args.commit, args.date)
    print(f"{n} records appended to {args.history}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
