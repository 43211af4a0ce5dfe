#include "ffi/cuda/handler_util.h"

#include <string>

namespace jax_moe {

ffi::ErrorOr<CudaRankState*> begin_call(const CallSite& site, int64_t comm_id, int32_t ordinal) {
  CudaRankState* s = find_rank_state(comm_id, ordinal);
  if (s == nullptr || !s->connected)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(site.target) + ": no connected CUDA communicator state for comm_id=" +
        std::to_string(comm_id) + " on device " + std::to_string(ordinal) + "; " +
        site.python_fn + " must run on a device of the mesh given to " +
        "Communicator(backend='cuda'), which must not be closed"));
  if (s->timed_out || s->pending_error() == kTimeout || (s->proxy && s->proxy->timed_out()))
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_moe CommError: ") + site.target +
                          ": a peer timed out earlier on this communicator, so the ranks' "
                          "sequence numbers no longer agree; call Communicator.check() for the "
                          "details and build a new Communicator"));
  if (auto err = set_device(site, ordinal); err.failure()) return ffi::Unexpected(err);
  return s;
}

ffi::Error set_device(const CallSite& site, int32_t ordinal) {
  const cudaError_t status = cudaSetDevice(ordinal);
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(site.target) + ": cudaSetDevice(" +
                              std::to_string(ordinal) + ") failed: " +
                              cudaGetErrorString(status));
}

ffi::Error launch_result(const CallSite& site, cudaError_t status) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(site.target) + ": kernel launch failed: " +
                              cudaGetErrorString(status));
}

}  // namespace jax_moe
