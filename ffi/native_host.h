// The contract between the nanobind module (ffi/module.cc) and the host backend
// (ffi/host/*.cc), which every build has (it needs only a C++ compiler).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* HostDispatchSendFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* HostDispatchRecvFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* HostDispatchFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* HostCombineSendFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* HostCombineRecvFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* HostCombineFfi(XLA_FFI_CallFrame* call_frame);
}

namespace jax_moe {

// Adds the host backend's Python bindings (rank state setup, error record, teardown).
void bind_host(nanobind::module_& m);

// Adds {target_name: capsule} for every FFI handler registered on the "cpu" platform.
void add_host_targets(nanobind::dict& targets);

}  // namespace jax_moe
