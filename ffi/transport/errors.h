// The TransferEngine's one exception type and the libfabric return-code check.
// Bindings map TransportError to jax_moe.transport.TransportError; the proxy worker (which
// runs under FFI handlers that must not throw) catches it at its thread boundary.
#pragma once

#include <stdexcept>
#include <string>

namespace jax_moe::transport {

class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws TransportError("<what>: <fi_strerror> (<code>)") when `ret` is a negative
// libfabric error code; returns `ret` otherwise.
long check_fabric(long ret, const std::string& what);

}  // namespace jax_moe::transport
