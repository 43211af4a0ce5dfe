// What this build of jax_moe._native contains (jax_moe.build_info() reports it).
#pragma once

#include <nanobind/nanobind.h>

namespace jax_moe {

// Keys: version, native, cuda, cuda_version, cuda_archs, libfabric, libfabric_version,
// libfabric_header_version, jax_version (whose FFI headers were compiled in), xla_ffi_api,
// thread_names (ffi/thread_names.h).
nanobind::dict build_info();

}  // namespace jax_moe
