#!/usr/bin/env bash
# Create .venv with Tabby and its test/bench dependencies (idempotent).
# torch: the CPU build 2.13.0 on the CPU machines; where a CUDA torch is already installed
# (the GPU image), that one is used as is (--system-site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  [ -d .venv ] || python3 -m venv --system-site-packages .venv
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
else
  [ -d .venv ] || python3 -m venv .venv
  .venv/bin/pip install -q torch==2.13.0 -e ".[test]"
fi
