// The nanobind module jax_moe._native: FFI handler capsules per platform and build facts.
// jax_moe/native.py loads it and registers the capsules with jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "ffi/build_info.h"
#include "ffi/native_host.h"
#include "ffi/native_protocol.h"
#ifdef JAX_MOE_WITH_CUDA
#include "ffi/native_cuda.h"
#endif
#ifdef JAX_MOE_WITH_CUTLASS
#include "ffi/native_cutlass.h"
#endif
#ifdef JAX_MOE_WITH_LIBFABRIC
#include "ffi/native_host_fabric.h"
#include "ffi/native_transport.h"
#endif

namespace nb = nanobind;

namespace {

// {platform: {target_name: capsule}}; the platform names are those jax.ffi expects.
nb::dict registrations() {
  nb::dict cpu_targets;
  nb::dict cuda_targets;
  jax_moe::add_host_targets(cpu_targets);
#ifdef JAX_MOE_WITH_CUDA
  jax_moe::add_cuda_targets(cuda_targets);
#endif
#ifdef JAX_MOE_WITH_CUTLASS
  jax_moe::add_cutlass_targets(cuda_targets);
#endif
  nb::dict by_platform;
  by_platform["cpu"] = cpu_targets;
  by_platform["CUDA"] = cuda_targets;
  return by_platform;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax-moe native layer: XLA FFI handlers and their state";
  m.def("registrations", &registrations,
        "{platform: {target_name: capsule}} for jax.ffi.register_ffi_target");
  m.def("build_info", &jax_moe::build_info, "What this build contains (CUDA, libfabric, ...)");
  jax_moe::bind_protocol(m);
  jax_moe::bind_host(m);
#ifdef JAX_MOE_WITH_CUDA
  jax_moe::bind_cuda(m);
#endif
#ifdef JAX_MOE_WITH_CUTLASS
  jax_moe::bind_cutlass(m);
#endif
#ifdef JAX_MOE_WITH_LIBFABRIC
  jax_moe::bind_transport(m);
  jax_moe::bind_host_fabric(m);
#endif
}
