#include "ffi/host/state.h"

#include <unistd.h>

#include <cstdio>
#include <map>
#include <random>
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

// A name no other object has: the process, the rank, and 64 random bits (a process that
// died before removing its names may have had this pid).
std::string fresh_shared_name(int64_t comm_id, int ordinal) {
  std::random_device entropy;
  const uint64_t nonce = (uint64_t(entropy()) << 32) | entropy();
  char text[96];
  std::snprintf(text, sizeof(text), "/jax_moe.%d.%lld.%d.%016llx", int(getpid()),
                static_cast<long long>(comm_id), ordinal,
                static_cast<unsigned long long>(nonce));
  return text;
}

}  // namespace

HostRankState::~HostRankState() {
  if (!shared_name.empty()) unlink_shared(shared_name);
}

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

void create_host_rank(int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s,
                      bool shared) {
  if (!(timeout_s > 0)) throw std::invalid_argument("JAX_MOE_TIMEOUT_S must be positive");
  auto state = std::make_unique<HostRankState>();
  state->comm_id = comm_id;
  state->ordinal = ordinal;
  state->dims = dims;
  state->timeout_s = timeout_s;
  const BufferLayout layout = buffer_layout(dims);
  // Zeroed: flags start at sequence 0 and unwritten regions read as zeros.
  if (shared) {
    state->shared_name = fresh_shared_name(comm_id, ordinal);
    state->storage = MappedPages::create_shared(state->shared_name, layout.total);
  } else {
    state->storage = MappedPages(layout.total);
  }
  state->buffer = state->storage.data();
  state->near.resize(dims.world);
  state->expert_counts.assign(size_t(dims.world) * dims.local_experts, 0);
  state->slot_rank.assign(size_t(dims.world) * dims.max_tokens * dims.topk, 0);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto [it, inserted] = registry.try_emplace({comm_id, ordinal}, std::move(state));
  if (!inserted) {
    throw std::invalid_argument("jax_moe host backend: rank state exists already: " +
                                key_text(comm_id, ordinal));
  }
}

std::string host_shared_name(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  HostRankState& s = existing(comm_id, ordinal);
  if (s.shared_name.empty()) {
    throw std::invalid_argument("jax_moe host backend: the buffer of " +
                                key_text(comm_id, ordinal) +
                                " is not shared (host_create_rank(shared=True)), or its name "
                                "was removed already");
  }
  return s.shared_name;
}

void map_near_rank(int64_t comm_id, int ordinal, int peer, const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  HostRankState& s = existing(comm_id, ordinal);
  if (peer < 0 || peer >= s.dims.world || peer == s.dims.rank || s.connected ||
      s.near[peer].data() != nullptr) {
    throw std::invalid_argument("jax_moe host backend: near rank " + std::to_string(peer) +
                                " of " + key_text(comm_id, ordinal) +
                                " must be another rank in [0, " + std::to_string(s.dims.world) +
                                "), mapped once, before host_connect_rank");
  }
  s.near[peer] = MappedPages::open_shared(name, buffer_layout(s.dims).total);
}

void unlink_host_shared(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  HostRankState& s = existing(comm_id, ordinal);
  if (!s.shared_name.empty()) unlink_shared(s.shared_name);
  s.shared_name.clear();
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
    const bool near = s.near[p].data() != nullptr;
    if ((ordinals[p] < 0) != (remote || near) || (remote && near)) {
      throw std::invalid_argument(
          "jax_moe host backend: rank " + std::to_string(p) + " has ordinal " +
          std::to_string(ordinals[p]) + ", but it is " +
          (remote ? (near ? "both a remote and a near" : "a remote")
                  : (near ? "a near" : "neither a remote nor a near")) +
          " rank of " + key_text(comm_id, ordinal) +
          " (-1 marks ranks in other processes, which must be one of the two)");
    }
    s.peers.push_back(remote ? s.remote->staging(p)
                      : near ? s.near[p].data()
                             : existing(comm_id, ordinals[p]).buffer);
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
