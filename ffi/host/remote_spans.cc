#include "ffi/host/remote_spans.h"

#include <algorithm>

namespace jax_moe::host {
namespace {

// Calls `run(first, count)` for every maximal run of consecutive indices in [0, n) where
// `in_run(j)` holds. Sender and receiver of a signal find the same runs of what the sender
// writes (from what both know), so the receiver knows how many writes to expect.
template <typename Pred, typename Run>
void for_each_run(int n, Pred in_run, Run run) {
  int j = 0;
  while (j < n) {
    if (!in_run(j)) {
      ++j;
      continue;
    }
    int end = j + 1;
    while (end < n && in_run(end)) ++end;
    run(j, end - j);
    j = end;
  }
}

template <typename Pred>
uint64_t count_runs(int n, Pred in_run) {
  uint64_t runs = 0;
  for_each_run(n, in_run, [&](int, int) { ++runs; });
  return runs;
}

}  // namespace

std::vector<std::vector<Span>> dispatch_route_spans(const MoeDims& d, const BufferLayout& lay,
                                                    int ntok) {
  const uint64_t me = d.rank, T = d.max_tokens, K = d.topk;
  const std::vector<Span> spans = {{lay.recv_num_tokens + 4 * me, 4},
                                   {lay.recv_ids + 4 * me * T * K, 4 * uint64_t(ntok) * K},
                                   {lay.recv_weights + 4 * me * T * K, 4 * uint64_t(ntok) * K}};
  return std::vector<std::vector<Span>>(d.world, spans);
}

std::vector<std::vector<Span>> dispatch_row_spans(const HostRankState& s, const BufferLayout& lay,
                                                  const std::vector<uint64_t>& dest_masks) {
  const MoeDims& d = s.dims;
  const uint64_t tb = token_bytes(d);
  const uint64_t base = lay.recv_tokens + uint64_t(d.rank) * d.max_tokens * tb;
  std::vector<std::vector<Span>> spans(d.world);
  for (int p = 0; p < d.world; ++p) {
    if (!is_remote(s, p)) continue;
    for_each_run(int(dest_masks.size()), [&](int t) { return (dest_masks[t] >> p) & 1; },
                 [&](int first, int count) {
                   spans[p].push_back({base + first * tb, count * tb});
                 });
  }
  return spans;
}

std::vector<uint64_t> dispatch_row_writes(const HostRankState& s, const BufferLayout& lay,
                                          const std::vector<int>& ntok) {
  const MoeDims& d = s.dims;
  const int T = d.max_tokens, K = d.topk, L = d.local_experts;
  const int32_t* ids = reinterpret_cast<const int32_t*>(s.buffer + lay.recv_ids);
  std::vector<uint64_t> writes(d.world, 1);
  for (int src = 0; src < d.world; ++src) {
    if (!is_remote(s, src)) continue;
    const int32_t* route = ids + size_t(src) * T * K;
    const uint64_t runs = count_runs(ntok[src], [&](int t) {
      return std::any_of(route + t * K, route + (t + 1) * K,
                         [&](int32_t id) { return id >= d.rank * L && id < (d.rank + 1) * L; });
    });
    writes[src] = std::max<uint64_t>(runs, 1);
  }
  return writes;
}

std::vector<std::vector<Span>> combine_spans(const HostRankState& s, const BufferLayout& lay,
                                             const int32_t* slot_rows) {
  const MoeDims& d = s.dims;
  const int T = d.max_tokens, K = d.topk;
  const uint64_t H = d.hidden;
  std::vector<std::vector<Span>> spans(d.world);
  for (int src = 0; src < d.world; ++src) {
    if (!is_remote(s, src)) continue;
    const int32_t* rows = slot_rows + size_t(src) * T * K;
    auto add = [&](uint64_t base, uint64_t row_bytes) {
      return [&spans, src, base, row_bytes](int first, int count) {
        spans[src].push_back({base + first * row_bytes, count * row_bytes});
      };
    };
    if (d.reduce_expert) {
      const uint64_t row_bytes = H * partial_bytes(d);
      for_each_run(T, [&](int t) {
        return std::any_of(rows + t * K, rows + (t + 1) * K, [](int32_t r) { return r != -1; });
      }, add(lay.combine + uint64_t(d.rank) * T * row_bytes, row_bytes));
    } else {
      for_each_run(T * K, [&](int j) { return rows[j] != -1; }, add(lay.combine, H * 2));
    }
  }
  return spans;
}

std::vector<uint64_t> combine_writes(const HostRankState& s, const int32_t* send_dest) {
  const MoeDims& d = s.dims;
  const int T = d.max_tokens, K = d.topk;
  std::vector<uint64_t> writes(d.world, 1);
  for (int p = 0; p < d.world; ++p) {
    if (!is_remote(s, p)) continue;
    const uint64_t runs =
        d.reduce_expert
            ? count_runs(T, [&](int t) {
                return std::any_of(send_dest + t * K, send_dest + (t + 1) * K,
                                   [p](int32_t dest) { return dest == p; });
              })
            : count_runs(T * K, [&](int j) { return send_dest[j] == p; });
    writes[p] = std::max<uint64_t>(runs, 1);
  }
  return writes;
}

}  // namespace jax_moe::host
