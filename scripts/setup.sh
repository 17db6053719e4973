#!/usr/bin/env bash
# Create .venv with Tabby (editable) and its test dependencies. Idempotent: once set up, a rerun
# does nothing until pyproject.toml, this script or the package version changes.
# Without a GPU: torch 2.13.0, the CPU build (the machine's pip configuration provides it), and
# triton 3.6.0. Where a CUDA torch is already installed (a GPU image), the venv sees it
# (--system-site-packages) and Tabby is installed without touching it.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  kind=gpu
else
  kind=cpu
fi
stamp=".venv/.tabby-setup"
want="$kind $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $(grep -m1 '^__version__' tabby/__init__.py)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ "$kind" = gpu ]; then
  [ -d .venv ] || python3 -m venv --system-site-packages .venv
  "${PIP[@]}" --no-deps --no-build-isolation -e .
else
  [ -d .venv ] || python3 -m venv .venv
  "${PIP[@]}" "torch==2.13.0" -e ".[test]"
  # torchtitan, for its backend's CPU test, with only the packages its MoE imports need (its
  # declared ones add datasets, wandb, tensorboard... that the test never imports)
  "${PIP[@]}" --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
    torchdata==0.11.0 typeguard==4.6.1 einops==0.8.2
fi
echo "$want" > "$stamp"
