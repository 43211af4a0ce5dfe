#!/usr/bin/env bash
# Builds a libfabric that registers CUDA memory (FI_HMEM), for the cuda proxies' device-rows
# path (JAX_MOE_PROXY_HMEM) on machines whose libfabric is a distribution build without CUDA
# (Debian's and Ubuntu's 1.17, as on the lent GPU machines: shm grants FI_HMEM, then refuses
# every CUDA registration). Only the shm, tcp and rxm providers; CUDA is opened at run time
# (dlopen), so the build needs CUDA's headers, not its libraries.
#   benchmarks/build_libfabric_cuda.sh SRC [OUT]
# SRC: a libfabric source tree, v1.17.1 to match the 1.17 headers jax_moe is built against
# (git archive v1.17.1 of github.com/ofiwg/libfabric); needs autoconf, automake and libtool.
# OUT (default .fabric-cuda): receives lib/libfabric.so.1*, which a run puts first on
# LD_LIBRARY_PATH (gpu_run.sh's step hmemcuda; the soname is the distribution's, so jax_moe's
# module loads it unchanged).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1/configure.ac" ]; then
  echo "usage: $0 LIBFABRIC_SOURCE [OUT]" >&2
  exit 2
fi
src=$(cd "$1" && pwd)
out=$(mkdir -p "${2:-.fabric-cuda}" && cd "${2:-.fabric-cuda}" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src/." "$work/"
cd "$work"
./autogen.sh > autogen.log 2>&1
disabled=(sockets udp verbs efa psm psm2 psm3 usnic rxd mrail opx gni bgq net rstream)
./configure --prefix="$work/install" --with-cuda="$cuda" --enable-cuda-dlopen --disable-static \
  --enable-shm --enable-tcp --enable-rxm "${disabled[@]/#/--disable-}" > configure.log 2>&1
grep -q '^#define HAVE_CUDA 1' config.h || { echo "configure found no CUDA headers in $cuda"; exit 1; }
make -j"$(nproc)" > make.log 2>&1
make install > install.log 2>&1
mkdir -p "$out/lib"
cp -a "$work/install/lib/"libfabric.so.1* "$out/lib/"
echo "built $(ls "$out/lib") into $out/lib"
