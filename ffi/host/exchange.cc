#include "ffi/host/exchange.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "ffi/host/numerics.h"
#include "ffi/host/parallel.h"
#include "ffi/host/remote_spans.h"

namespace jax_moe::host {
namespace {

// Smallest piece of a row loop worth a thread of its own (parallel.h): rows are KBs each.
constexpr size_t kRowsPerThread = 64;

uint64_t* flag_at(char* buffer, size_t offset, int index) {
  return reinterpret_cast<uint64_t*>(buffer + offset) + index;
}

// Records TIMEOUT naming `peer`; from now on every wait of this rank gives up at once and
// records it again (the ranks' sequences no longer agree).
void give_up(HostRankState& s, int32_t stage, int peer) {
  s.record_error(kTimeout, stage, peer);
  s.timeout_peer = peer;
  s.timed_out = true;
}

// Stores `seq` in this rank's flag at `offset` of every rank of this process.
void publish(HostRankState& s, size_t offset, uint64_t seq) {
  for (int p = 0; p < s.dims.world; ++p) {
    if (is_remote(s, p)) continue;
    __atomic_store_n(flag_at(s.peers[p], offset, s.dims.rank), seq, __ATOMIC_RELEASE);
  }
}

// Copies spans_by_peer[p] of the staging copy of every remote rank p to its buffer, as
// `signal` of call `seq` (see remote_peers.h). Only halves whose waits succeeded post, so
// after a timeout of this rank's a half posts only if an earlier post of the same half
// failed: it still posts to the other peers, which then do not wait for this rank in vain
// (and name the peer that failed, not this rank).
void post_remote(HostRankState& s, Signal signal, uint64_t seq,
                 const std::vector<std::vector<Span>>& spans_by_peer, int32_t stage) {
  if (s.remote == nullptr) return;
  if (s.first_post_ns == 0)
    s.first_post_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int peer = -1;
  if (!s.remote->post(signal, seq, spans_by_peer, s.timeout_s, &peer)) give_up(s, stage, peer);
}

// Waits until every remote rank p sent `writes[p]` writes of (`signal`, `seq`), for at most
// `seconds`. On timeout records TIMEOUT naming the first late peer and returns false.
bool wait_remote(HostRankState& s, Signal signal, uint64_t seq,
                 const std::vector<uint64_t>& writes, double seconds, int32_t stage) {
  if (s.remote == nullptr) return true;
  int late = -1;
  if (!s.remote->wait(signal, seq, writes, seconds, &late)) {
    give_up(s, stage, late);
    return false;
  }
  return true;
}

// Waits until this rank's flag of every rank p of this process (at `offset`) reached
// `target`, and every remote rank p sent remote_writes[p] writes of (`signal`, `target`).
// On timeout records TIMEOUT naming the first late peer and returns false.
bool wait_all(HostRankState& s, size_t offset, uint64_t target, int32_t stage, Signal signal,
              const std::vector<uint64_t>& remote_writes) {
  if (s.timed_out) {
    s.record_error(kTimeout, stage, s.timeout_peer);
    return false;
  }
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(s.timeout_s));
  for (int p = 0; p < s.dims.world; ++p) {
    if (is_remote(s, p)) continue;
    const uint64_t* flag = flag_at(s.buffer, offset, p);
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < target) {
      if (Clock::now() > deadline) {
        give_up(s, stage, p);
        return false;
      }
      std::this_thread::yield();  // the peer's device thread may share this core
    }
  }
  // Sequence 0 is the state before the first call: nothing was sent for it.
  if (target == 0) return true;
  const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
  return wait_remote(s, signal, target, remote_writes, std::max(left, 1e-3), stage);
}

// Acknowledgements and other signals: one write from every remote peer.
std::vector<uint64_t> one_write_each(const MoeDims& d) { return std::vector<uint64_t>(d.world, 1); }

// fp8 codes of one bf16 row [H] followed by its f32 scales [H/bs], as a dispatch slot holds
// them (docs/semantics.md "fp8").
void quantize_row(const MoeDims& d, const uint16_t* row, char* slot) {
  float* scales = reinterpret_cast<float*>(slot + d.hidden);
  for (int b = 0; b < d.hidden / d.block_size; ++b) {
    const uint16_t* block = row + size_t(b) * d.block_size;
    float amax = 0.f;
    for (int i = 0; i < d.block_size; ++i)
      amax = max_keep_nan(amax, std::fabs(bf16_to_f32(block[i])));
    amax = max_keep_nan(amax, 1e-4f);
    const float multiplier = 448.f / amax;
    for (int i = 0; i < d.block_size; ++i) {
      slot[size_t(b) * d.block_size + i] = char(quantize_e4m3(bf16_to_f32(block[i]), multiplier));
    }
    scales[b] = amax * kInv448;
  }
}

// docs/semantics.md, CALL_ORDER: a send needs every earlier send received (sent ==
// received), a receive exactly one send pending (sent == received + 1). Records CALL_ORDER
// (detail: sends not yet received) otherwise; the call then does nothing more.
bool halves_in_order(HostRankState& s, uint64_t sent, uint64_t received, bool send,
                     int32_t stage) {
  if (sent == received + (send ? 0 : 1)) return true;
  s.record_error(kCallOrder, stage, int32_t(sent - received));
  return false;
}

// Publishes this rank's dispatch to the local ranks and posts its routes (unless posted
// already) and the rows of the tokens with a slot on each remote rank; the send is then done.
void finish_dispatch_send(HostRankState& s, const BufferLayout& lay,
                          const std::vector<uint64_t>& dest_masks, bool routes_posted) {
  const uint64_t seq = s.dispatch_seq + 1;
  publish(s, lay.dispatch_flag, seq);
  if (!routes_posted) {
    post_remote(s, Signal::kDispatch, seq,
                dispatch_route_spans(s.dims, lay, int(dest_masks.size())), kStageDispatchSend);
  }
  post_remote(s, Signal::kDispatchRows, seq, dispatch_row_spans(s, lay, dest_masks),
              kStageDispatchSend);
  s.dispatch_seq = seq;
}

// Routes first: a rank alone in its process posts them to the remote ranks before it packs or
// scans any row (they are small, and a receiver needs them to know which rows to expect).
// With other ranks in the process, the local publish (finish_dispatch_send) goes first: a
// post may block for up to the timeout on a dead peer, and the local ranks must not wait
// behind it (they would time out naming this rank). Returns whether it posted them.
bool post_routes_first(HostRankState& s, const BufferLayout& lay, int ntok) {
  int local_ranks = 0;
  for (int p = 0; p < s.dims.world; ++p) local_ranks += !is_remote(s, p);
  if (local_ranks != 1) return false;
  post_remote(s, Signal::kDispatch, s.dispatch_seq + 1, dispatch_route_spans(s.dims, lay, ntok),
              kStageDispatchSend);
  return true;
}

}  // namespace

bool dispatch_send_begin(HostRankState& s) {
  if (!halves_in_order(s, s.dispatch_seq, s.dispatch_recv_seq, true, kStageDispatchSend))
    return false;
  // Never overwrite a region its receiver has not consumed yet.
  return wait_all(s, buffer_layout(s.dims).dispatch_ack, s.dispatch_seq, kStageDispatchSend,
                  Signal::kDispatchAck, one_write_each(s.dims));
}

void dispatch_send_end(HostRankState& s, int given_tokens, bool bad_id, int32_t first_bad_id) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int T = d.max_tokens, K = d.topk;
  const int ntok = std::min(std::max(given_tokens, 0), T);
  // In the order dispatch_send records them.
  if (given_tokens != ntok) s.record_error(kBadNumTokens, kStageDispatchSend, given_tokens);
  if (bad_id) s.record_error(kInvalidExpertId, kStageDispatchSend, first_bad_id);
  const bool routes_posted = post_routes_first(s, lay, ntok);
  // The routes the kernel wrote into this rank's own buffer (invalid ids already -1).
  const RouteEntry* routes = route_entries(s.buffer, lay, d, d.rank);
  std::vector<uint64_t> dest_masks(ntok, 0);
  for (int j = 0; j < ntok * K; ++j)
    if (routes[j].id >= 0) dest_masks[j / K] |= 1ull << (routes[j].id / d.local_experts);
  finish_dispatch_send(s, lay, dest_masks, routes_posted);
}

void dispatch_send(HostRankState& s, TokenInput input, const void* x, const float* x_scales,
                   const int32_t* topk_ids, const float* topk_weights, const int32_t* num_tokens,
                   int32_t* send_dest) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int T = d.max_tokens, K = d.topk, H = d.hidden, me = d.rank;
  const int nb = scale_blocks(d);
  std::fill(send_dest, send_dest + size_t(T) * K, -1);
  if (!dispatch_send_begin(s)) return;

  const int given = *num_tokens;
  const int ntok = std::min(std::max(given, 0), T);
  if (given != ntok) s.record_error(kBadNumTokens, kStageDispatchSend, given);
  // This rank's route block in every rank's view (its buffer, or the staging copy of it).
  std::vector<RouteEntry*> route_out;
  for (char* peer : s.peers) {
    *route_tokens(peer, lay, d, me) = ntok;
    route_out.push_back(route_entries(peer, lay, d, me));
  }

  std::vector<uint64_t> dest_masks(ntok, 0);  // bit p: token t has a slot on rank p
  for (int t = 0; t < ntok; ++t) {
    for (int k = 0; k < K; ++k) {
      int id = topk_ids[t * K + k];
      if (id < -1 || id >= d.num_experts) {
        s.record_error(kInvalidExpertId, kStageDispatchSend, id);  // first in (t, k) order
        id = -1;
      }
      const int dest = id >= 0 ? id / d.local_experts : -1;
      send_dest[t * K + k] = dest;
      if (dest >= 0) dest_masks[t] |= 1ull << dest;
      // Every rank gets the route: each counts the slots of its own experts.
      const RouteEntry entry{id, topk_weights[t * K + k]};
      for (RouteEntry* routes : route_out) routes[t * K + k] = entry;
    }
  }
  const bool alone = post_routes_first(s, lay, ntok);

  std::vector<char> quantized(input == kInputBf16Quantize ? token_bytes(d) : 0);
  for (int t = 0; t < ntok; ++t) {
    const uint64_t dest_mask = dest_masks[t];
    if (dest_mask == 0) continue;
    // The token crosses to each rank holding one of its slots once.
    const char* row;
    if (input == kInputBf16Quantize) {
      quantize_row(d, static_cast<const uint16_t*>(x) + size_t(t) * H, quantized.data());
      row = quantized.data();
    } else if (input == kInputFp8) {
      // codes [H] then scales [H/bs] at byte H: assembled per destination below
      row = static_cast<const char*>(x) + size_t(t) * H;
    } else {
      row = static_cast<const char*>(x) + size_t(t) * H * 2;
    }
    for (int p = 0; p < d.world; ++p) {
      if (!((dest_mask >> p) & 1)) continue;
      char* slot = token_slot(s.peers[p], lay, d, me, t);
      if (input == kInputFp8) {
        std::memcpy(slot, row, H);
        std::memcpy(slot + H, x_scales + size_t(t) * nb, sizeof(float) * nb);
      } else {
        std::memcpy(slot, row, input == kInputBf16 ? size_t(H) * 2 : token_bytes(d));
      }
    }
  }
  finish_dispatch_send(s, lay, dest_masks, alone);
}

bool dispatch_recv_begin(HostRankState& s, RecvPlan& plan) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, L = d.local_experts, C = d.capacity;
  const int me = d.rank;
  std::fill(plan.weights, plan.weights + C, 0.f);
  std::fill(plan.group_sizes, plan.group_sizes + L, 0);
  std::fill(plan.tokens_per_expert, plan.tokens_per_expert + L, 0);
  std::fill(plan.slot_rows, plan.slot_rows + size_t(R) * T * K, -1);
  plan.token_count = 0;
  plan.zero_count = 0;
  const uint64_t seq = s.dispatch_seq;
  if (!halves_in_order(s, seq, s.dispatch_recv_seq, false, kStageDispatchRecv)) return false;
  s.dispatch_recv_seq = seq;
  if (!wait_all(s, lay.dispatch_flag, seq, kStageDispatchRecv, Signal::kDispatch,
                std::vector<uint64_t>(R, kDispatchRouteWrites))) {
    return false;
  }

  std::vector<int> ntok(R);
  // expert_counts[s][e]: rows of source s for local expert e; slot_rank: the slot's place
  // among them, in (t, k) order, so rows keep (s, t, k) order inside each segment.
  std::fill(s.expert_counts.begin(), s.expert_counts.end(), 0);
  for (int src = 0; src < R; ++src) {
    ntok[src] = std::min(std::max(*route_tokens(s.buffer, lay, d, src), 0), T);
    const RouteEntry* routes = route_entries(s.buffer, lay, d, src);
    for (int j = 0; j < ntok[src] * K; ++j) {
      const int e = routes[j].id - me * L;
      if (e >= 0 && e < L) s.slot_rank[size_t(src) * T * K + j] = s.expert_counts[src * L + e]++;
    }
  }
  // Remote sources' rows come after their routes, which say how many writes they take.
  if (!wait_remote(s, Signal::kDispatchRows, seq, dispatch_row_writes(s, lay, ntok), s.timeout_s,
                   kStageDispatchRecv)) {
    return false;
  }
  // Segment e starts at the sum of the padded sizes before it; source s's rows for e follow
  // those of the sources before s. Its padding rows (inside the capacity) are listed.
  std::vector<int> first_row(size_t(R) * L);
  int total = 0;
  for (int e = 0; e < L; ++e) {
    int tokens = 0;
    for (int src = 0; src < R; ++src) {
      first_row[src * L + e] = total + tokens;
      tokens += s.expert_counts[src * L + e];
    }
    plan.tokens_per_expert[e] = tokens;
    plan.group_sizes[e] = (tokens + d.expert_padding - 1) / d.expert_padding * d.expert_padding;
    if (plan.zero_rows != nullptr) {
      for (int row = total + tokens; row < std::min(total + plan.group_sizes[e], C); ++row)
        plan.zero_rows[plan.zero_count++] = row;
    }
    total += plan.group_sizes[e];
  }
  if (total > C) s.record_error(kCapacityOverflow, kStageDispatchRecv, total);

  for (int src = 0; src < R; ++src) {
    const RouteEntry* routes = route_entries(s.buffer, lay, d, src);
    for (int t = 0; t < ntok[src]; ++t) {
      bool placed = false;
      for (int k = 0; k < K; ++k) {
        const size_t slot = (size_t(src) * T + t) * K + k;
        const int e = routes[t * K + k].id - me * L;
        if (e < 0 || e >= L) continue;
        const int row = first_row[src * L + e] + s.slot_rank[slot];
        if (row >= C) {
          plan.slot_rows[slot] = -2;  // dropped: capacity overflow
          continue;
        }
        plan.slot_rows[slot] = row;
        plan.weights[row] = routes[t * K + k].weight;
        placed = true;
      }
      if (placed) plan.tokens[plan.token_count++] = src * T + t;
    }
  }
  return true;
}

void dispatch_recv_end(HostRankState& s) {
  publish(s, buffer_layout(s.dims).dispatch_ack, s.dispatch_seq);
  post_remote(s, Signal::kDispatchAck, s.dispatch_seq,
              std::vector<std::vector<Span>>(s.dims.world), kStageDispatchRecv);
}

void dispatch_recv(HostRankState& s, void* x, float* scales, float* weights,
                   int32_t* group_sizes, int32_t* tokens_per_expert, int32_t* slot_rows) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int T = d.max_tokens, K = d.topk, C = d.capacity, nb = scale_blocks(d);
  const size_t row_bytes = d.fp8 ? size_t(d.hidden) : size_t(d.hidden) * 2;
  // Padding rows and rows past the total are zero; so is everything after a timeout.
  parallel_for(s.threads, size_t(C), kRowsPerThread, [&](size_t begin, size_t end) {
    std::memset(static_cast<char*>(x) + begin * row_bytes, 0, (end - begin) * row_bytes);
  });
  if (d.fp8) std::fill(scales, scales + size_t(C) * nb, 0.f);
  std::vector<int32_t> tokens(size_t(d.world) * T);
  RecvPlan plan{slot_rows, weights, group_sizes, tokens_per_expert, tokens.data(), nullptr};
  if (!dispatch_recv_begin(s, plan)) return;

  // Every slot has its own row, so the tokens are placed independently.
  char* x_rows = static_cast<char*>(x);
  parallel_for(s.threads, size_t(plan.token_count), kRowsPerThread,
               [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const int token = tokens[i];
      const char* row = token_slot(s.buffer, lay, d, token / T, token % T);
      for (int k = 0; k < K; ++k) {
        const int out = slot_rows[size_t(token) * K + k];
        if (out < 0) continue;
        std::memcpy(x_rows + size_t(out) * row_bytes, row, row_bytes);
        if (d.fp8) std::memcpy(scales + size_t(out) * nb, row + d.hidden, sizeof(float) * nb);
      }
    }
  });
  dispatch_recv_end(s);
}

bool combine_send_begin(HostRankState& s) {
  if (!halves_in_order(s, s.combine_seq, s.combine_recv_seq, true, kStageCombineSend))
    return false;
  // Never overwrite a combine region its source has not consumed yet.
  return wait_all(s, buffer_layout(s.dims).combine_ack, s.combine_seq, kStageCombineSend,
                  Signal::kCombineAck, one_write_each(s.dims));
}

void combine_send_end(HostRankState& s, const int32_t* slot_rows) {
  const uint64_t seq = s.combine_seq + 1;
  const BufferLayout lay = buffer_layout(s.dims);
  publish(s, lay.combine_flag, seq);
  post_remote(s, Signal::kCombine, seq, combine_spans(s, lay, slot_rows), kStageCombineSend);
  s.combine_seq = seq;
}

void combine_send(HostRankState& s, const uint16_t* y, const int32_t* slot_rows,
                  const float* row_weights, int32_t* done) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, C = d.capacity, H = d.hidden;
  const int me = d.rank;
  *done = 0;
  if (!combine_send_begin(s)) return;
  if (!d.reduce_expert) {
    // Row of slot (src, t, k) to comb[t][k] on src; zeros for a slot dropped by overflow.
    parallel_for(s.threads, size_t(R) * T * K, kRowsPerThread, [&](size_t begin, size_t end) {
      for (size_t task = begin; task < end; ++task) {
        const int row = slot_rows[task];
        if (row == -1) continue;
        const int src = int(task / (size_t(T) * K));
        uint16_t* dst = reinterpret_cast<uint16_t*>(s.peers[src] + lay.combine) +
                        (task % (size_t(T) * K)) * H;
        if (row >= 0 && row < C) {
          std::memcpy(dst, y + size_t(row) * H, size_t(H) * 2);
        } else {
          std::fill(dst, dst + H, uint16_t{0});
        }
      }
    });
  } else {
    // One partial per (src, t) with a slot here: the f32 sum in k order of w * y[row],
    // stored in partial dtype at part[this rank][t] on src.
    const size_t pbytes = partial_bytes(d);
    parallel_for(s.threads, size_t(R) * T, kRowsPerThread, [&](size_t begin, size_t end) {
      std::vector<float> acc(H);
      for (size_t task = begin; task < end; ++task) {
        const int src = int(task / T), t = int(task % T);
        const int32_t* rows = slot_rows + task * K;
        if (std::all_of(rows, rows + K, [](int32_t r) { return r == -1; })) continue;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int k = 0; k < K; ++k) {
          const int row = rows[k];
          if (row < 0 || row >= C) continue;  // dropped rows contribute nothing
          const float w = row_weights[row];
          const uint16_t* yr = y + size_t(row) * H;
          for (int i = 0; i < H; ++i) acc[i] = acc[i] + w * bf16_to_f32(yr[i]);
        }
        char* dst = s.peers[src] + partial_block(lay, d, me) + size_t(t) * H * pbytes;
        if (d.partial_bf16) {
          uint16_t* out = reinterpret_cast<uint16_t*>(dst);
          for (int i = 0; i < H; ++i) out[i] = f32_to_bf16(acc[i]);
        } else {
          std::memcpy(dst, acc.data(), size_t(H) * 4);
        }
      }
    });
  }
  combine_send_end(s, slot_rows);
}

bool combine_recv_begin(HostRankState& s, const int32_t* send_dest) {
  const uint64_t seq = s.combine_seq;
  if (!halves_in_order(s, seq, s.combine_recv_seq, false, kStageCombineRecv)) return false;
  s.combine_recv_seq = seq;
  return wait_all(s, buffer_layout(s.dims).combine_flag, seq, kStageCombineRecv,
                  Signal::kCombine, combine_writes(s, send_dest));
}

void combine_recv_end(HostRankState& s) {
  publish(s, buffer_layout(s.dims).combine_ack, s.combine_seq);
  post_remote(s, Signal::kCombineAck, s.combine_seq, std::vector<std::vector<Span>>(s.dims.world),
              kStageCombineRecv);
}

void combine_recv(HostRankState& s, const int32_t* send_dest, const float* topk_weights,
                  uint16_t* out) {
  const MoeDims& d = s.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden;
  std::fill(out, out + size_t(T) * H, uint16_t{0});
  if (!combine_recv_begin(s, send_dest)) return;

  const char* comb = s.buffer + lay.combine;
  parallel_for(s.threads, size_t(T), kRowsPerThread, [&](size_t begin, size_t end) {
    std::vector<float> acc(H);
    for (int t = int(begin); t < int(end); ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      uint64_t ranks = 0;
      for (int k = 0; k < K; ++k) {
        const int dest = send_dest[t * K + k];
        if (dest < 0 || dest >= R) continue;
        ranks |= 1ull << dest;
        if (d.reduce_expert) continue;
        // Source mode: every valid slot's row, in k order.
        const float w = topk_weights[t * K + k];
        const uint16_t* row =
            reinterpret_cast<const uint16_t*>(comb) + (size_t(t) * K + k) * H;
        for (int i = 0; i < H; ++i) acc[i] = acc[i] + w * bf16_to_f32(row[i]);
      }
      if (d.reduce_expert) {
        // Expert mode: the partial of every rank holding one of t's slots, in rank order.
        for (int p = 0; p < R; ++p) {
          if (!((ranks >> p) & 1)) continue;
          const size_t part_row = size_t(p) * T + t;
          if (d.partial_bf16) {
            const uint16_t* part = reinterpret_cast<const uint16_t*>(comb) + part_row * H;
            for (int i = 0; i < H; ++i) acc[i] = acc[i] + bf16_to_f32(part[i]);
          } else {
            const float* part = reinterpret_cast<const float*>(comb) + part_row * H;
            for (int i = 0; i < H; ++i) acc[i] = acc[i] + part[i];
          }
        }
      }
      for (int i = 0; i < H; ++i) out[size_t(t) * H + i] = f32_to_bf16(acc[i]);
    }
  });
  combine_recv_end(s);
}

}  // namespace jax_moe::host
