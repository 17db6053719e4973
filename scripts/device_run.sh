#!/usr/bin/env bash
# One batched call on the GPU machine (the device tool): GPU tests, then `tabby bench`.
# Usage: scripts/device_run.sh STAGE [bench or tune args...]; STAGE is tests, mega, mega-ep2, profile, tune,
# mega-pick, mega-bench, mega-tune, mega-tma, pull-check, pull-ab (PULL_AB_SHAPES), diag, ab (also runs combine unless AB_COMBINE=0), combine, timeline,
# bench or all.
# Knobs (env): MEGA_TIMEOUT, WITH_PROFILE=1 (profile after another stage), PROFILE_{SHAPES,TOKENS,EP,TIMEOUT},
# TUNE_TIMEOUT, TUNE_SHAPES, TUNE_TOKENS, BENCH_TIMEOUT, AB_SHAPES ("shape:tokens ..."), AB_VARIANTS, AB_EP (2).
# Writes logs and results under $OUT (the device tool brings that folder back).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-/tmp/tabby-out}
mkdir -p "$OUT/res"
stage=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/machine.txt" 2>&1
nvidia-smi topo -m >> "$OUT/machine.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" >> "$OUT/machine.txt"
echo "commit ${TABBY_GIT_COMMIT:-unknown: pass TABBY_GIT_COMMIT (the device tree has no .git)}" >> "$OUT/machine.txt"
mega_tests_ep2() {  # the megakernel's EP2 GPU tests, with fast-failing waits (TABBY_MEGA_CASES picks cases)
  TABBY_MAX_WAIT_MS=${TABBY_MAX_WAIT_MS:-20000} TABBY_DEBUG=1 timeout ${MEGA_TIMEOUT:-330} python3 -m pytest -q -rA -p no:cacheprovider --timeout ${MEGA_TIMEOUT:-330} -s \
    "tests/test_megakernel_gpu.py::test_megakernel_gpu[2]" 2>&1 | tee "$OUT/mega-tests.log" | grep -E "passed|failed|PASSED|FAILED|Error|assert" | tail -20
}
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  timeout 300 python3 -m pytest -q -rA -p no:cacheprovider --timeout 280 -s tests/test_moe_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|PASSED|FAILED|Error|error|assert" | tail -40
fi
if [ "$stage" = pull-check ]; then  # the token pull where session 14 saw it fail: after another shape, in the bench
  export TABBY_MAX_WAIT_MS=${TABBY_MAX_WAIT_MS:-20000}
  REPS=2 timeout 200 python3 scripts/diag_pull.py qwen3-30b-a3b 16384 \
    "qwen3-30b-a3b@4096:PT=1;qwen3-30b-a3b@16384:PT=1;qwen3-30b-a3b@16384:PT=0" 2>&1 | tee "$OUT/diag-pull.log" | grep -E "rank|Error"
  TABBY_MEGA_VARIANT=PT=1 timeout ${BENCH_TIMEOUT:-240} python3 -m tabby bench --out "$OUT/res" --tag ep2-pt1 --ep 2 \
    --shapes qwen3-30b-a3b,glm-5,gpt-oss-120b --tokens 16384 --impls floor,tabby --iters 10 --warmup 3 "$@" 2>&1 \
    | tee "$OUT/bench-pt1.log" | grep -E "^\||Error"
fi
if [ "$stage" = pull-ab ]; then  # the token pull's worth, fwd and fwd+bwd: benches alternating PT=1 (default) / PT=0
  for v in PT=1 PT=0 PT=1 PT=0; do
    TABBY_MEGA_VARIANT=$v timeout ${BENCH_TIMEOUT:-150} python3 -m tabby bench --out "$OUT/res" --tag "pull-ab-${v/=/}" --ep 2 \
      --shapes ${PULL_AB_SHAPES:-qwen3-30b-a3b} --tokens 16384 --impls floor,tabby --iters 20 --warmup 5 2>&1 \
      | tee -a "$OUT/pull-ab.log" | grep -E "^\| [a-z]" | grep -v torch
  done
fi
if [ "$stage" = mega ]; then  # the forward megakernel (issue 4): its GPU tests, with fast-failing waits
  TABBY_MAX_WAIT_MS=${TABBY_MAX_WAIT_MS:-20000} TABBY_DEBUG=1 timeout ${MEGA_TIMEOUT:-400} python3 -m pytest -q -rA -p no:cacheprovider --timeout ${MEGA_TIMEOUT:-400} -s \
    tests/test_megakernel_gpu.py 2>&1 | tee "$OUT/mega-tests.log" | grep -E "passed|failed|PASSED|FAILED|Error|error|assert|ms" | tail -40
fi
if [ "$stage" = profile ] || [ "$stage" = all ] || [ "${WITH_PROFILE:-0}" = 1 ]; then
  timeout ${PROFILE_TIMEOUT:-400} python3 -m tabby profile --shapes ${PROFILE_SHAPES:-qwen3-30b-a3b,kimi-k2} --tokens ${PROFILE_TOKENS:-4096,16384} --ep ${PROFILE_EP:-1,2} --out "$OUT/res/stages.json" 2>&1 | tee "$OUT/profile.log" | tail -40
fi
if [ "$stage" = tune ]; then  # forward megakernel variants vs the sync-free path and the floor
  timeout ${TUNE_TIMEOUT:-500} python3 -m tabby tune --out "$OUT/res/tune.json" "$@" 2>&1 | tee "$OUT/tune.log" | grep -v Warning | tail -60
fi
if [ "$stage" = mega-pick ]; then  # sweep megakernel variants, then bench the best one against the rest (EP2)
  timeout ${TUNE_TIMEOUT:-300} python3 -m tabby tune --shapes ${TUNE_SHAPES:-kimi-k2,qwen3-30b-a3b} \
    --tokens ${TUNE_TOKENS:-4096} --ep 2 --out "$OUT/res/tune.json" --best-out "$OUT/res/best-mega.txt" 2>&1 \
    | tee "$OUT/tune.log" | grep -E "^\||best mega"
  export TABBY_MEGA_VARIANT=$(cat "$OUT/res/best-mega.txt" 2>/dev/null)
  echo "bench with TABBY_MEGA_VARIANT='$TABBY_MEGA_VARIANT'"
  timeout ${BENCH_TIMEOUT:-300} python3 -m tabby bench --out "$OUT/res" --tag mega-pick --ep 2 \
    --impls floor,torch-a2a,tabby,tabby-sync-free --iters 10 --warmup 3 "$@" 2>&1 | tee "$OUT/bench.log" | grep -E "^\|" | tail -60
fi
if [ "$stage" = mega-ep2 ]; then  # only the megakernel's EP2 GPU tests (TABBY_MEGA_CASES: a subset of cases)
  mega_tests_ep2
fi
if [ "$stage" = mega-tma ]; then  # the megakernel's TMA paths (local rows and their wgrad gather, early ticket), EP2 then EP1
  export TABBY_MEGA_CONFIGS=${TABBY_MEGA_CONFIGS:-merged-tma,early-ticket,fill-local-rows}
  TABBY_MEGA_CASES=${TABBY_MEGA_CASES:-qwen3-30b-a3b,one-expert,one-rank-empty-experts} mega_tests_ep2
  TABBY_MAX_WAIT_MS=20000 TABBY_DEBUG=1 TABBY_MEGA_CASES=${EP1_CASES:-qwen3-30b-a3b} timeout ${MEGA_TIMEOUT:-330} \
    python3 -m pytest -q -rA -p no:cacheprovider -s "tests/test_megakernel_gpu.py::test_megakernel_gpu[1]" 2>&1 \
    | tee "$OUT/mega-tests-ep1.log" | grep -E "passed|failed|PASSED|FAILED|Error|assert" | tail -10
fi
if [ "$stage" = mega-bench ]; then  # the megakernel's GPU tests (fast-failing waits), then the EP2 bench of both paths
  mega_tests_ep2
  timeout ${BENCH_TIMEOUT:-360} python3 -m tabby bench --out "$OUT/res" --tag ep2 --ep 2 \
    --impls floor,torch-a2a,tabby,tabby-sync-free --iters 10 --warmup 3 "$@" 2>&1 | tee "$OUT/bench.log" | grep -E "^\|" | tail -60
fi
if [ "$stage" = mega-tune ]; then  # the megakernel's EP2 GPU tests (not with SKIP_MEGA_TESTS=1), then `tabby tune`
  [ "${SKIP_MEGA_TESTS:-0}" = 1 ] || mega_tests_ep2
  timeout ${TUNE_TIMEOUT:-400} python3 -m tabby tune --out "$OUT/res/tune.json" "$@" 2>&1 | tee "$OUT/tune.log" | grep -v Warning | tail -60
  if [ -n "${TUNE2_ARGS:-}" ]; then  # a second sweep (other shapes or variants)
    timeout ${TUNE2_TIMEOUT:-300} python3 -m tabby tune --out "$OUT/res/tune2.json" $TUNE2_ARGS 2>&1 | tee "$OUT/tune2.log" | grep -E "^\|" | tail -30
  fi
fi
if [ "$stage" = diag ]; then  # where the forward's time goes at the issue-4 targets (fits the tool's file limit)
  for st in qwen3.5-397b:4096 qwen3-30b-a3b:16384; do
    timeout ${PROFILE_TIMEOUT:-150} python3 -m tabby profile --mega --fwd-only --shapes ${st%%:*} --tokens ${st##*:} \
      --ep 2 --iters 20 --out "$OUT/res/diag-profile-${st%%:*}-${st##*:}.json" 2>&1 | grep -v -e Warn -e "return func" >> "$OUT/diag.log"
  done
  # both ranks' ticket traces of the default and of two ablations (no row copies, pushes kept local)
  timeout ${TUNE_TIMEOUT:-240} python3 -m tabby tune --shapes ${DIAG_SHAPE:-qwen3-30b-a3b} --tokens ${DIAG_TOKENS:-16384} \
    --ep 2 --variants "floor;mega;mega:A=1;mega:A=4" --trace 2048 --out "$OUT/res/diag-tune.json" 2>&1 \
    | grep -v -e Warn -e "return func" >> "$OUT/diag.log"
  find "$OUT/res" -name 'trace-*.png' ! -name '*-mega-rank*.png' -delete  # timelines of the default only
  grep -E "^\||fwd:|rank [01]:|EP2: fwd" "$OUT/diag.log" | tail -60
fi
if [ "$stage" = ab ]; then  # back-to-back variants under autograd (the clock drifts within a run): AB_VARIANTS per AB_SHAPES
  for st in ${AB_SHAPES:-gpt-oss-120b:16384 qwen3-30b-a3b:16384}; do
    timeout ${TUNE_TIMEOUT:-200} python3 -m tabby tune --grad --shapes ${st%%:*} --tokens ${st##*:} --ep ${AB_EP:-2} \
      --variants "${AB_VARIANTS:-floor;mega;mega:O=0;mega;mega:O=0;floor}" \
      --out "$OUT/res/ab-${st%%:*}-${st##*:}.json" 2>&1 | grep -v -e Warn -e "return func" >> "$OUT/ab.log"
  done
  grep -E "^\|" "$OUT/ab.log"
fi
if { [ "$stage" = ab ] && [ "${AB_COMBINE:-1}" = 1 ]; } || [ "$stage" = combine ]; then  # combine blocks (one GPU, ~10 s)
  timeout 120 python3 scripts/combine_bench.py 2>&1 | tee "$OUT/combine-bench.log" | grep -E "^\|"
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  python3 -m tabby bench --out "$OUT/res" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
if [ "$stage" = timeline ]; then  # kernel timeline of the forward on every rank (torch.profiler): TL_SHAPE, TL_TOKENS
  timeout ${TL_TIMEOUT:-200} python3 scripts/timeline.py --shape ${TL_SHAPE:-qwen3-30b-a3b} --tokens ${TL_TOKENS:-16384} \
    --ep ${TL_EP:-2} --out "$OUT/res/timeline.json" 2>&1 | grep -v -e Warn -e "return func" | tee "$OUT/timeline.log" | tail -80
fi
