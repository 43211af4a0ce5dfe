#!/usr/bin/env bash
# An A/B of code variants in one GPU machine call (METHOD.md: change one thing, re-measure on
# the same machine). The variants are this checkout as it is ("base") and one per patch in
# AB_PATCHES (a folder of *.patch files, e.g. `git format-patch main..branch --stdout`), each
# applied to its own copy of the checkout. Every variant is built the same way, all at once:
# its own copy, build folder and install folder, SASS for sm_90a only and no CUTLASS (the
# exchange kernels need neither). Then ROUNDS rounds, each running COMMAND once per variant in
# turn (base, A, B, base, A, B, ...), so the machine's drift during the call spreads over all.
#   AB_PATCHES=ab benchmarks/gpu_ab.sh ROUNDS 'COMMAND'
# COMMAND (one shell string) runs in the variant's install folder: its jax_moe (built), and
# copies of benchmarks/, tests/ and pyproject.toml; with AB_NAME (base, or the patch's file
# name without .patch), AB_ROUND (1..ROUNDS) and AB_LOGS (the logs folder) set. Its output is
# AB_LOGS/NAME.ROUND.log; the lines matching AB_SHOW (a grep -E pattern) are printed after each
# run. At the end the logs folder is packed into one file in $OUT (the device tool brings back
# at most 8 files), or left in ./gpu_logs/ab.
# The install folders must be what `import jax_moe` finds, and an editable install (what
# gpu_run.sh and gpu_build.sh leave on a warm machine) would win over them: it is uninstalled
# first (gpu_build.sh installs it again when one of the gpu_*.sh scripts runs).
# COMMAND runs with the install folder first on PYTHONPATH: the processes that tests and
# benchmarks start (tests/gpu/mp_worker.py, the benchmarks' workers) run a script, whose
# folder, not the working directory, is what Python puts first on the path (session 19: every
# multi-process job failed in every variant without it, base included).
set -u -o pipefail
if [ $# -ne 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: AB_PATCHES=DIR $0 ROUNDS 'COMMAND' (or decode, prefill)" >&2
  exit 2
fi
rounds=$1 command=$2
# Named commands (COMMAND as one word), each the world-1 tests first (a variant that fails them
# is not timed), then:
#   decode   profile_kernels.py --ep 1 --tokens 128 --stages, fp8 and bf16 dispatch (expert
#            mode, bf16 partials): each kernel's time and each block's stage clocks; then the
#            fused decode step of the cuda backend (bench_dispatch_combine.py), command buffers
#            forced (as issue 12's step target is measured), then XLA's default (lines
#            "default ...": each custom call its own launch on the stream)
#   prefill  the fp8 quantization tests (non-finite tokens through the cuda dispatch too) and
#            the one-GPU all-reduce tests, profile_kernels.py --ep 1 --tokens 4096 fused and
#            split (fp8), and bench_all_reduce.py --ep 1 (bf16, chained calls)
#   dispatch the fp8 quantization tests and, in every variant but base, the NVLink jobs of
#            several processes on one GPU (R = 2 and 4 through CUDA IPC: the buffer path's
#            send); then profile_kernels.py --ep 1 --stages at 4096 tokens (fp8) and at 128
#            (fp8, bf16): a change to the dispatch's row stores, at both sizes
# (pytest 9 refuses '=' in a -k expression: the axis_size=2 cases are collected and skip on
# one GPU.)
tests_w1='python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_backend.py'
tests_w1+=' -k "world1 or axis_size" 2>&1 | tail -2'
tests_ar='python3 -m pytest -q -p no:cacheprovider tests/gpu/test_all_reduce_gpu.py 2>&1 | tail -2'
tests_fp8='python3 -m pytest -q -p no:cacheprovider tests/test_parity.py -k "cuda and non_finite"'
tests_fp8+=' 2>&1 | tail -2; python3 -m pytest -q -p no:cacheprovider tests/test_quantization.py'
tests_fp8+=' 2>&1 | tail -2'
profile='python3 benchmarks/profile_kernels.py --ep 1 --reduce expert --partial-dtype bf16'
ar_bench='python3 benchmarks/bench_all_reduce.py --ep 1 --modes chain --reps 3'
ar_bench+=' --out $AB_LOGS/allreduce-$AB_NAME-$AB_ROUND 2>&1 | tail -25'
bench_step='python3 benchmarks/bench_dispatch_combine.py --ep 1 --backends cuda --peers none'
bench_step+=' --ops fused --reduce expert --partial-dtype bf16 --phases decode=128 --reps 3'
bench_step+=' --budget-s 3 --git-commit "${GIT_COMMIT:-unknown}+$AB_NAME"'
step='XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL'
step+=' --xla_gpu_graph_min_graph_size=1" '"$bench_step"
step+=' --out $AB_LOGS/step-$AB_NAME-$AB_ROUND 2>&1 | grep -E "^  cuda fused"; '"$bench_step"
step+=' --out $AB_LOGS/step-default-$AB_NAME-$AB_ROUND 2>&1 | grep -E "^  cuda fused"'
step+=' | sed "s/^/default /"'
profile_decode="for d in fp8 bf16; do $profile --tokens 128 --stages"
profile_decode+=' --dispatch-dtype $d 2>&1 | sed "s/^/$d /"; done'
tests_mp1='python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multiprocess.py'
tests_mp1+=' -k "test_ranks_in_separate_processes and 1GPU" 2>&1 | tail -2'
case $command in
  dispatch)
    command="$tests_w1; $tests_fp8; "'[ "$AB_NAME" = base ] || { '"$tests_mp1; }; "
    command+="$profile --tokens 4096 --stages --dispatch-dtype fp8 2>&1 | sed 's/^/fp8 /'; "
    command+="$profile_decode"
    : "${AB_SHOW:=passed|failed|busy span|us x|^(fp8|bf16) +[a-z_]+ +[0-9-]}"
    : "${AB_SHOW_LINES:=60}" ;;
  decode)
    command="$tests_w1; $profile_decode; $step"
    : "${AB_SHOW:=passed|failed|busy span|us x|^(fp8|bf16) +[a-z_]+ +[0-9-]|fused}"
    : "${AB_SHOW_LINES:=40}" ;;
  prefill)
    command="$tests_w1; $tests_fp8; $tests_ar; for s in '' --split; do $profile --tokens 4096"
    command+=' --dispatch-dtype fp8 $s; done; '"$ar_bench"
    : "${AB_SHOW:=passed|failed|busy span|us x|one_shot|two_shot|psum}"
    : "${AB_SHOW_LINES:=60}" ;;
esac
out=${OUT:-$PWD/gpu_logs}
logs=$out/ab
work=${AB_WORK:-/tmp/jax_moe_ab}
checkout=$PWD
mkdir -p "$logs"
rm -rf "$work"
mkdir -p "$work"
started=$(date +%s)

names=(base)
patches=()
if [ -n "${AB_PATCHES:-}" ]; then
  for p in "$AB_PATCHES"/*.patch; do
    [ -f "$p" ] || continue
    names+=("$(basename "$p" .patch)")
    patches+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")")
  done
fi
echo "variants: ${names[*]}"

# shellcheck source=benchmarks/gpu_build.sh
. "$(dirname "$0")/gpu_build.sh"
find_libfabric
build_backend "$logs/build_backend.log" || { echo "build backend: failed"; exit 1; }
if python3 -m pip show jax_moe > /dev/null 2>&1; then
  python3 -m pip uninstall -y jax_moe > "$logs/uninstall.log" 2>&1
  echo "uninstalled the installed jax_moe (an editable install would shadow the variants)"
fi

# build NAME [PATCH]: copy the checkout (no build products), apply PATCH, install into
# $work/NAME/site with the variant's own build folder.
build() {
  local name=$1 patch=${2:-} dir=$work/$1
  mkdir -p "$dir/src"
  tar -C "$checkout" -c --exclude=./build --exclude=./.cutlass --exclude=./.git \
    --exclude=./gpu_logs --exclude=./.whl --exclude=./.fabric . | tar -C "$dir/src" -x || return 1
  if [ -n "$patch" ]; then
    (cd "$dir/src" && { git apply "$patch" 2>/dev/null || patch -p1 --forward < "$patch"; }) \
      || { echo "patch $patch does not apply"; return 1; }
  fi
  (cd "$dir/src" && PYTHONPATH=$backend_path${PYTHONPATH:+:$PYTHONPATH} python3 -m pip install \
    --no-build-isolation --no-deps --target "$dir/site" . -Cbuild-dir="$dir/build" \
    -Ccmake.define.JAX_MOE_ENABLE_CUDA=ON -Ccmake.define.JAX_MOE_CUDA_ARCHS=90a \
    -Ccmake.define.JAX_MOE_ENABLE_LIBFABRIC="$fabric") || return 1
  cp -r "$dir/src/benchmarks" "$dir/src/tests" "$dir/src/pyproject.toml" "$dir/site/"
}

pids=()
for i in "${!names[@]}"; do
  patch=""
  [ "$i" -gt 0 ] && patch=${patches[$((i - 1))]}
  build "${names[$i]}" "$patch" > "$logs/build_${names[$i]}.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!names[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "build ${names[$i]}: FAILED"
    tail -20 "$logs/build_${names[$i]}.log"
    failed=1
  fi
done
[ $failed -eq 0 ] || exit 1
echo "builds: ok ($(( $(date +%s) - started )) s)"
for name in "${names[@]}"; do  # each variant must import its own build
  found=$(cd "$work/$name/site" && python3 -c 'import jax_moe; print(jax_moe.__file__)' 2>&1)
  if [[ $found != "$work/$name/site/"* ]]; then
    echo "$name imports jax_moe from $found, not from its own build"
    exit 1
  fi
done

for round in $(seq 1 "$rounds"); do
  for name in "${names[@]}"; do
    log=$logs/$name.$round.log
    (cd "$work/$name/site" && AB_NAME=$name AB_ROUND=$round AB_LOGS=$logs \
      PYTHONPATH=$work/$name/site${PYTHONPATH:+:$PYTHONPATH} \
      timeout -s KILL "${AB_TIMEOUT_S:-300}" bash -c "$command") > "$log" 2>&1
    echo "$name round $round: rc=$? ($(( $(date +%s) - started )) s)"
    [ -n "${AB_SHOW:-}" ] && grep -E "$AB_SHOW" "$log" | head -"${AB_SHOW_LINES:-12}"
  done
done

if [ -n "${OUT:-}" ]; then
  tar -C "$out" -czf "$out/ab-logs.tar.gz" ab && rm -rf "$logs"
  echo "logs: ab-logs.tar.gz"
fi
