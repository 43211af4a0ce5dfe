#include "ffi/cuda/handler_util.h"

#include <string>

namespace jax_moe {
namespace {

std::string dims_text(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? "," : "") + std::to_string(dims[i]);
  return text + "]";
}

const char* dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "another dtype";
  }
}

}  // namespace

ffi::Error expect_shape(const CallSite& site, const char* arg, ffi::Span<const int64_t> dims,
                        std::initializer_list<NamedDim> expected) {
  bool same = dims.size() == expected.size();
  std::string want = "[";
  size_t i = 0;
  for (const NamedDim& d : expected) {
    if (same && dims[i] != d.size) same = false;
    want += std::string(i ? ", " : "") + d.name + "=" + std::to_string(d.size);
    ++i;
  }
  if (same) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(site.target) + ": " + arg + " has shape " +
                                     dims_text(dims) + ", " + site.python_fn + " expects " +
                                     want + "]");
}

ffi::Error expect_dtype(const CallSite& site, const char* arg, ffi::DataType dtype,
                        ffi::DataType expected) {
  if (dtype == expected) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(site.target) + ": " + arg + " has dtype " +
                                     dtype_name(dtype) + ", " + site.python_fn + " expects " +
                                     dtype_name(expected));
}

ffi::ErrorOr<CudaRankState*> begin_call(const CallSite& site, int64_t comm_id, int32_t ordinal) {
  CudaRankState* s = find_rank_state(comm_id, ordinal);
  if (s == nullptr || !s->connected)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(site.target) + ": no connected CUDA communicator state for comm_id=" +
        std::to_string(comm_id) + " on device " + std::to_string(ordinal) + "; " +
        site.python_fn + " must run on a device of the mesh given to " +
        "Communicator(backend='cuda'), which must not be closed"));
  if (s->timed_out || s->pending_error() == kTimeout)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_moe CommError: ") + site.target +
                          ": a peer timed out earlier on this communicator, so the ranks' "
                          "sequence numbers no longer agree; call Communicator.check() for the "
                          "details and build a new Communicator"));
  const cudaError_t status = cudaSetDevice(ordinal);
  if (status != cudaSuccess)
    return ffi::Unexpected(ffi::Error::Internal(std::string(site.target) + ": cudaSetDevice(" +
                                                std::to_string(ordinal) + ") failed: " +
                                                cudaGetErrorString(status)));
  return s;
}

ffi::Error launch_result(const CallSite& site, cudaError_t status) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(site.target) + ": kernel launch failed: " +
                              cudaGetErrorString(status));
}

}  // namespace jax_moe
