#!/usr/bin/env bash
# device call 2: main's FP8 layer and GEMM tests (new weight-gradient tiles), FP8 end-to-end training
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TABBY_GIT_COMMIT=fc8d45a
O=/tmp/o2; mkdir -p $O/train
for f in tests/test_fp8_layer.py tests/test_fp8_gemm.py; do
  (TABBY_MAX_WAIT_MS=20000 timeout 540 python3 -m pytest -q -rA -p no:cacheprovider $f > $O/gpu-tests-$(basename $f .py).log 2>&1) &
done
timeout 545 python3 -m tabby_bench train --models qwen3-moe --experts grouped_mm,tabby --modes eager --tabby-config "precision=fp8;megakernel=0" --tag fp8 --out $O/train > $O/train.log 2>&1
echo "train rc $?"; grep -v " step " $O/train.log | tail -30
wait
for f in $O/gpu-tests-*.log; do echo "== $f: $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" $f | head; done
tar -czf $OUT/all.tgz -C /tmp o2
