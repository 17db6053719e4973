#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite; GPU tests skip without a GPU. Arguments go to
# pytest. Without a GPU the tests run in 2 processes (pytest-xdist; TABBY_TEST_WORKERS to change),
# each rank of a simulated group a thread. The wall time (setup and tests) is printed last, on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
./scripts/setup.sh
setup_s=$((SECONDS - start))
workers=()
if .venv/bin/python -c "import xdist, torch, sys; sys.exit(1 if torch.cuda.is_available() else 0)" 2>/dev/null; then
  workers=(-n "${TABBY_TEST_WORKERS:-2}" --dist worksteal)  # (a worker that runs out takes the other's tests)
fi
rc=0
.venv/bin/python -m pytest -q "${workers[@]}" "$@" || rc=$?
total=$((SECONDS - start))
printf 'test suite wall time: %dm%02ds (setup %ds, pytest %ds)\n' $((total / 60)) $((total % 60)) "$setup_s" \
  $((total - setup_s)) >&2
exit "$rc"
