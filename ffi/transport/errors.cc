#include "ffi/transport/errors.h"

#include <rdma/fi_errno.h>

namespace jax_moe::transport {

long check_fabric(long ret, const std::string& what) {
  if (ret < 0) {
    throw TransportError(what + ": " + fi_strerror(static_cast<int>(-ret)) + " (" +
                         std::to_string(ret) + ")");
  }
  return ret;
}

}  // namespace jax_moe::transport
