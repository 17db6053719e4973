#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run `tabby bench`: on GPUs the benchmark matrix; without a GPU a
# check of Tabby's two paths on small shapes at EP1, EP2 and EP4 with simulated ranks (about two
# minutes on two cores). Results go to ~/.cache/tabby/bench unless --out says otherwise. Extra
# arguments go to `tabby bench` (`--help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec .venv/bin/python -m tabby_bench bench "$@"
