# Sourced by the gpu_*.sh scripts: build_jax_moe LOG LIBFABRIC(ON|OFF) installs this checkout
# editable with the CUDA kernels, the build log in LOG. The GPU machines have no package index:
# when the run carries a scikit-build-core wheel in .whl/ (the `wheel.packages` table of
# pyproject.toml wants a recent one), the build uses it, and only the build sees it.
build_jax_moe() {
  local log=$1 fabric=$2
  build_backend "$log" || return 1
  # CUTLASS's headers for the fp8 grouped GEMM, from the nvidia-cutlass wheel the run carries
  if [ ! -f .cutlass/include/cutlass/version.h ] \
      && compgen -G ".whl/nvidia_cutlass-*.whl" >/dev/null; then
    bash cuda/cutlass/fetch_headers.sh >> "$log" 2>&1 || return 1
  fi
  { python3 -m pip show scikit-build-core 2>/dev/null | grep -i '^version' | sed 's/^/system scikit-build-core /'
    [ -n "$backend_path" ] && echo "build backend from $backend_path"; } >> "$log"
  PYTHONPATH=$backend_path${PYTHONPATH:+:$PYTHONPATH} python3 -m pip install --no-build-isolation \
    --no-deps -e . -Ccmake.define.JAX_MOE_ENABLE_CUDA=ON \
    -Ccmake.define.JAX_MOE_ENABLE_LIBFABRIC="$fabric" >> "$log" 2>&1
}

# build_backend LOG: sets `backend_path` to a folder holding the scikit-build-core of the wheel
# the run carries in .whl/ (installed there; the build puts it on PYTHONPATH), or to "" when
# the run carries none; pip's output goes to LOG.
build_backend() {
  local log=$1 wheel
  backend_path=""
  wheel=$(compgen -G ".whl/scikit_build_core-*.whl" | head -1)
  [ -z "$wheel" ] && return 0
  backend_path=/tmp/jax_moe_build_backend
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target "$backend_path" "$wheel" > "$log" 2>&1
}

# Sets `fabric` to ON when the run carries libfabric's headers in .fabric/ (the GPU machines
# have its runtime only; ../shared/tools/libfabric-dev-unpack .fabric), with PKG_CONFIG_PATH
# pointed at them, else OFF. Every gpu_*.sh script builds with the same setting, so one
# script's build is the next one's cache.
find_libfabric() {
  fabric=OFF
  if [ -f .fabric/lib/pkgconfig/libfabric.pc ]; then
    fabric=ON
    export PKG_CONFIG_PATH=$PWD/.fabric/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  fi
}
