#!/usr/bin/env bash
# Builds jax_moe with the CUDA kernels on a GPU machine, runs the GPU tests and prints a
# one-line summary per suite. Logs go to $OUT (the device tool's output folder) or ./gpu_logs.
#   benchmarks/gpu_run.sh [STEP...]   (default: tests parity)
# Build and topology always run; then each STEP in order:
#   tests    tests/gpu/test_cuda_backend.py (XLA defaults; NVLink and forced-remote host proxies)
#   mp       tests/gpu/test_multiprocess.py (2 processes x 1 GPU, 4 processes on 2 GPUs, through
#            CUDA IPC; with libfabric also through the host proxies, and the host backend's jobs)
#   mp1      only the jobs of several processes on one GPU (CUDA IPC; the protocol at R > 1 on a
#            one-GPU machine)
#   parity   the shared parity, runtime-error and quantization tests (tests/*.py) on the GPUs
#   quant    tests/test_quantization.py on the GPU (quantize_fp8 must match the spec there)
#   cmdbuf   tests/gpu/test_cuda_backend.py with XLA command buffers off, then forced on for custom calls
#   bench    bench_dispatch_combine.py for the cuda backend at decode and prefill sizes
#   ep1      on one GPU: bench_dispatch_combine.py --ep 1 (cuda and xla backends, the all_gather
#            peer; expert mode with bf16 partials, source mode) and profile_kernels.py per
#            kernel at decode and prefill (fp8, expert, bf16 partials); GIT_COMMIT names the code
#   stages   on one GPU: profile_kernels.py --ep 1 --stages for the fused ops and the halves at
#            decode and prefill (fp8, expert, bf16 partials): when each block reached each stage
#   sms      on one GPU: the fused decode kernels' profile and stage clocks at num_sms 16, 33,
#            66 and 132 (fp8, expert, bf16 partials)
#   ep1_cmdbuf  the ep1 decode benchmark (expert mode, bf16 partials) with XLA command buffers
#            forced on for fusions and custom calls: the launch gaps between a step's kernels
#            are most of a decode step (docs/perf-notes.md); file suffix -cmdbuf
#   dequant  jm.dequantize_fp8's kernel: tests/gpu/test_dequantize_gpu.py and
#            tests/test_quantization.py on the GPU, bench_dequantize.py (kernel against XLA's
#            fusion at 1024 and 32768 rows), then profile_kernels.py per kernel (as ep1's) with
#            the identity expert's dequantization by XLA and by the kernel
#   ep1dq    the ep1 benchmark's fused fp8 step (expert mode, bf16 partials) with the identity
#            expert's dequantization by XLA, then by the kernel: the step before and after
#   floor    on one GPU: write_floor.py (the world-1 prefill dispatch's bytes through vendor and
#            triton kernels: fill, copy, gather, scatter, rows_*), then profile_kernels.py per
#            kernel at prefill (fp8, expert, bf16 partials, fused): the dispatch against its
#            floor on the same machine (issue 12's <= 100 us)
#   tail     on one GPU: the world-1 prefill fp8 dispatch's profile and stage clocks at 4096
#            tokens (132 chunks: 4 of 32 tokens, 128 of 31), 4092 (132 x 31) and 3960 (132 x
#            30), and at 4096 on 128 blocks (all 32): whether the blocks with one token more
#            set the kernel's end (then a placement balanced across blocks would take ~3% off)
#   hmem     whether this machine's libfabric grants FI_HMEM (CUDA memory) with shm and
#            tcp;ofi_rxm: the TransferEngine's facts, or the provider's refusal
#   proxy1   bench_host_remote.py --platform cuda --gpus 1 (2 processes share GPU 0 through their
#            host proxies, shm, decode fp8 expert): once time-sliced, once as clients of a
#            private MPS daemon (--mps): what the proxy path costs apart from sharing one GPU;
#            3 fused steps traced in each process (every kernel's device time)
#   proxywait  the proxy1 benchmark under MPS only, once for each JAX_MOE_PROXY_WAIT (stream: the
#            stream waits with cuStreamWaitValue32; kernel: the request kernel spins): what a
#            request costs the GPU between the proxy's answer and the next doorbell
#   proxyrep   the proxy1 benchmark under MPS (stream waits): decode three times in a row (the raw
#            transport's time moves between runs), then prefill 4096 once
#   hmemcuda  with the libfabric of .fabric-cuda/lib (built with CUDA by
#            build_libfabric_cuda.sh; carry it) first on LD_LIBRARY_PATH: `hmem`'s facts, a CUDA
#            registration probe and tests/gpu/test_transport_cuda.py (the engines' writes from and
#            into device memory over shm). The proxies' FI_HMEM path needs efa or verbs
#            (settings.HMEM_PROVIDERS): bench_host_remote.py and the FI_HMEM jobs with
#            JAX_MOE_HOST_PROVIDER / JAX_MOE_TEST_HMEM_PROVIDER set to one, on such a cluster
#   gdbjob   the multi-process jobs that GDB_JOBS selects (a pytest -k expression; default
#            "1GPU"), each worker under cuda-gdb, FI_LOG_LEVEL=warn: a crash's stack in the
#            workers' output under gdbjob-tmp/ (JAX_MOE_TEST_WORKER_PREFIX)
#   models_mp  tests/gpu/test_models_multiprocess.py: jax-moe generate with the cuda backend on 2
#            processes sharing GPU 0 (CUDA IPC, forced through the host proxies, --tp 2) gives
#            one process's tokens; tokens/s per path in the log (issues 15 and 19)
#   misuse   tests/test_misuse.py on the GPU (cuda cases), then a 60 s soak of cuda against xla
#            (benchmarks/soak.py, RSS reported; issue 14)
#   allreduce  tests/gpu/test_all_reduce_gpu.py (1 and 2 GPUs in one process; the loop tests again
#            with command buffers forced on for custom calls) and the 2-process job
#   arbench  bench_all_reduce.py, bf16, 4 KiB..64 MiB, every method; GIT_COMMIT names the code
#   arbench_cmdbuf  the same, chained calls only, with command buffers forced on for custom calls
#            and collectives (file suffix _cmdbuf)
# On two GPUs (issue 18; GIT_COMMIT names the code):
#   ep2decode, ep2prefill  bench_dispatch_combine.py --ep 2 at 128 / 4096 tokens per rank: the
#            cuda and xla backends' dispatch, combine and fused ops, fp8 and bf16, expert mode
#            with bf16 partials (against the JAX peers and probes) and source mode
#   ep2stages  profile_kernels.py --ep 2 --stages: each kernel's time and when each block reached
#            each stage, decode and prefill, fused and split (fp8, expert, bf16 partials)
#   proxy2   bench_host_remote.py --platform cuda --gpus 2: a process per GPU through their host
#            proxies, shm then tcp;ofi_rxm, against the raw TransferEngine, NVLink and xla
set -u -o pipefail
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests parity)
logs=${OUT:-$PWD/gpu_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 JAX_MOE_TIMEOUT_S=${JAX_MOE_TIMEOUT_S:-10}
started=$(date +%s)

{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
  > "$logs/topo.txt" 2>&1
head -4 "$logs/topo.txt"

# shellcheck source=benchmarks/gpu_build.sh
. "$(dirname "$0")/gpu_build.sh"
find_libfabric  # the host proxies' TransferEngine
if ! build_jax_moe "$logs/build.log" "$fabric"; then
  tail -40 "$logs/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: ok ($(( $(date +%s) - started )) s)"
python3 -c "import jax, jax_moe as jm; print(jm.build_info()); print('backends', jm.available_backends(), jax.devices())"

# suite NAME SECONDS ARGS...: runs one pytest suite under a hard time limit.
# hmem_facts: whether this machine's libfabric grants FI_HMEM (CUDA memory) with shm and
# tcp;ofi_rxm: the TransferEngine's facts, or the provider's refusal.
hmem_facts() {
  local provider
  for provider in shm "tcp;ofi_rxm"; do
    timeout -s KILL 30 python3 -c "import sys
from jax_moe import transport
try:
  e = transport.TransferEngine(0, provider=sys.argv[1], node='127.0.0.1', timeout_s=2,
                               cuda_memory=True)
  print('hmem', sys.argv[1], 'granted:', e.facts)
  e.close()
except Exception as err:
  print('hmem', sys.argv[1], 'refused:', type(err).__name__, err)" "$provider" 2>&1 | tail -2
  done
}

suite() {
  local name=$1 seconds=$2
  shift 2
  timeout -s KILL "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -E '(passed|failed|error|skipped)' "$logs/$name.log" | tail -1)"
  [ $rc -ne 0 ] && grep -E '^(E |FAILED|ERROR)' "$logs/$name.log" | head -15
}

# profile_ep EP NAME PATTERN LINES [ARGS...]: profile_kernels.py --ep EP (fp8, expert, bf16
# partials) for decode and prefill, fused and split, with ARGS; prints PATTERN's first LINES
# lines of each log (logs and JSON named NAME_ep<EP>_<tokens>_<op>).
profile_ep() {
  local ep=$1 name=$2 pattern=$3 lines=$4 tokens op
  shift 4
  for tokens in 128 4096; do
    for op in fused split; do
      local file=$logs/${name}_ep${ep}_${tokens}_$op
      timeout -s KILL 90 python3 benchmarks/profile_kernels.py --ep "$ep" --tokens $tokens "$@" \
        --dispatch-dtype fp8 --reduce expert --partial-dtype bf16 $([ $op = split ] && echo --split) \
        --json "$file.json" > "$file.log" 2>&1
      echo "$name ep$ep $tokens tokens $op: rc=$?"
      grep -E "$pattern" "$file.log" | head -"$lines"
    done
  done
}

# proxy_bench NAME LINES ARGS...: bench_host_remote.py with the cuda proxies of 2 processes on
# GPU 0 (shm, fp8, expert, bf16 partials) and ARGS; JSON and plot under NAME, log NAME.log, of
# which the summary's first LINES lines are printed.
proxy_bench() {
  local name=$1 lines=$2
  shift 2
  timeout -s KILL 150 python3 benchmarks/bench_host_remote.py --platform cuda --gpus 1 \
    --no-xla --no-nvlink --providers shm --dispatch-dtypes fp8 --reduce expert \
    --partial-dtype bf16 --reps 3 --iters 10 --short-iters 2 "$@" \
    --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/$name" > "$logs/$name.log" 2>&1
  echo "$name: rc=$?"
  grep -E "^shm|^  |Error|error" "$logs/$name.log" | cut -c1-200 | head -"$lines"
}

for step in "${steps[@]}"; do
  case $step in
    tests) suite gpu_default 300 tests/gpu/test_cuda_backend.py ;;
    mp) suite multiprocess 420 -rs tests/gpu/test_multiprocess.py ;;
    mp1) suite multiprocess_1gpu 420 -rs tests/gpu/test_multiprocess.py -k 1GPU ;;
    parity)
      suite parity_cuda 240 tests/test_parity.py tests/test_runtime_errors.py -k cuda
      suite quantization_gpu 60 tests/test_quantization.py ;;
    quant) suite quantization_gpu 60 tests/test_quantization.py ;;
    cmdbuf)
      XLA_FLAGS=--xla_gpu_enable_command_buffer= suite gpu_cmdbuf_off 120 tests/gpu/test_cuda_backend.py
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
        suite gpu_cmdbuf_forced 120 tests/gpu/test_cuda_backend.py ;;
    bench)
      # Only the JSON tables come back (the device tool returns at most 8 files).
      timeout -s KILL 180 python3 benchmarks/bench_dispatch_combine.py --backends cuda \
        --peers none --ops fused,split --reduce source,expert --reps 3 \
        --out /tmp/jax_moe_bench > "$logs/bench.log" 2>&1
      echo "bench: rc=$?"
      cp /tmp/jax_moe_bench/*.json "$logs/" 2>/dev/null
      tail -30 "$logs/bench.log" ;;
    ep1)
      for reduce in "expert --partial-dtype bf16" "source"; do
        # shellcheck disable=SC2086
        timeout -s KILL 200 python3 benchmarks/bench_dispatch_combine.py --ep 1 \
          --backends cuda,xla --peers all_gather --ops fused,split --reduce ${reduce%% *} \
          ${reduce#"${reduce%% *}"} --reps 3 --budget-s 4 --git-commit "${GIT_COMMIT:-unknown}" \
          --out "$logs/bench-${reduce%% *}" > "$logs/bench_ep1_${reduce%% *}.log" 2>&1
        echo "bench ep1 ${reduce%% *}: rc=$?"
        tail -26 "$logs/bench_ep1_${reduce%% *}.log"
      done
      profile_ep 1 profile "busy span|us x" 7 ;;
    stages) profile_ep 1 stages "busy span|us x|^  [a-z_]+ +[0-9-]" 24 --stages ;;
    sms)  # the fused decode kernels at fewer blocks: each counts every id, fewer share L2
      for sms in 16 33 66 132; do
        timeout -s KILL 90 python3 benchmarks/profile_kernels.py --ep 1 --tokens 128 --stages \
          --dispatch-dtype fp8 --reduce expert --partial-dtype bf16 --num-sms $sms \
          --json "$logs/sms_ep1_128_$sms.json" > "$logs/sms_ep1_128_$sms.log" 2>&1
        echo "sms $sms: rc=$?"
        grep -E "busy span|local_kernel|^  (counts_seen|segments|ranked|recv_done)" \
          "$logs/sms_ep1_128_$sms.log" | head -8
      done ;;
    ep1_cmdbuf)
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
        timeout -s KILL 200 python3 benchmarks/bench_dispatch_combine.py --ep 1 \
        --backends cuda,xla --peers all_gather --ops fused,split --reduce expert \
        --partial-dtype bf16 --phases decode=128 --reps 3 --budget-s 4 \
        --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/bench-expert-cmdbuf" \
        > "$logs/bench_ep1_cmdbuf.log" 2>&1
      echo "bench ep1 cmdbuf: rc=$?"
      tail -14 "$logs/bench_ep1_cmdbuf.log" ;;
    dequant)
      suite dequantize_gpu 120 tests/gpu/test_dequantize_gpu.py tests/test_quantization.py
      timeout -s KILL 150 python3 benchmarks/bench_dequantize.py \
        --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/dequantize" \
        > "$logs/bench_dequantize.log" 2>&1
      echo "bench dequantize: rc=$?"
      grep -E "rows:|Error" "$logs/bench_dequantize.log" | head -8
      for impl in xla auto; do
        profile_ep 1 "profile_dq_$impl" "busy span|us x" 6 --identity-dequantize $impl
      done ;;
    ep1dq)
      for impl in xla auto; do
        timeout -s KILL 200 python3 benchmarks/bench_dispatch_combine.py --ep 1 \
          --backends cuda,xla --peers all_gather --ops fused --reduce expert \
          --partial-dtype bf16 --dispatch-dtypes fp8 --identity-dequantize $impl --reps 3 \
          --budget-s 4 --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/bench-dq-$impl" \
          > "$logs/bench_ep1dq_$impl.log" 2>&1
        echo "bench ep1 fp8 fused, identity dequantize $impl: rc=$?"
        tail -12 "$logs/bench_ep1dq_$impl.log"
      done ;;
    floor)
      timeout -s KILL 150 python3 benchmarks/write_floor.py --git-commit "${GIT_COMMIT:-unknown}" \
        --out "$logs/write_floor" > "$logs/write_floor.log" 2>&1
      echo "write floor: rc=$?"
      grep -E " us \(|WRONG|Error" "$logs/write_floor.log" | head -14
      timeout -s KILL 90 python3 benchmarks/profile_kernels.py --ep 1 --tokens 4096 \
        --dispatch-dtype fp8 --reduce expert --partial-dtype bf16 \
        --json "$logs/floor_ep1_4096_fused.json" > "$logs/floor_ep1_4096_fused.log" 2>&1
      echo "floor ep1 4096 tokens fused: rc=$?"
      grep -E "busy span|us x" "$logs/floor_ep1_4096_fused.log" | head -6 ;;
    tail)
      for run in "4096" "4092" "3960" "4096 --num-sms 128"; do
        file=$logs/tail_${run// /_}
        # shellcheck disable=SC2086
        timeout -s KILL 90 python3 benchmarks/profile_kernels.py --ep 1 --tokens $run \
          --dispatch-dtype fp8 --reduce expert --partial-dtype bf16 --stages \
          --json "$file.json" > "$file.log" 2>&1
        echo "tail ep1 --tokens $run: rc=$?"
        grep -E "busy span|dispatch_local|^  (counts_seen|ranked|recv_done) " "$file.log" | head -5
        # the dispatch's recv_done by its block's token count (chunk c: tokens
        # [T c / chunks, T (c + 1) / chunks), one chunk a block here)
        python3 - "$file.json" <<'PY'
import json, sys
import numpy as np
d = json.load(open(sys.argv[1]))
T = d["config"]["tokens"]
for kernel, marks in d["stages"].items():
    if "dispatch" not in kernel or "recv_done" not in marks:
        continue
    done = marks["recv_done"]["per_block_us"]
    n = len(done)
    by = {}
    for c, t in enumerate(done):
        if t is not None:
            by.setdefault(T * (c + 1) // n - T * c // n, []).append(t)
    print("  recv_done by tokens a block: " + ", ".join(
        f"{k}: {len(v)} blocks, median {np.median(v):.1f}, max {max(v):.1f}"
        for k, v in sorted(by.items())))
PY
      done ;;
    models_mp) suite models_multiprocess 420 -s -rs tests/gpu/test_models_multiprocess.py ;;
    hmem) hmem_facts ;;
    proxy1)
      proxy_bench proxy1 40 --phases decode=128 --trace-iters 3
      proxy_bench proxy1-mps 40 --phases decode=128 --trace-iters 3 --mps ;;
    proxywait)
      for wait in stream kernel; do
        JAX_MOE_PROXY_WAIT=$wait proxy_bench "proxywait-$wait" 40 --phases decode=128 \
          --trace-iters 3 --mps
      done ;;
    proxyrep)
      for run in decode-1 decode-2 decode-3; do
        proxy_bench "proxyrep-$run" 8 --phases decode=128 --mps
      done
      proxy_bench proxyrep-prefill 8 --phases prefill=4096 --mps ;;
    hmemcuda)
      if [ ! -f .fabric-cuda/lib/libfabric.so.1 ]; then
        echo "hmemcuda: no .fabric-cuda/lib/libfabric.so.1 (benchmarks/build_libfabric_cuda.sh)"
        continue
      fi
      (export LD_LIBRARY_PATH=$PWD/.fabric-cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
       hmem_facts
       timeout -s KILL 60 python3 -c "from jax_moe import transport
print('hmemcuda registers CUDA memory with shm:', transport.registers_cuda_memory('shm'))" 2>&1 \
         | grep hmemcuda
       suite transport_cuda 120 -rs tests/gpu/test_transport_cuda.py) ;;
    gdbjob)
      (export FI_LOG_LEVEL=warn
       JAX_MOE_TEST_WORKER_PREFIX="cuda-gdb -q -batch -ex 'set pagination off' -ex run"
       export JAX_MOE_TEST_WORKER_PREFIX+=" -ex bt --args"
       suite gdbjob 400 -rs tests/gpu/test_multiprocess.py -k "${GDB_JOBS:-1GPU}" \
         --basetemp="$logs/gdbjob-tmp"
       grep -h -A30 -E 'SIGSEGV|SIGABRT|SIGBUS' "$logs"/gdbjob-tmp/*/stdout*.txt | head -90) ;;
    misuse)
      suite misuse_gpu 120 tests/test_misuse.py
      timeout -s KILL 120 python3 benchmarks/soak.py --backends cuda,xla --seconds 60 --iterations 1000000 \
        --json "$logs/soak_cuda_xla.json" > "$logs/soak.log" 2>&1
      echo "soak cuda,xla: rc=$?"; tail -4 "$logs/soak.log" ;;
    allreduce)
      suite all_reduce_gpu 240 -rs tests/gpu/test_all_reduce_gpu.py
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
        suite all_reduce_cmdbuf_forced 120 tests/gpu/test_all_reduce_gpu.py -k "loop or chained"
      suite all_reduce_mp 240 -rs tests/gpu/test_all_reduce_multiprocess.py ;;
    arbench)
      timeout -s KILL 300 python3 benchmarks/bench_all_reduce.py --git-commit "${GIT_COMMIT:-unknown}" \
        --out "$logs" > "$logs/bench_all_reduce.log" 2>&1
      echo "arbench: rc=$?"
      tail -40 "$logs/bench_all_reduce.log" ;;
    arbench_cmdbuf)
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1" \
        timeout -s KILL 200 python3 benchmarks/bench_all_reduce.py --git-commit "${GIT_COMMIT:-unknown}" \
        --modes chain --sizes 4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,8MiB,16MiB,64MiB --tag cmdbuf \
        --out "$logs" > "$logs/bench_all_reduce_cmdbuf.log" 2>&1
      echo "arbench_cmdbuf: rc=$?"
      tail -24 "$logs/bench_all_reduce_cmdbuf.log" ;;
    ep2decode|ep2prefill)
      phase=decode=128
      [ "$step" = ep2prefill ] && phase=prefill=4096
      for reduce in "expert --partial-dtype bf16 --peers all_gather,all_to_all,ragged_all_to_all,psum,p2p" \
          "source --peers none"; do
        name=$step-${reduce%% *}
        # shellcheck disable=SC2086
        timeout -s KILL 270 python3 benchmarks/bench_dispatch_combine.py --ep 2 \
          --backends cuda,xla --ops dispatch,combine,fused --reduce $reduce --phases $phase \
          --reps 3 --budget-s 4 --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/$name" \
          > "$logs/$name.log" 2>&1
        echo "$name: rc=$?"
        grep -E "^[a-z_0-9]+ .* (ok|error|skipped|FAILED)" "$logs/$name.log" | cut -c1-100 | tail -30
      done ;;
    ep2stages) profile_ep 2 stages "busy span|us x|^  [a-z_]+ +[0-9-]" 24 --stages ;;
    proxy2)
      for provider in shm "tcp;ofi_rxm"; do
        name=proxy2-${provider%%;*}
        timeout -s KILL 270 python3 benchmarks/bench_host_remote.py --platform cuda --gpus 2 \
          --providers "$provider" --dispatch-dtypes fp8 --reduce expert --partial-dtype bf16 \
          --phases decode=128 --reps 3 --iters 10 --short-iters 2 \
          --git-commit "${GIT_COMMIT:-unknown}" --out "$logs/$name" > "$logs/$name.log" 2>&1
        echo "$name: rc=$?"
        grep -E "^shm|^tcp|^  |Error|error" "$logs/$name.log" | cut -c1-200 | head -30
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "total: $(( $(date +%s) - started )) s"
