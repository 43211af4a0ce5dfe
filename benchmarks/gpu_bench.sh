#!/usr/bin/env bash
# Benchmarks for the committed results, on a GPU machine (after benchmarks/gpu_run.sh has
# built the package, or with `build` as the first step):
#   benchmarks/gpu_bench.sh COMMIT STEP...
# STEP is NAME:EP:PHASE[:EXTRA-FLAGS] with EXTRA-FLAGS comma-free words joined by '+', e.g.
#   decode2:2:decode=128   prefill1:1:prefill=4096:--ops+fused,split
# Results land in benchmarks/results/<NAME>/ and as one tarball in $OUT (the device tool returns
# at most 8 files), logs in $OUT/bench_<NAME>.log.
set -u -o pipefail
commit=${1:?usage: gpu_bench.sh COMMIT STEP...}
shift
out=${OUT:-$PWD/gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_MOE_TIMEOUT_S=${JAX_MOE_TIMEOUT_S:-10}
seconds=${BENCH_SECONDS:-200}
for step in "$@"; do
  IFS=: read -r name ep phase extra <<< "$step"
  started=$(date +%s)
  # shellcheck disable=SC2086
  timeout -s KILL "$seconds" python3 benchmarks/bench_dispatch_combine.py --git-commit "$commit" \
    --ep "$ep" --phases "$phase" --out "benchmarks/results/$name" ${extra//+/ } \
    > "$out/bench_$name.log" 2>&1
  echo "bench $name: rc=$? ($(( $(date +%s) - started )) s)"
  tail -n 25 "$out/bench_$name.log"
done
tar czf "$out/results.tgz" benchmarks/results
