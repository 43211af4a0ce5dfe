#include "ffi/exchange_checks.h"

namespace jax_moe {

ffi::ErrorOr<TokenInput> check_dispatch_send(const CallSite& site, const MoeDims& d,
                                             ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                                             ffi::Buffer<ffi::S32> topk_ids,
                                             ffi::Buffer<ffi::F32> topk_weights,
                                             ffi::Buffer<ffi::S32> num_tokens,
                                             ffi::Buffer<ffi::S32> send_dest) {
  const NamedDim T{"max_tokens", d.max_tokens}, H{"hidden", d.hidden},
      K{"experts_per_token", d.topk};
  TokenInput input = d.fp8 ? kInputBf16Quantize : kInputBf16;
  if (x.element_type() == ffi::DataType::F8E4M3FN && d.fp8) {
    input = kInputFp8;
  } else if (auto err = expect_dtype(site, "x", x.element_type(), ffi::DataType::BF16);
             err.failure()) {
    return ffi::Unexpected(err);
  }
  if (auto err = expect_shape(site, "x", x.dimensions(), {T, H}); err.failure())
    return ffi::Unexpected(err);
  if (auto err = expect_dtype(site, "x_scales", x_scales.element_type(), ffi::DataType::F32);
      err.failure())
    return ffi::Unexpected(err);
  const ffi::Error scales_ok =
      input == kInputFp8
          ? expect_shape(site, "x_scales", x_scales.dimensions(),
                         {T, {"hidden/block_size", d.hidden / d.block_size}})
          : expect_shape(site, "x_scales (absent with bf16 x)", x_scales.dimensions(), {{"0", 0}});
  if (scales_ok.failure()) return ffi::Unexpected(scales_ok);
  for (auto [name, dims] : {std::pair{"topk_ids", topk_ids.dimensions()},
                            std::pair{"topk_weights", topk_weights.dimensions()},
                            std::pair{"send_dest", send_dest.dimensions()}}) {
    if (auto err = expect_shape(site, name, dims, {T, K}); err.failure())
      return ffi::Unexpected(err);
  }
  if (auto err = expect_shape(site, "num_tokens", num_tokens.dimensions(), {{"1", 1}});
      err.failure())
    return ffi::Unexpected(err);
  return input;
}

ffi::Error check_dispatch_recv(const CallSite& site, const MoeDims& d,
                               ffi::Result<ffi::AnyBuffer> x,
                               ffi::Result<ffi::Buffer<ffi::F32>> scales,
                               ffi::Result<ffi::Buffer<ffi::F32>> weights,
                               ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                               ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                               ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  const NamedDim C{"capacity", d.capacity}, H{"hidden", d.hidden},
      L{"num_local_experts", d.local_experts};
  if (auto err = expect_dtype(site, "x (output)", x->element_type(),
                              d.fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16);
      err.failure())
    return err;
  if (auto err = expect_shape(site, "x (output)", x->dimensions(), {C, H}); err.failure())
    return err;
  const ffi::Error scales_ok =
      d.fp8 ? expect_shape(site, "scales (output)", scales->dimensions(),
                           {C, {"hidden/block_size", d.hidden / d.block_size}})
            : expect_shape(site, "scales (output, absent with bf16 dispatch)",
                           scales->dimensions(), {{"0", 0}});
  if (scales_ok.failure()) return scales_ok;
  if (auto err = expect_shape(site, "weights (output)", weights->dimensions(), {C});
      err.failure())
    return err;
  if (auto err = expect_shape(site, "group_sizes (output)", group_sizes->dimensions(), {L});
      err.failure())
    return err;
  if (auto err = expect_shape(site, "tokens_per_expert (output)",
                              tokens_per_expert->dimensions(), {L});
      err.failure())
    return err;
  return expect_shape(site, "slot_rows (output)", slot_rows->dimensions(),
                      {{"axis_size", d.world}, {"max_tokens", d.max_tokens},
                       {"experts_per_token", d.topk}});
}

ffi::Error check_combine_send(const CallSite& site, const MoeDims& d, ffi::Buffer<ffi::BF16> y,
                              ffi::Buffer<ffi::S32> slot_rows, ffi::Buffer<ffi::F32> row_weights) {
  if (auto err = expect_shape(site, "y", y.dimensions(),
                              {{"capacity", d.capacity}, {"hidden", d.hidden}});
      err.failure())
    return err;
  if (auto err = expect_shape(site, "handle.slot_rows", slot_rows.dimensions(),
                              {{"axis_size", d.world}, {"max_tokens", d.max_tokens},
                               {"experts_per_token", d.topk}});
      err.failure())
    return err;
  return expect_shape(site, "handle.row_weights", row_weights.dimensions(),
                      {{"capacity", d.capacity}});
}

ffi::Error check_combine_recv(const CallSite& site, const MoeDims& d,
                              ffi::Buffer<ffi::S32> send_dest, ffi::Buffer<ffi::F32> topk_weights,
                              ffi::Buffer<ffi::BF16> out) {
  const NamedDim T{"max_tokens", d.max_tokens}, K{"experts_per_token", d.topk};
  if (auto err = expect_shape(site, "handle.send_dest", send_dest.dimensions(), {T, K});
      err.failure())
    return err;
  if (auto err = expect_shape(site, "handle.topk_weights", topk_weights.dimensions(), {T, K});
      err.failure())
    return err;
  return expect_shape(site, "out (output)", out.dimensions(), {T, {"hidden", d.hidden}});
}

}  // namespace jax_moe
