#!/usr/bin/env bash
# device call 3 at fc8d45a: fp8_bench GEMMs (weight-gradient and transpose tiles), the FP8 layer bench on six shapes
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TABBY_GIT_COMMIT=fc8d45a
O=/tmp/o3; mkdir -p $O/res
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $O/machine.txt
timeout 150 python3 scripts/fp8_bench.py --gemm-only > $O/fp8-bench.log 2>&1; echo "fp8_bench rc $?"; tail -4 $O/fp8-bench.log
S=kimi-k2,glm-5,deepseek-v4-pro,qwen3-30b-a3b,gpt-oss-120b,qwen3.5-397b
timeout 200 python3 -m tabby_bench bench --ep 1 --tokens 16384 --shapes $S --impls tabby,tabby-fp8 --weights fixed --iters 10 --warmup 3 --out $O/res --tag fp8-fixed > $O/bench-fixed.log 2>&1; echo "fixed rc $?"; tail -22 $O/bench-fixed.log
timeout 230 python3 -m tabby_bench bench --ep 1 --tokens 16384 --shapes $S --impls tabby-fp8,torch-fp8 --weights new --iters 10 --warmup 3 --out $O/res --tag fp8-new > $O/bench-new.log 2>&1; echo "new rc $?"; tail -22 $O/bench-new.log
tar -czf $OUT/all.tgz -C /tmp o3
