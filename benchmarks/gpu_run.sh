#!/usr/bin/env bash
# Builds jax_moe with the CUDA kernels on a GPU machine, runs the GPU tests and prints a
# one-line summary per suite. Logs go to $OUT (the device tool's output folder) or ./gpu_logs.
#   benchmarks/gpu_run.sh smoke    build, topology, tests/gpu
#   benchmarks/gpu_run.sh full     smoke + the shared parity, error and quantization tests
#   benchmarks/gpu_run.sh cmdbuf   smoke + tests/gpu with XLA command buffers off and forced on
set -u -o pipefail
mode=${1:-full}
logs=${OUT:-$PWD/gpu_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 JAX_MOE_TIMEOUT_S=${JAX_MOE_TIMEOUT_S:-10}
started=$(date +%s)

{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
  > "$logs/topo.txt" 2>&1
head -4 "$logs/topo.txt"

if ! python3 -m pip install --no-build-isolation --no-deps -e . \
    -Ccmake.define.JAX_MOE_ENABLE_CUDA=ON -Ccmake.define.JAX_MOE_ENABLE_LIBFABRIC=OFF \
    > "$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: ok ($(( $(date +%s) - started )) s)"
python3 -c "import jax, jax_moe as jm; print(jm.build_info()); print('backends', jm.available_backends(), jax.devices())"

# suite NAME SECONDS ARGS...: runs one pytest suite under a hard time limit.
suite() {
  local name=$1 seconds=$2
  shift 2
  timeout -s KILL "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -E '(passed|failed|error|skipped)' "$logs/$name.log" | tail -1)"
  [ $rc -ne 0 ] && grep -E '^(E |FAILED|ERROR)' "$logs/$name.log" | head -15
}

suite gpu_default 150 tests/gpu
if [ "$mode" = full ]; then
  suite parity_cuda 240 tests/test_parity.py tests/test_runtime_errors.py -k cuda
  suite quantization_gpu 60 tests/test_quantization.py
fi
if [ "$mode" = cmdbuf ]; then
  XLA_FLAGS=--xla_gpu_enable_command_buffer= suite gpu_cmdbuf_off 120 tests/gpu
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
    suite gpu_cmdbuf_forced 120 tests/gpu
fi
echo "total: $(( $(date +%s) - started )) s"
