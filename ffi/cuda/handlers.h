// The XLA FFI handlers of the CUDA backend (platform "CUDA"), one per target:
//   jax_moe_dispatch_send / _recv / jax_moe_dispatch  (ffi/cuda/exchange_ffi.cc)
//   jax_moe_combine_send / _recv / jax_moe_combine    (ffi/cuda/exchange_ffi.cc)
//   jax_moe_all_reduce                                (ffi/cuda/all_reduce_ffi.cc)
//   jax_moe_dequantize_fp8                            (ffi/cuda/dequantize_ffi.cc)
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* DispatchSendFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DispatchRecvFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DispatchFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CombineSendFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CombineRecvFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CombineFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* AllReduceFfi(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DequantizeFp8Ffi(XLA_FFI_CallFrame* call_frame);
}
