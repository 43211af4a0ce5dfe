#include "ffi/transport/transfer_engine.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>

#include "ffi/thread_names.h"
#include "ffi/transport/errors.h"
#include "ffi/transport/immediate.h"

namespace jax_moe::transport {
namespace {


// The API version we ask for: 1.17 (Debian 12's libfabric), or the headers' own version when
// the build sees older headers, since fi_getinfo refuses versions newer than the library.
constexpr uint32_t kApiVersion =
    FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) < FI_VERSION(1, 17)
        ? FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)
        : FI_VERSION(1, 17);

// Device memory (FI_HMEM caps, fi_mr_attr::iface) arrived in libfabric 1.10; the engine
// registers CUDA buffers only in builds with CUDA and headers that new.
#if defined(JAX_MOE_WITH_CUDA) && \
    FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) >= FI_VERSION(1, 10)
#define JAX_MOE_FABRIC_HMEM 1
#else
#define JAX_MOE_FABRIC_HMEM 0
#endif

constexpr size_t kCqBatch = 16;
constexpr size_t kSignalBytes = 64;
// The progress thread naps this long between empty polls while it is not needed.
constexpr auto kIdleSleep = std::chrono::microseconds(50);

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

// splitmix64: a tiny deterministic generator for shuffle mode.
uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Keeps a count of threads blocked in wait/flush, so the poller spins only while needed.
class WaiterScope {
 public:
  explicit WaiterScope(std::atomic<int>& waiters) : waiters_(waiters) { ++waiters_; }
  ~WaiterScope() { --waiters_; }

 private:
  std::atomic<int>& waiters_;
};

}  // namespace

struct TransferEngine::Region {
  std::vector<fid_mr*> mrs;        // [rails]: one registration with each rail's domain
  std::vector<void*> local_descs;  // [rails] fi_mr_desc, passed with local buffers under
                                   // FI_MR_LOCAL and for device memory (else null)
  void* base = nullptr;
  uint64_t size = 0;
  RegionDescriptor remote;  // what peers need to write here
};

// The template of every write to one member: rail, address, keys and remote bases resolved
// once (the keys are those of the member's rail that receives from this engine).
struct TransferEngine::Member {
  uint32_t rank = 0;
  uint32_t rail = 0;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  uint64_t dest_addr = 0, dest_key = 0, dest_size = 0;
  uint64_t signal_addr = 0, signal_key = 0;
};

struct TransferEngine::Group {
  std::vector<Member> members;
};

// The operation context libfabric hands back in the completion; fi_context2 comes first
// because providers with FI_CONTEXT/FI_CONTEXT2 mode use that space.
struct TransferEngine::WriteContext {
  fi_context2 fabric_context;
  uint32_t peer_rank = 0;
  uint32_t immediate = 0;
};

TransferEngine::TransferEngine(const Config& config) : config_(config) {
  if (config_.rank >= kMaxRanks) {
    throw TransportError("TransferEngine: rank " + std::to_string(config_.rank) +
                         " is out of range; ranks must be < " + std::to_string(kMaxRanks));
  }
#if !JAX_MOE_FABRIC_HMEM
  if (config_.cuda_memory) {
    throw TransportError("TransferEngine: cuda_memory needs a build with CUDA and libfabric >= "
                         "1.10 headers");
  }
#endif
  if (!(config_.timeout_s > 0)) {
    throw TransportError("TransferEngine: timeout_s must be > 0, got " +
                         std::to_string(config_.timeout_s));
  }
  if (config_.domains.size() > kMaxRails) {
    throw TransportError("TransferEngine: " + std::to_string(config_.domains.size()) +
                         " domains given; an engine has at most " + std::to_string(kMaxRails) +
                         " rails");
  }
  shuffle_state_ = config_.shuffle_seed;
  std::random_device entropy;
  engine_id_ = (static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^
               static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  const std::vector<std::string> domains =
      config_.domains.empty() ? std::vector<std::string>{""} : config_.domains;
  rails_.resize(domains.size());
  rail_writes_.assign(domains.size(), 0);
  try {
    for (size_t r = 0; r < domains.size(); ++r) open_rail(r, domains[r]);
    signal_buffer_.assign(kSignalBytes, 0);
    signal_region_ = register_memory(signal_buffer_.data(), signal_buffer_.size());
  } catch (...) {
    close();
    throw;
  }
  progress_thread_ = std::thread([this] { progress_loop(); });
  name_thread(progress_thread_, kTransferEngineThreadName);
}

TransferEngine::~TransferEngine() {
  try {
    close();
  } catch (const TransportError&) {
    // A destructor cannot report; close() already released everything it could.
  }
}

void TransferEngine::open_rail(size_t index, const std::string& domain_name) {
  Rail& rail = rails_[index];
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) throw TransportError("fi_allocinfo: out of memory");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  // We give every operation a fi_context2, so providers that need that space may use it.
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // The registration rules we know how to follow; the provider answers with those it needs.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                FI_MR_PROV_KEY | FI_MR_ENDPOINT;
#if JAX_MOE_FABRIC_HMEM
  if (config_.cuda_memory) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
#endif
  hints->domain_attr->threading = FI_THREAD_SAFE;
  hints->domain_attr->cq_data_size = sizeof(uint32_t);
  if (!config_.provider.empty()) hints->fabric_attr->prov_name = strdup(config_.provider.c_str());
  if (!domain_name.empty()) hints->domain_attr->name = strdup(domain_name.c_str());

  const char* node = config_.node.empty() ? nullptr : config_.node.c_str();
  fi_info* found = nullptr;
  const int ret = fi_getinfo(kApiVersion, node, nullptr, node ? FI_SOURCE : 0, hints, &found);
  fi_freeinfo(hints);
  const std::string provider_text =
      (config_.provider.empty() ? "any provider" : config_.provider) +
      (node ? std::string(" on ") + node : std::string());
  if (ret != 0 || found == nullptr) {
    throw TransportError("fi_getinfo found no RDM endpoint with RMA writes and remote CQ data "
                         "for " + provider_text + ": " + fi_strerror(-ret) +
                         " (check `fi_info -p <provider>`)");
  }
  // Some providers (shm, tcp in 1.17) ignore the domain hint: pick the entry by name here.
  std::string offered;
  for (fi_info* entry = found; entry != nullptr && rail.info == nullptr; entry = entry->next) {
    const char* name = entry->domain_attr->name ? entry->domain_attr->name : "";
    if (domain_name.empty() || domain_name == name) rail.info = fi_dupinfo(entry);
    const std::string quoted = "'" + std::string(name) + "'";
    if (offered.find(quoted) == std::string::npos) {
      offered += (offered.empty() ? "" : ", ") + quoted;
    }
  }
  fi_freeinfo(found);
  if (rail.info == nullptr) {
    throw TransportError("TransferEngine: no domain '" + domain_name + "' (domains[" +
                         std::to_string(index) + "]) for " + provider_text + "; it offers " +
                         offered + " (check `fi_info -p <provider>`)");
  }
  const fi_info* info = rail.info;
  const std::string provider = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
  const std::string domain = info->domain_attr->name ? info->domain_attr->name : "";
  if (info->domain_attr->cq_data_size < sizeof(uint32_t)) {
    throw TransportError("provider " + provider + " carries only " +
                         std::to_string(info->domain_attr->cq_data_size) +
                         " bytes of remote CQ data; the TransferEngine needs 4");
  }
#if JAX_MOE_FABRIC_HMEM
  const bool cuda_memory = (info->caps & FI_HMEM) != 0;
#else
  const bool cuda_memory = false;
#endif
  if (index == 0) {
    facts_.provider = provider;
    facts_.fabric = info->fabric_attr->name ? info->fabric_attr->name : "";
    facts_.mr_mode = info->domain_attr->mr_mode;
    facts_.max_msg_size = info->ep_attr->max_msg_size;
    facts_.inject_size = info->tx_attr->inject_size;
    facts_.cuda_memory = cuda_memory;
  } else if (provider != facts_.provider || info->domain_attr->mr_mode != facts_.mr_mode) {
    // Regions, descriptors and peers follow one provider's rules on every rail.
    throw TransportError("domains[" + std::to_string(index) + "] ('" + domain + "') opened with "
                         "provider " + provider + ", but rail 0 uses " + facts_.provider +
                         " with other registration rules; give domains of one provider");
  } else {
    facts_.max_msg_size = std::min<uint64_t>(facts_.max_msg_size, info->ep_attr->max_msg_size);
    facts_.inject_size = std::min<uint64_t>(facts_.inject_size, info->tx_attr->inject_size);
    facts_.cuda_memory = facts_.cuda_memory && cuda_memory;
  }
  facts_.domains.push_back(domain);

  check_fabric(fi_fabric(info->fabric_attr, &rail.fabric, nullptr), "fi_fabric");
  check_fabric(fi_domain(rail.fabric, rail.info, &rail.domain, nullptr), "fi_domain");

  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;  // remote completions carry the immediate
  cq_attr.wait_obj = FI_WAIT_NONE;     // the progress thread polls
  check_fabric(fi_cq_open(rail.domain, &cq_attr, &rail.cq, nullptr), "fi_cq_open");

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  check_fabric(fi_av_open(rail.domain, &av_attr, &rail.av, nullptr), "fi_av_open");

  check_fabric(fi_endpoint(rail.domain, rail.info, &rail.ep, nullptr), "fi_endpoint");
  check_fabric(fi_ep_bind(rail.ep, &rail.cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  check_fabric(fi_ep_bind(rail.ep, &rail.av->fid, 0), "fi_ep_bind(av)");
  check_fabric(fi_enable(rail.ep), "fi_enable");

  size_t length = 0;
  const int probe = fi_getname(&rail.ep->fid, nullptr, &length);
  if (probe != -FI_ETOOSMALL && probe != 0) check_fabric(probe, "fi_getname");
  rail.endpoint_name.assign(length, '\0');
  check_fabric(fi_getname(&rail.ep->fid, rail.endpoint_name.data(), &length), "fi_getname");
  rail.endpoint_name.resize(length);
}

std::string TransferEngine::address() const {
  AddressCard card;
  card.rank = config_.rank;
  card.engine_id = engine_id_;
  card.provider = facts_.provider;
  for (const Rail& rail : rails_) card.endpoint_names.push_back(rail.endpoint_name);
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    card.signal = region_at(signal_region_).remote;
  }
  return encode_card(card);
}

void TransferEngine::add_peer(const std::string& card_bytes) {
  require_open("add_peer");
  const AddressCard card = decode_card(card_bytes, "add_peer: the peer address");
  if (card.provider != facts_.provider) {
    throw TransportError("add_peer: rank " + std::to_string(card.rank) +
                         "'s address was made by provider '" + card.provider +
                         "' but this engine (rank " + std::to_string(config_.rank) + ") uses '" +
                         facts_.provider + "'");
  }
  if (card.rank >= kMaxRanks) {
    throw TransportError("add_peer: rank " + std::to_string(card.rank) + " is out of range");
  }
  // The pairing of rails (header): the same sum picks this engine's rail and the peer's.
  Peer peer;
  peer.rail = uint32_t((config_.rank + card.rank) % rails_.size());
  peer.remote_rail = uint32_t((config_.rank + card.rank) % card.endpoint_names.size());
  peer.engine_id = card.engine_id;
  peer.signal = card.signal;
  const std::string& name = card.endpoint_names[peer.remote_rail];
  const int inserted = fi_av_insert(rails_[peer.rail].av, name.data(), 1, &peer.addr, 0, nullptr);
  if (inserted != 1) {
    throw TransportError("add_peer: the address vector of rail " + std::to_string(peer.rail) +
                         " rejected rank " + std::to_string(card.rank) + "'s endpoint name of " +
                         "its rail " + std::to_string(peer.remote_rail) + " (" +
                         (inserted < 0 ? fi_strerror(-inserted) : "0 addresses inserted") + ")");
  }
  std::lock_guard<std::mutex> lock(state_mutex_);
  peers_[card.rank] = peer;
}

int TransferEngine::register_memory(void* ptr, uint64_t size, int cuda_device) {
  require_open("register_memory");
  if (ptr == nullptr || size == 0) {
    throw TransportError("register_memory: need a non-empty buffer, got " +
                         std::to_string(size) + " bytes");
  }
  iovec iov{ptr, size};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_WRITE | FI_REMOTE_WRITE;
  if (cuda_device >= 0) {
#if JAX_MOE_FABRIC_HMEM
    if (!facts_.cuda_memory) {
      throw TransportError("register_memory: provider " + facts_.provider +
                           " did not grant FI_HMEM (create the engine with cuda_memory=True "
                           "on a provider that registers CUDA memory, e.g. efa or verbs)");
    }
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = cuda_device;
#else
    throw TransportError("register_memory: this build cannot register device memory (needs CUDA "
                         "and libfabric >= 1.10 headers)");
#endif
  }
  auto region = std::make_unique<Region>();
  region->base = ptr;
  region->size = size;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    attr.requested_key = next_key_++;  // ignored under FI_MR_PROV_KEY; unique per domain
  }
  try {
    for (const Rail& rail : rails_) {
      fid_mr* mr = nullptr;
      const int ret = fi_mr_regattr(rail.domain, &attr, 0, &mr);
      if (ret == -FI_ENOSYS && cuda_device >= 0) {
        // The provider granted FI_HMEM, yet this libfabric has no CUDA interface: it was
        // built without CUDA (distribution packages are; seen with Debian's 1.17 and shm).
        throw TransportError("register_memory: this libfabric cannot register CUDA memory "
                             "with provider " + facts_.provider + " (fi_mr_regattr: " +
                             fi_strerror(FI_ENOSYS) + "; it was built without CUDA support): "
                             "use a libfabric built with CUDA, or host memory "
                             "(JAX_MOE_PROXY_HMEM=off for the cuda proxies)");
      }
      check_fabric(ret, "fi_mr_regattr");
      region->mrs.push_back(mr);
      if (facts_.mr_mode & FI_MR_ENDPOINT) {
        check_fabric(fi_mr_bind(mr, &rail.ep->fid, 0), "fi_mr_bind");
        check_fabric(fi_mr_enable(mr), "fi_mr_enable");
      }
      // FI_MR_HMEM: a device buffer's descriptor must go with every transfer from it, else the
      // provider takes it for host memory (shm memcpy'd from the device pointer and crashed).
      const bool pass_desc = (facts_.mr_mode & FI_MR_LOCAL) || cuda_device >= 0;
      region->local_descs.push_back(pass_desc ? fi_mr_desc(mr) : nullptr);
      region->remote.keys.push_back(fi_mr_key(mr));
    }
  } catch (...) {
    for (fid_mr* mr : region->mrs) fi_close(&mr->fid);
    throw;
  }
  region->remote.addr =
      (facts_.mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
  region->remote.size = size;
  region->remote.owner_rank = config_.rank;
  region->remote.engine_id = engine_id_;
  std::lock_guard<std::mutex> lock(state_mutex_);
  const int id = next_region_++;
  regions_[id] = std::move(region);
  return id;
}

std::string TransferEngine::region_descriptor(int region) const {
  require_open("region_descriptor");
  std::lock_guard<std::mutex> lock(state_mutex_);
  return encode_region(region_at(region).remote);
}

void TransferEngine::deregister_memory(int region) {
  require_open("deregister_memory");
  std::unique_ptr<Region> taken;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    auto it = regions_.find(region);
    if (it == regions_.end() || region == signal_region_) {
      throw TransportError("deregister_memory: no registered region " + std::to_string(region));
    }
    taken = std::move(it->second);
    regions_.erase(it);
  }
  for (fid_mr* mr : taken->mrs) check_fabric(fi_close(&mr->fid), "fi_close(mr)");
}

const TransferEngine::Region& TransferEngine::region_at(int region) const {
  auto it = regions_.find(region);
  if (it == regions_.end()) {
    throw TransportError("no registered region " + std::to_string(region) +
                         " (deregistered, or from another engine)");
  }
  return *it->second;
}

const TransferEngine::Group& TransferEngine::group_at(int group) const {
  if (group < 0 || static_cast<size_t>(group) >= groups_.size()) {
    throw TransportError("no peer group " + std::to_string(group) + "; this engine has " +
                         std::to_string(groups_.size()));
  }
  return *groups_[group];
}

int TransferEngine::create_group(const std::vector<std::pair<uint32_t, std::string>>& members) {
  require_open("create_group");
  if (members.empty()) throw TransportError("create_group: a group needs at least one member");
  auto group = std::make_unique<Group>();
  std::lock_guard<std::mutex> lock(state_mutex_);
  for (size_t i = 0; i < members.size(); ++i) {
    const uint32_t rank = members[i].first;
    auto peer = peers_.find(rank);
    if (peer == peers_.end()) {
      throw TransportError("create_group: member " + std::to_string(i) + " is rank " +
                           std::to_string(rank) + ", which was never added with add_peer");
    }
    const Peer& p = peer->second;
    const std::string what = "create_group: the descriptor of member " + std::to_string(i) +
                             " (rank " + std::to_string(rank) + ")";
    const RegionDescriptor dest = decode_region(members[i].second, what.c_str());
    if (dest.owner_rank != rank) {
      throw TransportError(what + " belongs to rank " + std::to_string(dest.owner_rank));
    }
    if (dest.engine_id != p.engine_id || dest.keys.size() != p.signal.keys.size()) {
      throw TransportError(what + " is stale: it comes from another engine of that rank than "
                           "the address given to add_peer (restarted or closed peer?)");
    }
    Member member;
    member.rank = rank;
    member.rail = p.rail;
    member.addr = p.addr;
    member.dest_addr = dest.addr;
    member.dest_key = dest.keys[p.remote_rail];
    member.dest_size = dest.size;
    member.signal_addr = p.signal.addr;
    member.signal_key = p.signal.keys[p.remote_rail];
    group->members.push_back(member);
  }
  groups_.push_back(std::move(group));
  return static_cast<int>(groups_.size()) - 1;
}

size_t TransferEngine::group_size(int group) const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return group_at(group).members.size();
}

void TransferEngine::post_write(const Member& member, void* local, uint64_t length,
                                void* local_desc, uint64_t remote_addr, uint64_t key,
                                uint32_t immediate, Clock::time_point deadline,
                                double limit_s) {
  WriteContext* context;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    if (free_contexts_.empty()) {
      context_pool_.push_back(std::make_unique<WriteContext>());
      free_contexts_.push_back(context_pool_.back().get());
    }
    context = free_contexts_.back();
    free_contexts_.pop_back();
    ++posted_;
    ++rail_writes_[member.rail];
  }
  context->peer_rank = member.rank;
  context->immediate = immediate;

  iovec iov{local, length};
  void* desc = local_desc;
  fi_rma_iov rma{remote_addr, length, key};
  fi_msg_rma msg{};
  msg.msg_iov = length ? &iov : nullptr;
  msg.desc = length ? &desc : nullptr;
  msg.iov_count = length ? 1 : 0;
  msg.addr = member.addr;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = context;
  msg.data = immediate;

  ssize_t ret;
  // FI_EAGAIN: the transmit queue is full until completions are reaped (and, for software
  // providers such as rxm, until someone drives progress): poll the queue and retry, up to
  // the caller's deadline.
  fid_ep* ep = rails_[member.rail].ep;
  while ((ret = fi_writemsg(ep, &msg, FI_REMOTE_CQ_DATA | FI_COMPLETION)) == -FI_EAGAIN &&
         Clock::now() < deadline) {
    if (poll_once() == 0) std::this_thread::yield();
  }
  if (ret != 0) {
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      --posted_;
      --rail_writes_[member.rail];
      free_contexts_.push_back(context);
    }
    const std::string what = "rank " + std::to_string(config_.rank) + ": write to rank " +
                             std::to_string(member.rank) + " (tag " +
                             std::to_string(immediate_tag(immediate)) +
                             ") could not be posted: ";
    if (ret == -FI_EAGAIN) {
      throw TransportBusy(what + "the transmit queue stayed full for " + seconds_text(limit_s) +
                          " (is the peer alive, and is its address right?)");
    }
    throw TransportError(what + fi_strerror(static_cast<int>(-ret)));
  }
}

void TransferEngine::scatter(int group_id, int source, const std::vector<Slice>& slices,
                             uint32_t tag, double timeout_s) {
  check_can_post("scatter", tag);
  const double limit = bound(timeout_s);
  const auto deadline = deadline_after(limit);
  const Group* group;
  const Region* region;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    group = &group_at(group_id);
    region = &region_at(source);
  }
  const size_t n = group->members.size();
  if (slices.size() != n) {
    throw TransportError("scatter: " + std::to_string(slices.size()) + " slices for a group of " +
                         std::to_string(n) + " members; give one slice per member");
  }
  for (size_t i = 0; i < n; ++i) {
    const Slice& s = slices[i];
    const Member& m = group->members[i];
    if (s.src_offset > region->size || s.length > region->size - s.src_offset) {
      throw TransportError("scatter: slice " + std::to_string(i) + " reads [" +
                           std::to_string(s.src_offset) + ", +" + std::to_string(s.length) +
                           ") past the source region's " + std::to_string(region->size) + " bytes");
    }
    if (s.length && (s.dst_offset > m.dest_size || s.length > m.dest_size - s.dst_offset)) {
      throw TransportError("scatter: slice " + std::to_string(i) + " writes [" +
                           std::to_string(s.dst_offset) + ", +" + std::to_string(s.length) +
                           ") past rank " + std::to_string(m.rank) + "'s destination region of " +
                           std::to_string(m.dest_size) + " bytes");
    }
    if (s.length > facts_.max_msg_size) {
      throw TransportError("scatter: slice " + std::to_string(i) + " has " +
                           std::to_string(s.length) + " bytes; provider " + facts_.provider +
                           " allows " + std::to_string(facts_.max_msg_size) + " per write");
    }
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (config_.shuffle_seed) {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next_random(shuffle_state_) % i]);
  }
  const uint32_t immediate = make_immediate(tag, config_.rank);
  for (size_t i : order) {
    const Slice& s = slices[i];
    const Member& m = group->members[i];
    if (s.length == 0) {
      // An empty slice still announces itself: a zero-length write to the signal region.
      post_write(m, nullptr, 0, nullptr, m.signal_addr, m.signal_key, immediate, deadline,
                 limit);
    } else {
      post_write(m, static_cast<char*>(region->base) + s.src_offset, s.length,
                 region->local_descs[m.rail], m.dest_addr + s.dst_offset, m.dest_key, immediate,
                 deadline, limit);
    }
  }
}

void TransferEngine::barrier(int group_id, uint32_t tag, double timeout_s) {
  check_can_post("barrier", tag);
  const Group* group;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    group = &group_at(group_id);
  }
  const uint32_t immediate = make_immediate(tag, config_.rank);
  const double limit = bound(timeout_s);
  const auto deadline = deadline_after(limit);
  std::vector<std::pair<uint32_t, uint64_t>> counts;
  for (const Member& m : group->members) {
    post_write(m, nullptr, 0, nullptr, m.signal_addr, m.signal_key, immediate, deadline, limit);
    counts.emplace_back(m.rank, 1);
  }
  wait(tag, counts, seconds_left(deadline), "barrier");
}

// Waiters poll the completion queue themselves (concurrently with the progress thread, as
// FI_THREAD_SAFE allows) instead of sleeping until the progress thread wakes them: a wake-up
// costs a context switch per message, about 10 us on a busy host.
void TransferEngine::wait(uint32_t tag, const std::vector<std::pair<uint32_t, uint64_t>>& counts,
                          double timeout_s, const std::string& what) {
  require_open(what.c_str());
  WaiterScope scope(waiters_);
  const double limit = bound(timeout_s);
  const auto deadline = deadline_after(limit);
  auto received = [&](uint32_t source) {  // requires progress_mutex_
    auto it = arrived_.find(make_immediate(tag, source));
    return it == arrived_.end() ? uint64_t{0} : it->second;
  };
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      const bool satisfied = std::all_of(counts.begin(), counts.end(), [&](const auto& c) {
        return received(c.first) >= c.second;
      });
      if (satisfied) {
        for (const auto& [source, count] : counts) {
          const uint32_t key = make_immediate(tag, source);
          if ((arrived_[key] -= count) == 0) arrived_.erase(key);
        }
        return;
      }
      if (!failure_.empty()) {
        throw TransportError("rank " + std::to_string(config_.rank) + ", " + what + ": " +
                             failure_);
      }
      if (Clock::now() >= deadline) {
        std::string missing;
        for (const auto& [source, count] : counts) {
          if (received(source) >= count) continue;
          missing += (missing.empty() ? "" : ", ") + std::string("rank ") +
                     std::to_string(source) + " sent " + std::to_string(received(source)) +
                     " of " + std::to_string(count);
        }
        throw TransportTimeout("rank " + std::to_string(config_.rank) + ", " + what +
                               ": timed out after " + seconds_text(limit) +
                               " waiting for tag " + std::to_string(tag) + ": " + missing);
      }
    }
    if (poll_once() == 0) std::this_thread::yield();
  }
}

void TransferEngine::flush(double timeout_s) {
  require_open("flush");
  WaiterScope scope(waiters_);
  const double limit = bound(timeout_s);
  const auto deadline = deadline_after(limit);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      if (!failure_.empty()) {
        throw TransportError("rank " + std::to_string(config_.rank) + ", flush: " + failure_);
      }
      if (completed_ == posted_) return;
      if (Clock::now() >= deadline) {
        throw TransportError("rank " + std::to_string(config_.rank) + ", flush: " +
                             std::to_string(posted_ - completed_) +
                             " writes still incomplete after " + seconds_text(limit));
      }
    }
    if (poll_once() == 0) std::this_thread::yield();
  }
}

uint64_t TransferEngine::arrived(uint32_t tag, uint32_t source) {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  auto it = arrived_.find(make_immediate(tag, source));
  return it == arrived_.end() ? 0 : it->second;
}

void TransferEngine::check_can_post(const char* what, uint32_t tag) {
  require_open(what);
  throw_if_failed();
  if (tag > kMaxTag) {
    throw TransportError(std::string(what) + ": tag " + std::to_string(tag) + " exceeds " +
                         std::to_string(kMaxTag));
  }
}

void TransferEngine::require_open(const char* what) const {
  if (closed_) {
    throw TransportError(std::string(what) + ": the TransferEngine of rank " +
                         std::to_string(config_.rank) + " is closed");
  }
}

size_t TransferEngine::open_regions() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return regions_.size();
}

std::vector<uint64_t> TransferEngine::rail_writes() {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  return rail_writes_;
}

void TransferEngine::throw_if_failed() {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  if (!failure_.empty()) {
    throw TransportError("rank " + std::to_string(config_.rank) + ": " + failure_);
  }
}

int TransferEngine::failed_peer() {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  return failed_peer_;
}

void TransferEngine::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  if (failure_.empty()) failure_ = message;
}

void TransferEngine::progress_loop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    if (poll_once() > 0) continue;
    bool in_flight;
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      in_flight = posted_ != completed_;
      // Shuffle mode: an empty poll releases one held completion, picked at random.
      if (!held_.empty()) release_held(false);
    }
    // Writes in flight and nobody else polling: poll again, yielding first so the peer
    // process gets the core on an oversubscribed host. Otherwise nap: waiters poll the queue
    // themselves, and two threads spinning on one core would only take turns.
    if (in_flight && waiters_.load(std::memory_order_relaxed) == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kIdleSleep);
    }
  }
}

// One read of every rail's completion queue; returns the entries read.
size_t TransferEngine::poll_once() {
  size_t total = 0;
  for (const Rail& rail : rails_) {
    fi_cq_data_entry entries[kCqBatch];
    const ssize_t ret = fi_cq_read(rail.cq, entries, kCqBatch);
    if (ret == -FI_EAGAIN) continue;
    if (ret == -FI_EAVAIL) {
      read_error_entry(rail.cq);
      ++total;
      continue;
    }
    if (ret < 0) {
      fail(std::string("fi_cq_read: ") + fi_strerror(static_cast<int>(-ret)));
      continue;
    }
    std::lock_guard<std::mutex> lock(progress_mutex_);
    for (ssize_t i = 0; i < ret; ++i) {
      Completion c{entries[i].flags, entries[i].data, entries[i].op_context};
      if (config_.shuffle_seed) {
        held_.push_back(c);
      } else {
        apply(c);
      }
    }
    // Shuffle mode: hold up to a random 1..8 completions, then apply them in random order.
    if (config_.shuffle_seed && held_.size() >= 1 + next_random(shuffle_state_) % 8) {
      release_held(true);
    }
    total += static_cast<size_t>(ret);
  }
  return total;
}

// Requires progress_mutex_.
void TransferEngine::release_held(bool all) {
  do {
    const size_t pick = next_random(shuffle_state_) % held_.size();
    std::swap(held_[pick], held_.back());
    apply(held_.back());
    held_.pop_back();
  } while (all && !held_.empty());
}

// Requires progress_mutex_.
void TransferEngine::apply(const Completion& c) {
  if (c.flags & FI_REMOTE_CQ_DATA) {
    ++arrived_[static_cast<uint32_t>(c.data)];
  } else if (c.context != nullptr) {
    // A local write completion: the source of that write may be reused.
    ++completed_;
    free_contexts_.push_back(static_cast<WriteContext*>(c.context));
  }
}

void TransferEngine::read_error_entry(fid_cq* cq) {
  fi_cq_err_entry err{};
  const ssize_t ret = fi_cq_readerr(cq, &err, 0);
  if (ret < 0) {
    if (ret != -FI_EAGAIN) {
      fail(std::string("fi_cq_readerr: ") + fi_strerror(static_cast<int>(-ret)));
    }
    return;
  }
  char provider_text[256] = {0};
  const char* detail =
      fi_cq_strerror(cq, err.prov_errno, err.err_data, provider_text, sizeof(provider_text));
  std::string message = std::string(fi_strerror(err.err)) + " (provider: " +
                        (detail ? detail : "no detail") + ")";
  std::lock_guard<std::mutex> lock(progress_mutex_);
  if (err.op_context != nullptr) {
    auto* context = static_cast<WriteContext*>(err.op_context);
    message = "write to rank " + std::to_string(context->peer_rank) + " (tag " +
              std::to_string(immediate_tag(context->immediate)) + ") failed: " + message;
    if (failure_.empty()) failed_peer_ = int(context->peer_rank);
    ++completed_;
    free_contexts_.push_back(context);
  } else {
    message = "a remote write to this rank failed: " + message;
  }
  if (failure_.empty()) failure_ = message;
}

void TransferEngine::close() {
  if (closed_) return;
  closed_ = true;
  stop_ = true;
  if (progress_thread_.joinable()) progress_thread_.join();

  // The order fabtests uses: endpoint, queues, regions, address vector, domain, fabric.
  std::string first_error;
  auto close_fid = [&](fid* f, const char* what) {
    if (f == nullptr) return;
    const int ret = fi_close(f);
    if (ret != 0 && first_error.empty()) {
      first_error = std::string("fi_close(") + what + "): " + fi_strerror(-ret);
    }
  };
  for (Rail& rail : rails_) {
    close_fid(rail.ep ? &rail.ep->fid : nullptr, "endpoint");
    close_fid(rail.cq ? &rail.cq->fid : nullptr, "completion queue");
  }
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    for (auto& [id, region] : regions_) {
      for (fid_mr* mr : region->mrs) close_fid(&mr->fid, "memory region");
    }
    regions_.clear();
    groups_.clear();
    peers_.clear();
  }
  for (Rail& rail : rails_) {
    close_fid(rail.av ? &rail.av->fid : nullptr, "address vector");
    close_fid(rail.domain ? &rail.domain->fid : nullptr, "domain");
    close_fid(rail.fabric ? &rail.fabric->fid : nullptr, "fabric");
    if (rail.info != nullptr) fi_freeinfo(rail.info);
    rail = Rail{};
  }
  if (!first_error.empty()) throw TransportError(first_error);
}

}  // namespace jax_moe::transport
