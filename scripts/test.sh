#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
