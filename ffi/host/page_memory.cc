#include "ffi/host/page_memory.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>

namespace jax_moe::host {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& name, int error) {
  throw std::runtime_error("jax_moe host backend: " + what + " of shared memory '" + name +
                           "' failed: " + std::strerror(error));
}

// Maps `bytes` of the open object `fd` and closes it (the mapping keeps the object).
char* map_shared(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (p == MAP_FAILED) fail("mmap", name, error);
  return static_cast<char*>(p);
}

}  // namespace

MappedPages::MappedPages(size_t bytes) : bytes_(page_rounded(bytes)) {
  // Anonymous pages read as zeros.
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<char*>(p);
}

MappedPages MappedPages::reserve(size_t bytes) {
  MappedPages m;
  m.bytes_ = page_rounded(bytes);
  void* p =
      mmap(nullptr, m.bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  m.data_ = static_cast<char*>(p);
  return m;
}

void MappedPages::commit(size_t offset, size_t length) {
  if (mprotect(data_ + offset, length, PROT_READ | PROT_WRITE) != 0) throw std::bad_alloc();
}

MappedPages MappedPages::create_shared(const std::string& name, size_t bytes) {
  MappedPages m;
  m.bytes_ = page_rounded(bytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
  if (fd < 0) fail("shm_open", name, errno);
  // A new object reads as zeros. Its pages are allocated now: a /dev/shm too small for them
  // (a container's default) is an error here, not a SIGBUS at the first write past its end.
  const int error = posix_fallocate(fd, 0, static_cast<off_t>(m.bytes_));
  if (error != 0) {
    close(fd);
    shm_unlink(name.c_str());
    fail("allocating " + std::to_string(m.bytes_) + " bytes (is /dev/shm large enough?)", name,
         error);
  }
  try {
    m.data_ = map_shared(fd, m.bytes_, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  return m;
}

MappedPages MappedPages::open_shared(const std::string& name, size_t bytes) {
  MappedPages m;
  m.bytes_ = page_rounded(bytes);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail("shm_open", name, errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    fail("fstat", name, error);
  }
  if (static_cast<size_t>(st.st_size) != m.bytes_) {
    close(fd);
    throw std::runtime_error("jax_moe host backend: shared memory '" + name + "' holds " +
                             std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(m.bytes_) +
                             " (the ranks' MoEConfig or world differ)");
  }
  m.data_ = map_shared(fd, m.bytes_, name);
  return m;
}

bool unlink_shared(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

}  // namespace jax_moe::host
