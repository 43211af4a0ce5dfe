#include "ffi/handler_checks.h"

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

ffi::Error invalid_argument(const CallSite& site, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(site.target) + ": " + what + " (" +
                                     site.python_fn + ")");
}

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

}  // namespace jax_moe
