#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `tabby bench` (on a machine without a GPU, a
# small CPU run of the layer against the reference). Extra arguments go to `tabby bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec .venv/bin/python -m tabby bench "$@"
