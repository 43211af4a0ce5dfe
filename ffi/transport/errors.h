// The TransferEngine's exception types and the libfabric return-code check.
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

// A write could not be posted before its deadline because the transmit queue to its peer
// stayed full (a dead or unreachable peer, or one slow to drain). Nothing failed: the engine
// stays usable and the write may be posted again.
class TransportBusy : public TransportError {
 public:
  using TransportError::TransportError;
};

// A wait reached its deadline short of the immediates it waits for. Nothing failed: the
// engine stays usable and the wait may be repeated.
class TransportTimeout : public TransportError {
 public:
  using TransportError::TransportError;
};

// Throws TransportError("<what>: <fi_strerror> (<code>)") when `ret` is a negative
// libfabric error code; returns `ret` otherwise.
long check_fabric(long ret, const std::string& what);

}  // namespace jax_moe::transport
