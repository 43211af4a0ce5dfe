// The contract between the nanobind module (ffi/module.cc) and the CUDA handlers
// (ffi/cuda/*.cc). Both functions exist only in builds with JAX_MOE_WITH_CUDA.
//
// Build notes for ffi/cuda/*.cc and cuda/*.cu:
// - ffi/cuda/*.cc are compiled by the host C++ compiler into the module; cuda/*.cu are
//   compiled by nvcc into a static, position-independent library linked into it.
// - The CUDA runtime is linked statically (CUDA::cudart_static). libcuda is NOT linked, so
//   the module still imports on machines without a driver; reach driver entry points through
//   cudaGetDriverEntryPoint rather than calling cu* symbols directly.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_moe {

// Adds the CUDA-only Python bindings (state setup/teardown, ...) to the module.
void bind_cuda(nanobind::module_& m);

// Adds {target_name: capsule} (or {target_name: {stage: capsule}}) for every FFI handler
// registered on the "CUDA" platform.
void add_cuda_targets(nanobind::dict& targets);

}  // namespace jax_moe
