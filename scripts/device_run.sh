#!/usr/bin/env bash
# One batched call on a GPU machine: the GPU tests, then the benchmark matrix.
# Usage: scripts/device_run.sh STAGE [bench args...]
#   tests   the GPU tests (tests/test_*_gpu.py, or the files in GPU_TESTS), one process per file in parallel,
#           a log each (gpu-tests-NAME.log); bounded waits fail fast, device errors checked per pass
#   bench   the EP1 matrix: floor, tabby and tabby-sync-free on the six shapes at 4096 and 16384 tokens, the
#           clock logged as in fp8-bench
#           (extra args go to `tabby bench` after these and override them, e.g. --ep 2 --impls ...)
#   train   the end-to-end training benchmark (tabby train; extra args go to it)
#   reliability  the GPU fault test, compute-sanitizer (memcheck, racecheck, synccheck), the soak and the
#           fuzzer at EP1
#           (SOAK_S, FUZZ_S: their time budgets in seconds, default 120 each; FUZZ_PRECOMPILE_S: the
#           fuzzer's kernels compiled first in parallel, default 120)
#   fp8-tests  the FP8 test files but the layer's two, and test_custom_op (which runs FP8 through
#           torch.compile), in parallel as tests
#   fp8-layer-tests  the FP8 layer's GPU files (test_fp8_cases_gpu.py, test_fp8_layer_gpu.py), one process per
#           group of cases of one shape (scripts/gpu_case_groups.py: each shape's kernels compile once)
#   fp8-bench  the FP8 layer's stage profile at kimi-k2 and deepseek-v4-pro (FP8_PROFILE_SHAPES), and the layer bench at 16384 tokens on the six shapes:
#           tabby against tabby-fp8 with fixed weights (their FP8 copies reused), tabby-fp8 against torch-fp8
#           from a new weight version per call (both quantize; FP8_BENCH_NEW=0 skips it; FP8_BENCH_SHAPES: other
#           shapes, FP8_BENCH_TOKENS other token counts and FP8_BENCH_IMPLS other rows of the fixed-weight bench);
#           about 430 s;
#           the SM clock, power and throttle reasons sampled every 100 ms meanwhile (gpu-clocks.csv), and
#           per timed record (gpu-clocks-by-record.md, scripts/gpu_clocks.py)
#   ab      the EP1 matrix at 16384 tokens on the six shapes (floor, tabby, tabby-fp8; weights fixed) of this tree,
#           then of the tree in $BASE_TREE (a checkout of an earlier commit, carried: `git worktree add .base REV`,
#           excluded from git, named in the call's carry; BASE_COMMIT its commit) on the same machine; AB_SHAPES, AB_IMPLS (this tree's rows)
#           and AB_BASE_IMPLS (the earlier tree's, default tabby,tabby-fp8) to narrow it
#   all     tests, then bench
# Logs and results go under $RUN_DIR (default /tmp/tabby-run-<the calling shell's pid>: one folder a call); where $OUT is set (the device tool's
# folder, from which at most 8 files come back) they are packed into $OUT/tabby-run.tgz after each
# stage and on exit, so a call cut short still returns what its finished stages wrote.
# TABBY_GIT_COMMIT names the commit the results record. Pass it as a literal computed on the machine that
# committed (`git rev-parse --short HEAD` there): the device's copy of the tree carries a stale .git, so
# `$(git rev-parse ...)` inside the device command names an old commit.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
RETURN_DIR=${OUT:-}
# one folder per device call: the machine keeps /tmp (and earlier calls' files) between calls, and the stages
# chained in one call's command share its shell ($PPID)
OUT=${RUN_DIR:-/tmp/tabby-run-$PPID}
mkdir -p "$OUT/res"
pack() {
  if [ -n "$RETURN_DIR" ]; then tar czf "$RETURN_DIR/tabby-run.tgz.part" -C "$OUT" . && mv "$RETURN_DIR/tabby-run.tgz.part" "$RETURN_DIR/tabby-run.tgz"; fi
}
trap pack EXIT
trap 'exit 143' TERM
# the tests stages end their processes by this time (STAGE_BUDGET_S after the start, default 540 s:
# under a device call's 600) and pack what they have; a case that would start later is not run and says so
export DEADLINE=$(( $(date +%s) + ${STAGE_BUDGET_S:-540} ))
stage=${1:-all}; shift || true
case "$stage" in tests|bench|train|reliability|fp8-tests|fp8-layer-tests|fp8-bench|ab|all) ;;
  *) echo "unknown stage '$stage': tests, bench, train, reliability, fp8-tests, fp8-layer-tests, fp8-bench, ab or all" >&2; exit 2;; esac
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/machine.txt" 2>&1
nvidia-smi topo -m >> "$OUT/machine.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" >> "$OUT/machine.txt"
echo "commit ${TABBY_GIT_COMMIT:-unknown: pass TABBY_GIT_COMMIT}" >> "$OUT/machine.txt"
status=0
report_log() {
  # NAME LOG: the log's last line (pytest's summary) and its first failures
  echo "== $1: $(tail -1 "$2")"
  grep -E "^(FAILED|ERROR)|Error|assert" "$2" | head -10
}
start_clocks() {
  # the SM clock, power and throttle reasons every 100 ms into gpu-clocks.csv, until stop_clocks
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$OUT/gpu-clocks.csv" 2>&1 &
  clocks_pid=$!
}
stop_clocks() {
  # ends the log; each timed record's clock, power and throttle reasons (the complete results, or a
  # cut bench's partial records) into gpu-clocks-by-record.md (scripts/gpu_clocks.py)
  kill "$clocks_pid" 2>/dev/null
  python3 scripts/gpu_clocks.py "$OUT/gpu-clocks.csv" $(ls "$OUT"/res/bench-*.json "$OUT"/res/*.jsonl 2>/dev/null) \
    > "$OUT/gpu-clocks-by-record.md" 2>&1
}
run_pytest() {
  # LOG ARGS...: pytest on ARGS into LOG, ended by the stage's deadline or TESTS_TIMEOUT (default 580 s)
  local log=$1 left=$(( DEADLINE - $(date +%s) )) t=${TESTS_TIMEOUT:-580}
  shift
  [ "$left" -lt "$t" ] && t=$left
  TABBY_MAX_WAIT_MS=${TABBY_MAX_WAIT_MS:-20000} TABBY_DEBUG=1 timeout "$t" \
    python3 -m pytest -q -rA -p no:cacheprovider "$@" > "$log" 2>&1
}
run_tests() {
  # one pytest process per file, all at once: cold, each file is bound by compiling its kernels
  # (one core each), so in parallel the suite fits one call; their GPU work is small
  local pids=() f log p
  for f in "$@"; do
    log="$OUT/gpu-tests-$(basename "$f" .py).log"
    run_pytest "$log" "$f" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  for f in "$@"; do
    log="$OUT/gpu-tests-$(basename "$f" .py).log"
    report_log "$(basename "$log")" "$log"
  done
}
run_tests_by_shape() {
  # one pytest process per group of test cases that compile the same shapes' kernels
  # (scripts/gpu_case_groups.py), all at once: compiling is what the cases cost, and a group
  # compiles each of its shapes' kernels once
  local groups g id i=0
  mapfile -t groups < <(python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep '::' |
                        python3 scripts/gpu_case_groups.py)
  local pids=()
  for g in "${groups[@]}"; do
    # (one intra-op thread each; the references run on the GPU)
    OMP_NUM_THREADS=1 run_pytest "$OUT/gpu-tests-fp8-layer-group$i.log" --durations=0 $g &
    pids+=($!)
    i=$((i + 1))
  done
  for g in "${pids[@]}"; do wait "$g" || status=1; done
  i=0
  for g in "${groups[@]}"; do
    report_log "group $i ($(echo $g | wc -w) cases)" "$OUT/gpu-tests-fp8-layer-group$i.log"
    # cases not reached before the timeout: not in the log's PASSED / FAILED lines
    for id in $g; do
      grep -q -F -e "PASSED $id" -e "FAILED $id" -e "ERROR $id" "$OUT/gpu-tests-fp8-layer-group$i.log" ||
        echo "   NOT FINISHED (or skipped): $id"
    done
    i=$((i + 1))
  done
}
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  run_tests ${GPU_TESTS:-tests/test_*_gpu.py}
fi
pack
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  start_clocks
  python3 -m tabby_bench bench --ep 1 \
    --shapes qwen3-30b-a3b,gpt-oss-120b,deepseek-v4-pro,kimi-k2,glm-5,qwen3.5-397b --tokens 4096,16384 \
    --impls floor,tabby,tabby-sync-free --iters 10 --warmup 3 --out "$OUT/res" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  stop_clocks
fi
pack
if [ "$stage" = train ]; then
  mkdir -p "$OUT/train"
  python3 -m tabby_bench train --out "$OUT/train" "$@" 2>&1 | tee "$OUT/train.log" | grep -v " step " | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
pack
if [ "$stage" = reliability ]; then
  python3 -m pytest -q -rA -p no:cacheprovider tests/test_faults_gpu.py 2>&1 | tee "$OUT/faults-gpu.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-150} PYTHON=python3 bash scripts/sanitize.sh "$OUT/sanitize" || status=1
  python3 scripts/soak.py --calls 100000 --time-budget "${SOAK_S:-120}" --out "$OUT/soak" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 scripts/fuzz.py --cases 100000 --time-budget "${FUZZ_S:-120}" \
    --precompile "${FUZZ_PRECOMPILE_S:-120}" --device cuda --out "$OUT/fuzz" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
pack
fp8_layer_files="tests/test_fp8_cases_gpu.py tests/test_fp8_layer_gpu.py"
if [ "$stage" = fp8-tests ]; then
  run_tests $(ls tests/test_fp8*.py tests/test_custom_op.py | grep -v -F -x -e ${fp8_layer_files// / -e })
fi
pack
if [ "$stage" = fp8-layer-tests ]; then
  run_tests_by_shape $fp8_layer_files
fi
pack
pack
if [ "$stage" = fp8-bench ]; then
  fp8_shapes=${FP8_BENCH_SHAPES:-kimi-k2,glm-5,deepseek-v4-pro,qwen3-30b-a3b,gpt-oss-120b,qwen3.5-397b}
  start_clocks
  # (packed after each step: a call cut at its limit keeps what the finished steps wrote)
  python3 -m tabby_bench profile --precision fp8 --shapes "${FP8_PROFILE_SHAPES:-kimi-k2,deepseek-v4-pro}" --tokens 16384 --out "$OUT/res/profile-fp8.json" \
    2>&1 | tee "$OUT/profile-fp8.log" | tail -30
  pack
  python3 -m tabby_bench bench --ep 1 --tokens "${FP8_BENCH_TOKENS:-16384}" --shapes $fp8_shapes \
    --impls "${FP8_BENCH_IMPLS:-tabby,tabby-fp8}" --weights fixed \
    --iters 10 --warmup 3 --out "$OUT/res" --tag fp8-fixed 2>&1 | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  pack
  if [ "${FP8_BENCH_NEW:-1}" = 1 ]; then
    python3 -m tabby_bench bench --ep 1 --tokens 16384 --shapes $fp8_shapes --impls tabby-fp8,torch-fp8 --weights new \
      --iters 10 --warmup 3 --out "$OUT/res" --tag fp8-new 2>&1 | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  stop_clocks
  cat "$OUT/gpu-clocks-by-record.md"
fi
pack
if [ "$stage" = ab ]; then
  start_clocks
  for tree in . "${BASE_TREE:?ab needs BASE_TREE}"; do
    name=$([ "$tree" = . ] && echo new || echo base)
    # (the earlier tree's records name BASE_COMMIT: the device's copy has no git history of .base)
    commit=$([ "$name" = new ] && echo "${TABBY_GIT_COMMIT:-unknown}" || echo "${BASE_COMMIT:?ab needs BASE_COMMIT}")
    (cd "$tree" && TABBY_GIT_COMMIT="$commit" PYTHONPATH="$PWD" python3 -m tabby_bench bench --ep 1 --tokens 16384 \
      --shapes "${AB_SHAPES:-qwen3-30b-a3b,gpt-oss-120b,deepseek-v4-pro,kimi-k2,glm-5,qwen3.5-397b}" \
      --impls "$([ "$name" = new ] && echo "${AB_IMPLS:-floor,tabby,tabby-fp8}" || echo "${AB_BASE_IMPLS:-tabby,tabby-fp8}")" \
      --weights fixed --iters 10 --warmup 3 --out "$OUT/res" \
      --tag "ab-$name" 2>&1 | tee "$OUT/bench-ab-$name.log" | tail -25)
    pack
  done
  stop_clocks
fi
pack
exit $status
