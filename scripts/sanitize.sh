#!/usr/bin/env bash
# compute-sanitizer over a tiny forward + backward of every path (scripts/sanitize_case.py, EP1).
#
#   scripts/sanitize.sh [OUT_DIR]          OUT_DIR: default $OUT, else ./sanitize-out
#
# For each tool (memcheck, racecheck, synccheck; SANITIZE_TOOLS overrides) the log goes to
# OUT_DIR/sanitizer-<tool>.log and one line to stdout and OUT_DIR/sanitizer-summary.txt:
#   <tool>: rc=<exit status> errors=<ERROR SUMMARY count; racecheck: hazards> case=<ok|FAILED|?> [timed out after N s]
# First a run without the sanitizer (OUT_DIR/sanitize-warmup.log) compiles the kernels into
# Triton's cache, so that each tool's time goes to running them.
#
# Environment: SANITIZE_TIMEOUT (s per tool, default 300), SANITIZE_ARGS (extra arguments of
# sanitize_case.py, e.g. "--shared"), PYTHON (default .venv/bin/python, else python3),
# COMPUTE_SANITIZER (the binary; default: on PATH or under /usr/local/cuda*/bin),
# SANITIZE_DEVICE (default cuda; cpu only checks this script's plumbing with a stand-in sanitizer),
# TABBY_MAX_WAIT_MS (default 100000: waits are slow under a sanitizer; below the tool timeout, so
# a wait that never ends is Tabby's error record, not a kill).
# PyTorch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that memcheck sees each
# tensor's own bounds.
# Exit status: 0 when every tool ran, found 0 errors and the case was right; 1 when a tool found
# errors, timed out or the case failed; 2 when compute-sanitizer or the GPU is missing.
set -u
cd "$(dirname "$0")/.." || exit 2
out="${1:-${OUT:-sanitize-out}}"
mkdir -p "$out" || exit 2
summary="$out/sanitizer-summary.txt"
: > "$summary"

py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
tools="${SANITIZE_TOOLS:-memcheck racecheck synccheck}"
tool_timeout="${SANITIZE_TIMEOUT:-300}"
device="${SANITIZE_DEVICE:-cuda}"
case_args="--device $device ${SANITIZE_ARGS:-}"
export TABBY_MAX_WAIT_MS="${TABBY_MAX_WAIT_MS:-100000}"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

note() { echo "$1"; echo "$1" >> "$summary"; }

sanitizer="${COMPUTE_SANITIZER:-}"
if [ -z "$sanitizer" ]; then
  sanitizer="$(command -v compute-sanitizer || true)"
fi
if [ -z "$sanitizer" ]; then
  for cand in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
    if [ -x "$cand" ]; then sanitizer="$cand"; break; fi
  done
fi
if [ -z "$sanitizer" ] || [ ! -x "$sanitizer" ]; then
  note "compute-sanitizer not found (set COMPUTE_SANITIZER)"
  exit 2
fi
if [ "$device" = cuda ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1; then
  note "no CUDA device visible to $py"
  exit 2
fi
note "compute-sanitizer: $sanitizer ($("$sanitizer" --version 2>/dev/null | tail -1))"

# shellcheck disable=SC2086  # case_args is a list of words
timeout --kill-after=10 "$tool_timeout" "$py" scripts/sanitize_case.py $case_args > "$out/sanitize-warmup.log" 2>&1
rc=$?
note "warm-up (no sanitizer): rc=$rc case=$(grep -o 'sanitize_case: [A-Za-z]*' "$out/sanitize-warmup.log" | tail -1 | cut -d' ' -f2)"

status=0
for tool in $tools; do
  log="$out/sanitizer-$tool.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$tool_timeout" "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 200 \
    "$py" scripts/sanitize_case.py $case_args > "$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  errors="$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | tail -1 | grep -Eo '[0-9]+' || true)"
  hazards=""
  if [ "$tool" = racecheck ]; then
    # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" instead of
    # an ERROR SUMMARY: its count is the hazards, errors and warnings both
    hazards="$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard[s]? displayed \([0-9]+ error[s]?, [0-9]+ warning[s]?\)' "$log" | tail -1 || true)"
    [ -n "$errors" ] || errors="$(echo "$hazards" | grep -Eo '[0-9]+' | head -1)"
  fi
  [ -n "$errors" ] || errors="?"
  case_status="$(grep -o 'sanitize_case: [A-Za-z]*' "$log" | tail -1 | cut -d' ' -f2)"
  [ -n "$case_status" ] || case_status="?"
  line="$tool: rc=$rc errors=$errors case=$case_status (${took} s)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    line="$line timed out after $tool_timeout s"
  fi
  [ -z "$hazards" ] || line="$line; $hazards"
  note "$line"
  if [ "$rc" -ne 0 ] || [ "$errors" != "0" ] || [ "$case_status" != "ok" ]; then
    status=1
  fi
done
note "sanitize: $([ $status -eq 0 ] && echo clean || echo 'NOT clean') (logs in $out)"
exit $status
