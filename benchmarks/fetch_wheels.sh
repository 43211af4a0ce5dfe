#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels the lent GPU machines lack (they reach no package
# index): scikit-build-core for the build, tokamax and what it imports for the experts'
# grouped GEMM, nvidia-cutlass for CUTLASS's headers (cuda/cutlass/fetch_headers.sh). Python
# 3.12 and the manylinux tags that image accepts; pip matches each tag exactly (xprof 2.24.2
# exists for manylinux_2_27 only), so every one is named.
#   benchmarks/fetch_wheels.sh [DIR]   (default .whl)
set -euo pipefail
dir=${1:-.whl}
tags=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 any; do
  tags+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${tags[@]}" -d "$dir" \
  scikit-build-core tokamax==0.0.17 pydantic pydantic-core annotated-types typing-inspection \
  typing-extensions qwix einshape immutabledict tensorboardx xprof==2.24.2 fire termcolor \
  nvidia-cutlass==4.2.0.0
ls "$dir"
