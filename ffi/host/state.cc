#include "ffi/host/state.h"

#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace jax_moe::host {
namespace {

std::mutex registry_mutex;
std::map<std::pair<int64_t, int>, std::unique_ptr<HostRankState>> registry;

std::string key_text(int64_t comm_id, int ordinal) {
  return "comm_id=" + std::to_string(comm_id) + ", device " + std::to_string(ordinal);
}

// Requires registry_mutex.
HostRankState& existing(int64_t comm_id, int ordinal) {
  auto it = registry.find({comm_id, ordinal});
  if (it == registry.end()) {
    throw std::invalid_argument("jax_moe host backend: no rank state for " +
                                key_text(comm_id, ordinal));
  }
  return *it->second;
}

}  // namespace

void HostRankState::record_error(int32_t code, int32_t stage, int32_t detail) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (has_error_) return;
  has_error_ = true;
  error_ = ErrorRecord{code, stage, dims.rank, detail};
}

bool HostRankState::take_error(ErrorRecord* out) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (!has_error_) return false;
  *out = error_;
  has_error_ = false;
  return true;
}

void create_host_rank(int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s) {
  if (!(timeout_s > 0)) throw std::invalid_argument("JAX_MOE_TIMEOUT_S must be positive");
  auto state = std::make_unique<HostRankState>();
  state->comm_id = comm_id;
  state->ordinal = ordinal;
  state->dims = dims;
  state->timeout_s = timeout_s;
  const BufferLayout layout = buffer_layout(dims);
  // Value-initialised: flags start at sequence 0 and unwritten regions read as zeros.
  state->storage = alloc_pages(layout.total);
  state->storage_bytes = page_rounded(layout.total);
  state->buffer = reinterpret_cast<char*>(state->storage.get());
  state->expert_counts.assign(size_t(dims.world) * dims.local_experts, 0);
  state->slot_rank.assign(size_t(dims.world) * dims.max_tokens * dims.topk, 0);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto [it, inserted] = registry.try_emplace({comm_id, ordinal}, std::move(state));
  if (!inserted) {
    throw std::invalid_argument("jax_moe host backend: rank state exists already: " +
                                key_text(comm_id, ordinal));
  }
}

void connect_host_rank(int64_t comm_id, int ordinal, const std::vector<int>& ordinals) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  HostRankState& s = existing(comm_id, ordinal);
  if (static_cast<int>(ordinals.size()) != s.dims.world) {
    throw std::invalid_argument("jax_moe host backend: " + std::to_string(ordinals.size()) +
                                " ordinals for " + std::to_string(s.dims.world) + " ranks");
  }
  if (s.remote != nullptr && !s.remote->connected()) {
    throw std::invalid_argument("jax_moe host backend: " + key_text(comm_id, ordinal) +
                                " has remote ranks not connected yet (host_connect_remote)");
  }
  s.peers.clear();
  for (int p = 0; p < s.dims.world; ++p) {
    const bool remote = s.remote != nullptr && s.remote->is_remote(p);
    if ((ordinals[p] < 0) != remote) {
      throw std::invalid_argument(
          "jax_moe host backend: rank " + std::to_string(p) + " has ordinal " +
          std::to_string(ordinals[p]) + ", but it " + (remote ? "is" : "is not") +
          " a remote rank of " + key_text(comm_id, ordinal) + " (-1 marks remote ranks)");
    }
    s.peers.push_back(remote ? s.remote->staging(p) : existing(comm_id, ordinals[p]).buffer);
  }
  s.connected = true;
}

void set_host_threads(int64_t comm_id, int ordinal, int threads) {
  if (threads < 1 || threads > 64) {
    throw std::invalid_argument("jax_moe host backend: threads must be in [1, 64], got " +
                                std::to_string(threads));
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  existing(comm_id, ordinal).threads = threads;
}

bool take_host_error(int64_t comm_id, int ordinal, ErrorRecord* out) {
  HostRankState* s = find_host_rank(comm_id, ordinal);
  if (s == nullptr) return false;
  return s->take_error(out);
}

void destroy_host_rank(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase({comm_id, ordinal});
}

HostRankState* find_host_rank(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find({comm_id, ordinal});
  return it == registry.end() ? nullptr : it->second.get();
}

}  // namespace jax_moe::host
