// Zeroed host memory that starts on a page and covers whole pages. The cuda host proxies
// (ffi/cuda/host_proxy.h) register a host rank's buffer and its staging copies with
// cudaHostRegister, which pins whole pages: two allocations sharing a page could not both be
// registered.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

namespace jax_moe::host {

struct FreePages {
  void operator()(uint64_t* p) const { std::free(p); }
};
using PageMemory = std::unique_ptr<uint64_t[], FreePages>;

inline size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// `bytes` rounded up to whole pages (at least one): what alloc_pages(bytes) allocates.
inline size_t page_rounded(size_t bytes) {
  const size_t page = page_size();
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

// Address space of page_rounded(bytes) that holds no memory until parts of it are committed:
// commit() makes whole pages readable and writable (zero-filled, backed by memory when first
// touched or pinned); the rest stays inaccessible, so a stray access faults at once.
class ReservedPages {
 public:
  ReservedPages() = default;
  // Throws std::bad_alloc when the address space cannot be reserved.
  explicit ReservedPages(size_t bytes) : bytes_(page_rounded(bytes)) {
    void* p = mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<char*>(p);
  }
  ~ReservedPages() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  ReservedPages(ReservedPages&& other) noexcept { *this = std::move(other); }
  ReservedPages& operator=(ReservedPages&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ReservedPages(const ReservedPages&) = delete;
  ReservedPages& operator=(const ReservedPages&) = delete;

  char* data() const { return data_; }
  // Commits [offset, offset + length) (whole pages, inside the reservation). Throws
  // std::bad_alloc when the kernel refuses.
  void commit(size_t offset, size_t length) {
    if (mprotect(data_ + offset, length, PROT_READ | PROT_WRITE) != 0) throw std::bad_alloc();
  }

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace jax_moe::host
