#!/usr/bin/env bash
# device call 1: fp8-measure tree (Gluon with prefetched scales, dgrad from a view) and main's FP8 layer tests
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=/tmp/o1; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $O/machine.txt
(cd _main && PYTHONPATH=$PWD TABBY_MAX_WAIT_MS=20000 timeout 330 python3 -m pytest -q -rA -p no:cacheprovider tests/test_fp8_layer.py > $O/main-test_fp8_layer.log 2>&1) &
P1=$!
(PYTHONPATH=$PWD TABBY_MAX_WAIT_MS=20000 timeout 250 python3 -m pytest -q -rA -p no:cacheprovider tests/test_fp8_gluon.py > $O/measure-test_fp8_gluon.log 2>&1) &
P2=$!
wait $P2; echo "gluon tests: $(tail -1 $O/measure-test_fp8_gluon.log)"
wait $P1; echo "main layer tests: $(tail -1 $O/main-test_fp8_layer.log)"
PYTHONPATH=$PWD TABBY_GIT_COMMIT=$MEASURE timeout 200 python3 scripts/fp8_bench.py --gemm-only > $O/fp8-bench-measure.log 2>&1
echo "bench rc $?"; tail -60 $O/fp8-bench-measure.log
grep -E "^(FAILED|ERROR)" $O/*.log | head
tar -czf $OUT/all.tgz -C /tmp o1
