#include "ffi/build_info.h"

#include <cstdint>
#include <string>

#include "ffi/thread_names.h"
#include "xla/ffi/api/c_api.h"

#ifdef JAX_MOE_WITH_LIBFABRIC
#include <rdma/fabric.h>
#endif

namespace nb = nanobind;

namespace jax_moe {
namespace {

nb::str major_minor(uint32_t major, uint32_t minor) {
  return nb::str((std::to_string(major) + "." + std::to_string(minor)).c_str());
}

}  // namespace

nb::dict build_info() {
  nb::dict info;
  info["version"] = nb::str(JAX_MOE_VERSION);
  info["native"] = nb::bool_(true);
  info["jax_version"] = nb::str(JAX_MOE_JAX_VERSION);
  info["xla_ffi_api"] = major_minor(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAX_MOE_WITH_CUDA
  info["cuda"] = nb::bool_(true);
  info["cuda_version"] = nb::str(JAX_MOE_CUDA_VERSION);
  info["cuda_archs"] = nb::str(JAX_MOE_CUDA_ARCHS);
#else
  info["cuda"] = nb::bool_(false);
  info["cuda_version"] = nb::none();
  info["cuda_archs"] = nb::none();
#endif
#ifdef JAX_MOE_WITH_CUTLASS
  info["cutlass_version"] = nb::str(JAX_MOE_CUTLASS_VERSION);
#else
  info["cutlass_version"] = nb::none();
#endif
#ifdef JAX_MOE_WITH_LIBFABRIC
  // The runtime library may be newer than the headers the build saw; report both.
  const uint32_t runtime = fi_version();
  info["libfabric"] = nb::bool_(true);
  info["libfabric_version"] = major_minor(FI_MAJOR(runtime), FI_MINOR(runtime));
  info["libfabric_header_version"] = major_minor(FI_MAJOR_VERSION, FI_MINOR_VERSION);
#else
  info["libfabric"] = nb::bool_(false);
  info["libfabric_version"] = nb::none();
  info["libfabric_header_version"] = nb::none();
#endif
  nb::dict thread_names;
  thread_names["transfer_engine"] = nb::str(kTransferEngineThreadName);
  thread_names["host_proxy"] = nb::str(kHostProxyThreadName);
  info["thread_names"] = thread_names;
  return info;
}

}  // namespace jax_moe
