// FFI handler of the fp8 grouped GEMM (cuda/cutlass/grouped_gemm.cuh) and its Python bindings.
// Built only with CUTLASS (JAX_MOE_WITH_CUTLASS). Argument order and the workspace size match
// jax_moe/grouped_gemm.py (cutlass_ragged_dot_fp8).
#include <cuda_runtime.h>

#include <string>

#include "cuda/cutlass/grouped_gemm.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/handler_checks.h"
#include "ffi/native_cutlass.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_moe {
namespace {

const CallSite kSite{"jax_moe_grouped_gemm_fp8",
                     "grouped_gemm.ragged_dot (implementation='cutlass')"};

// SMs of `device`: the persistent grid's size and so the workspace's.
ffi::ErrorOr<int32_t> sm_count(int32_t device) {
  int sms = 0;
  const cudaError_t status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess || sms <= 0)
    return ffi::Unexpected(ffi::Error::Internal(std::string(kSite.target) +
                                                ": cannot read the SM count of device " +
                                                std::to_string(device) + ": " +
                                                cudaGetErrorString(status)));
  return sms;
}

ffi::Error GroupedGemmFp8Impl(cudaStream_t stream, int32_t ordinal, int32_t config,
                              ffi::AnyBuffer x_codes,
                              ffi::Buffer<ffi::F32> x_scales, ffi::AnyBuffer w_codes,
                              ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::Result<ffi::Buffer<ffi::BF16>> y,
                              ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  if (grouped_gemm_fp8_config_name(config) == nullptr)
    return invalid_argument(kSite, "config " + std::to_string(config) + " is not one of the " +
                                       std::to_string(kFp8ConfigCount) +
                                       " of cutlass_grouped_gemm_fp8_configs()");
  for (auto [name, dtype] : {std::pair{"x_codes", x_codes.element_type()},
                             std::pair{"w_codes", w_codes.element_type()}})
    if (auto err = expect_dtype(kSite, name, dtype, ffi::DataType::F8E4M3FN); err.failure())
      return err;
  const auto xd = x_codes.dimensions(), wd = w_codes.dimensions();
  if (xd.size() != 2) return invalid_argument(kSite, "x_codes must be [M, K]");
  if (wd.size() != 3) return invalid_argument(kSite, "w_codes must be [G, N, K]");
  const int64_t m = xd[0], k = xd[1], g = wd[0], n = wd[1];
  constexpr int64_t b = kGroupedGemmFp8Block;
  if (wd[2] != k)
    return invalid_argument(kSite, "w_codes [G, N, K] and x_codes [M, K] must share K");
  if (k % b != 0 || n % b != 0 || k == 0 || n == 0)
    return invalid_argument(kSite, "K and N must be positive multiples of 128, got K=" +
                                       std::to_string(k) + ", N=" + std::to_string(n));
  if (auto err = expect_shape(kSite, "x_scales", x_scales.dimensions(),
                              {{"M", m}, {"K/128", k / b}});
      err.failure())
    return err;
  if (auto err = expect_shape(kSite, "w_scales", w_scales.dimensions(),
                              {{"G", g}, {"N/128", n / b}, {"K/128", k / b}});
      err.failure())
    return err;
  if (auto err = expect_shape(kSite, "group_sizes", group_sizes.dimensions(), {{"G", g}});
      err.failure())
    return err;
  if (auto err = expect_shape(kSite, "y (output)", y->dimensions(), {{"M", m}, {"N", n}});
      err.failure())
    return err;
  if (auto err = set_device(kSite, ordinal); err.failure()) return err;
  auto sms = sm_count(ordinal);
  if (sms.has_error()) return sms.error();
  const size_t need =
      grouped_gemm_fp8_workspace_bytes(config, static_cast<int32_t>(g), m, n, k, *sms);
  if (workspace->size_bytes() < need)
    return invalid_argument(kSite, "workspace has " + std::to_string(workspace->size_bytes()) +
                                       " bytes, " + std::to_string(need) +
                                       " needed (cutlass_grouped_gemm_fp8_workspace_bytes)");

  const GroupedGemmFp8Args args{x_codes.untyped_data(), x_scales.typed_data(),
                                w_codes.untyped_data(), w_scales.typed_data(),
                                group_sizes.typed_data(), y->untyped_data(),
                                workspace->untyped_data(), workspace->size_bytes(),
                                m, n, k, static_cast<int32_t>(g), *sms, ordinal, config};
  const char* detail = nullptr;
  const cudaError_t status = launch_grouped_gemm_fp8(args, &detail, stream);
  if (status != cudaSuccess && detail != nullptr) return invalid_argument(kSite, detail);
  return launch_result(kSite, status);
}

}  // namespace

void bind_cutlass(nb::module_& m) {
  m.def(
      "cutlass_grouped_gemm_fp8_configs",
      [] {
        nb::list names;
        for (int32_t c = 0; c < kFp8ConfigCount; ++c)
          names.append(nb::str(grouped_gemm_fp8_config_name(c)));
        return names;
      },
      "Names of the fp8 grouped GEMM's tile configs; a config's index is its `config` "
      "attribute (GroupedGemmFp8Config).");
  m.def(
      "cutlass_grouped_gemm_fp8_workspace_bytes",
      [](int32_t config, int32_t groups, int64_t rows, int64_t n, int64_t k, int32_t device) {
        if (grouped_gemm_fp8_config_name(config) == nullptr)
          throw nb::value_error(("unknown config " + std::to_string(config)).c_str());
        auto sms = sm_count(device);
        if (sms.has_error()) throw std::runtime_error(std::string(sms.error().message()));
        return grouped_gemm_fp8_workspace_bytes(config, groups, rows, n, k, *sms);
      },
      nb::arg("config"), nb::arg("groups"), nb::arg("rows"), nb::arg("n"), nb::arg("k"),
      nb::arg("device"),
      "Bytes of the workspace output of jax_moe_grouped_gemm_fp8 for x [rows, k], w [groups, "
      "n, k] on CUDA device `device` (its SM count sizes CUTLASS's part).");
}

}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmFp8Ffi, jax_moe::GroupedGemmFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int32_t>("config")             // GroupedGemmFp8Config
                                  .Arg<ffi::AnyBuffer>()               // x_codes [M, K] e4m3
                                  .Arg<ffi::Buffer<ffi::F32>>()        // x_scales [M, K/128]
                                  .Arg<ffi::AnyBuffer>()               // w_codes [G, N, K] e4m3
                                  .Arg<ffi::Buffer<ffi::F32>>()        // w_scales [G, N/128, K/128]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // group_sizes [G]
                                  .Ret<ffi::Buffer<ffi::BF16>>()       // y [M, N]
                                  .Ret<ffi::Buffer<ffi::U8>>(),        // workspace
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

void add_cutlass_targets(nb::dict& targets) {
  targets["jax_moe_grouped_gemm_fp8"] = nb::capsule(reinterpret_cast<void*>(GroupedGemmFp8Ffi));
}

}  // namespace jax_moe
