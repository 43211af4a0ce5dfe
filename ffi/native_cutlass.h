// The contract between the nanobind module (ffi/module.cc) and the CUTLASS-based handlers
// (ffi/cutlass/*.cc). Both functions exist only in builds with JAX_MOE_WITH_CUTLASS (CUDA on
// and CUTLASS's headers found; CMakeLists.txt).
#pragma once

#include <nanobind/nanobind.h>

namespace jax_moe {

// Adds the CUTLASS handlers' Python helpers (the grouped GEMM's workspace size).
void bind_cutlass(nanobind::module_& m);

// Adds {target_name: capsule} of the CUTLASS handlers (platform "CUDA").
void add_cutlass_targets(nanobind::dict& targets);

}  // namespace jax_moe
