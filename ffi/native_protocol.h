// The contract between the nanobind module (ffi/module.cc) and the protocol's Python side:
// MoeDims (ffi/protocol/dims.h) bound as jax_moe._native.MoeDims, whose fields Python sets from
// the MoEConfig (jax_moe/backends/native_backend.py moe_dims), the enums and the buffer sizes.
#pragma once

#include <nanobind/nanobind.h>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// Adds MoeDims, protocol_enums and buffer_bytes.
void bind_protocol(nanobind::module_& m);

// Throws (a Python ValueError through nanobind) when `d` cannot describe a rank: the sizes a
// binding that takes MoeDims relies on.
void check_dims(const MoeDims& d);

}  // namespace jax_moe
