#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite; GPU tests skip without a GPU. Arguments go to
# pytest. The wall time (setup and tests) is printed last, on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
./scripts/setup.sh
setup_s=$((SECONDS - start))
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
total=$((SECONDS - start))
printf 'test suite wall time: %dm%02ds (setup %ds, pytest %ds)\n' $((total / 60)) $((total % 60)) "$setup_s" \
  $((total - setup_s)) >&2
exit "$rc"
