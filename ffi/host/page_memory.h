// Zeroed host memory that starts on a page and covers whole pages. The cuda host proxies
// (ffi/cuda/host_proxy.h) register a host rank's buffer and its staging copies with
// cudaHostRegister, which pins whole pages: two allocations sharing a page could not both be
// registered.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

namespace jax_moe::host {

inline size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// `bytes` rounded up to whole pages (at least one): what MappedPages(bytes) maps.
inline size_t page_rounded(size_t bytes) {
  const size_t page = page_size();
  return bytes > page ? (bytes + page - 1) / page * page : page;
}

// page_rounded(bytes) zeroed bytes mapped into this process: private memory, or a POSIX
// shared-memory object that processes of one host map to share a rank's buffer
// (HostRankState, "near" ranks), or reserved address space. Unmapped when destroyed.
class MappedPages {
 public:
  MappedPages() = default;
  // Private memory. Throws std::bad_alloc.
  explicit MappedPages(size_t bytes);
  // Address space that holds no memory until parts of it are committed: commit() makes
  // whole pages readable and writable (zero-filled, backed by memory when first touched or
  // pinned); the rest stays inaccessible, so a stray access faults at once. Throws
  // std::bad_alloc when the address space cannot be reserved.
  static MappedPages reserve(size_t bytes);
  // Creates the shared-memory object `name` ("/..."; it must not exist) of page_rounded(bytes)
  // and maps it. Throws std::runtime_error naming the object and the system error.
  static MappedPages create_shared(const std::string& name, size_t bytes);
  // Maps the existing object `name`, which must hold page_rounded(bytes). Throws
  // std::runtime_error naming the object and the system error (or the size found).
  static MappedPages open_shared(const std::string& name, size_t bytes);
  ~MappedPages() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  MappedPages(MappedPages&& other) noexcept { *this = std::move(other); }
  MappedPages& operator=(MappedPages&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  MappedPages(const MappedPages&) = delete;
  MappedPages& operator=(const MappedPages&) = delete;

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }  // whole pages
  // Commits [offset, offset + length) of reserved pages (whole pages, inside them). Throws
  // std::bad_alloc when the kernel refuses.
  void commit(size_t offset, size_t length);

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

// Removes the name of a shared-memory object (the mappings stay valid); false if it is gone.
bool unlink_shared(const std::string& name);

}  // namespace jax_moe::host
