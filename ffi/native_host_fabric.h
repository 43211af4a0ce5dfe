// The contract between the nanobind module (ffi/module.cc) and the cross-process part of the
// host backend (ffi/host_fabric/), which exists only in builds with JAX_MOE_WITH_LIBFABRIC.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_moe {

// Adds host_open_remote / host_connect_remote (used by jax_moe/backends/host_remote.py).
void bind_host_fabric(nanobind::module_& m);

}  // namespace jax_moe
