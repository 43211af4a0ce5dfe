// The contract between the nanobind module (ffi/module.cc) and the TransferEngine bindings
// (ffi/transport/bindings.cc); it exists only in builds with JAX_MOE_WITH_LIBFABRIC.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_moe {

// Adds the TransferEngine class and the TransportError exception to the module
// (used by jax_moe/transport.py).
void bind_transport(nanobind::module_& m);

}  // namespace jax_moe
