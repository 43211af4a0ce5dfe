// Zeroed host memory that starts on a page and covers whole pages. The cuda host proxies
// (ffi/cuda/host_proxy.h) register a host rank's buffer and its staging copies with
// cudaHostRegister, which pins whole pages: two allocations sharing a page could not both be
// registered.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace jax_moe::host {

struct FreePages {
  void operator()(uint64_t* p) const { std::free(p); }
};
using PageMemory = std::unique_ptr<uint64_t[], FreePages>;

// `bytes` rounded up to whole pages (at least one): what alloc_pages(bytes) allocates.
inline size_t page_rounded(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return bytes > page ? (bytes + page - 1) / page * page : page;
}

// page_rounded(bytes) zeroed bytes (at least one page). Throws std::bad_alloc.
inline PageMemory alloc_pages(size_t bytes) {
  const size_t total = page_rounded(bytes);
  void* p = std::aligned_alloc(static_cast<size_t>(sysconf(_SC_PAGESIZE)), total);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, total);
  return PageMemory(static_cast<uint64_t*>(p));
}

}  // namespace jax_moe::host
