// Argument checks shared by every FFI handler (cuda and host): messages name the handler
// and the Python function whose arguments must agree.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_moe {
namespace ffi = xla::ffi;

// One expected dimension: its name in MoEConfig / docs terms, and its size.
struct NamedDim {
  const char* name;
  int64_t size;
};

// Which handler and which Python method it serves, for error messages.
struct CallSite {
  const char* target;     // e.g. "jax_moe_dispatch_send"
  const char* python_fn;  // e.g. "Communicator.dispatch_send"
};

// Error unless `dims` equals `expected`, e.g. "jax_moe_dispatch_send: x has shape [64,512],
// Communicator.dispatch_send expects [max_tokens=128, hidden=512]".
ffi::Error expect_shape(const CallSite& site, const char* arg, ffi::Span<const int64_t> dims,
                        std::initializer_list<NamedDim> expected);

// An InvalidArgument error "<target>: <what> (<python_fn>)".
ffi::Error invalid_argument(const CallSite& site, const std::string& what);

// Error unless `dtype` is `expected`.
ffi::Error expect_dtype(const CallSite& site, const char* arg, ffi::DataType dtype,
                        ffi::DataType expected);

}  // namespace jax_moe
