#!/usr/bin/env bash
# Runs a few small cuda-backend parity tests under compute-sanitizer's memcheck and prints each
# step's ERROR SUMMARY: out-of-bounds or misaligned accesses by the kernels, on the library's own
# buffers and (XLA_PYTHON_CLIENT_ALLOCATOR=platform: one allocation per buffer, so the bounds are
# exact) on the arrays XLA hands to the FFI calls. Build first (benchmarks/gpu_run.sh).
# Logs go to $OUT (the device tool's output folder) or ./gpu_logs.
#   benchmarks/gpu_memcheck.sh [STEP...]   (default: ep1 ep2)
#   benchmarks/gpu_memcheck.sh --list [STEP...]   the pytest node ids of each step, one a line,
#         nothing run (tests/test_gpu_scripts.py checks that every one exists: the ids went
#         stale twice when a test's parameters changed, and the step then checked nothing)
#   race1 the cases of ep1 under racecheck (shared-memory hazards between a block's threads)
#   ep1   the two axis_size=1 cases of tests/gpu/test_cuda_backend.py (fp8 + source; bf16 +
#         expert with padding), and two world-1 cases of fused kernels against the halves (one
#         chunk of 1200 slots, fp8 + expert; more chunks than SMs, bf16 + source with expert
#         padding 16): every kernel, no peer
#   dequant  jm.dequantize_fp8's kernel (jm.dequantize_fp8's default on a GPU) on the six shapes
#         of tests/gpu/test_dequantize_gpu.py (odd leading dims, a part-full last block, the
#         smallest vector)
#   ep2   one axis_size=2 case (split calls, expert combine, bf16 partials): writes to the peer
#         GPU. If the sanitizer runs the two devices' kernels one after the other, the first
#         exchange ends in TIMEOUT (the test fails) and the summary still counts memory errors.
set -u -o pipefail
list=0
if [ "${1:-}" = --list ]; then
  list=1
  shift
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(ep1 ep2)

# parity CASE: pytest node id of one case of the parity test in tests/gpu/test_cuda_backend.py,
# on the NVLink path (the test's `path` fixture comes first in the id)
parity() {
  echo "tests/gpu/test_cuda_backend.py::test_cuda_on_poisoned_memory_matches_reference_and_xla[nvlink-$1]"
}

# world1 CASE: one case of the world-1 fused-against-halves test
# ([dispatch-reduce-padding-sms-tokens])
world1() {
  echo "tests/gpu/test_cuda_backend.py::test_world1_fused_kernels_equal_the_buffer_halves_for_any_chunking[$1]"
}

# nodes STEP: the node ids STEP runs, one a line
nodes() {
  case $1 in
    ep1|race1)
      parity axis_size=1,dispatch=fp8
      parity axis_size=1,dispatch=bf16,combine_reduce=expert,expert_padding=16
      world1 fp8-expert-1-1-300
      world1 bf16-source-16-300-64 ;;
    dequant) echo "tests/gpu/test_dequantize_gpu.py::test_kernel_matches_spec_and_xla_bitwise" ;;
    ep2) parity axis_size=2,dispatch=bf16,combine_reduce=expert,partial_dtype=bfloat16,split=True ;;
    *) echo "unknown step $1 (steps: ep1 race1 dequant ep2)" >&2; return 2 ;;
  esac
}

if [ $list -eq 1 ]; then
  for step in "${steps[@]}"; do nodes "$step" || exit 2; done
  exit 0
fi
logs=${OUT:-$PWD/gpu_logs}
mkdir -p "$logs"

find_sanitizer() {
  local purelib candidate
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
  for candidate in "$(command -v compute-sanitizer 2>/dev/null)" \
      "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
      /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer \
      "$purelib"/nvidia/*/bin/compute-sanitizer; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! sanitizer=$(find_sanitizer); then
  echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda*/bin, /opt/nvidia," \
    "pip's nvidia/*/bin)"
  exit 2
fi
echo "sanitizer: $sanitizer ($("$sanitizer" --version | grep -i version | head -1))"

# check NAME SECONDS TIMEOUT_S NODE...: one pytest run under $TOOL (memcheck unless set) with a
# hard time limit.
# Sanitized kernels run many times slower, so a peer's wait gets TIMEOUT_S instead of 10 s.
failed=0
check() {
  local name=$1 seconds=$2 kernel_timeout=$3
  shift 3
  local log="$logs/sanitizer_$name.log" started rc tool=${TOOL:-memcheck}
  local tool_args=(--tool "$tool")
  [ "$tool" = memcheck ] && tool_args+=(--leak-check no)
  started=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    JAX_MOE_TIMEOUT_S=$kernel_timeout PYTHONUNBUFFERED=1 \
    timeout -s KILL "$seconds" "$sanitizer" "${tool_args[@]}" \
      --report-api-errors no --print-limit 50 --error-exitcode 86 \
      python3 -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  local summary tests
  summary=$(grep -E "ERROR SUMMARY" "$log" | tail -1)
  tests=$(grep -v '^=========' "$log" | grep -E '[0-9]+ (passed|failed|errors?|skipped)' |
          tail -1)
  echo "$name: rc=$rc ($(( $(date +%s) - started )) s)" \
    "${summary:-no ERROR SUMMARY line (killed at ${seconds} s?)}"
  echo "  pytest: ${tests:-no summary line}"
  if [ $rc -ne 0 ]; then
    failed=1
    grep -E "^========= +(Invalid|Misaligned|Out of bounds|Address|at |by thread|Program hit)" \
      "$log" | head -12
    grep -E '^(E |FAILED|ERROR)' "$log" | head -8
  fi
}

for step in "${steps[@]}"; do
  mapfile -t step_nodes < <(nodes "$step")
  [ ${#step_nodes[@]} -gt 0 ] || exit 2  # nodes named an unknown step
  case $step in
    ep1) check ep1 280 60 "${step_nodes[@]}" ;;
    race1) TOOL=racecheck check race1 280 60 "${step_nodes[@]}" ;;
    dequant) check dequant 150 60 "${step_nodes[@]}" ;;
    ep2) check ep2 260 60 "${step_nodes[@]}" ;;
  esac
done
exit $failed
