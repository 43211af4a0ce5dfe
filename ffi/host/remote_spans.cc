#include "ffi/host/remote_spans.h"

#include <algorithm>

namespace jax_moe::host {
namespace {

// Calls `run(first, count)` for every maximal run of indices in [0, n) where `in_run(j)`
// holds, runs separated by at most `gap` indices where it does not being one (those indices
// inside). Sender and receiver of a signal find the same runs of what the sender writes
// (from what both know), so the receiver knows how many writes to expect.
template <typename Pred, typename Run>
void for_each_run(int n, int gap, Pred in_run, Run run) {
  int j = 0;
  while (j < n && !in_run(j)) ++j;
  while (j < n) {
    int end = j + 1;  // [j, end) holds the run so far, end - 1 in it
    for (int next = end; next < n && next - end <= gap; ++next) {
      if (in_run(next)) end = next + 1;
    }
    run(j, end - j);
    j = end;
    while (j < n && !in_run(j)) ++j;
  }
}

template <typename Pred>
uint64_t count_runs(int n, int gap, Pred in_run) {
  uint64_t runs = 0;
  for_each_run(n, gap, in_run, [&](int, int) { ++runs; });
  return runs;
}

// Rows of `row_bytes` a merged run may carry between two runs.
int merge_gap(const MoeDims& d, uint64_t row_bytes) {
  return int(merge_gap_bytes(d) / row_bytes);
}

}  // namespace

std::vector<std::vector<Span>> dispatch_route_spans(const MoeDims& d, const BufferLayout& lay,
                                                    int ntok) {
  const std::vector<Span> spans = {
      {route_block(lay, d, d.rank), kRouteHeaderBytes + sizeof(RouteEntry) * ntok * d.topk}};
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
    for_each_run(int(dest_masks.size()), merge_gap(d, tb),
                 [&](int t) { return (dest_masks[t] >> p) & 1; }, [&](int first, int count) {
                   spans[p].push_back({base + first * tb, count * tb});
                 });
  }
  return spans;
}

std::vector<uint64_t> dispatch_row_writes(const HostRankState& s, const BufferLayout& lay,
                                          const std::vector<int>& ntok) {
  const MoeDims& d = s.dims;
  const int K = d.topk, L = d.local_experts;
  std::vector<uint64_t> writes(d.world, 1);
  for (int src = 0; src < d.world; ++src) {
    if (!is_remote(s, src)) continue;
    const RouteEntry* route = route_entries(s.buffer, lay, d, src);
    const uint64_t runs = count_runs(ntok[src], merge_gap(d, token_bytes(d)), [&](int t) {
      return std::any_of(route + t * K, route + (t + 1) * K, [&](const RouteEntry& r) {
        return r.id >= d.rank * L && r.id < (d.rank + 1) * L;
      });
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
      for_each_run(T, merge_gap(d, row_bytes), [&](int t) {
        return std::any_of(rows + t * K, rows + (t + 1) * K, [](int32_t r) { return r != -1; });
      }, add(partial_block(lay, d, d.rank), row_bytes));
    } else {
      for_each_run(T * K, 0, [&](int j) { return rows[j] != -1; }, add(lay.combine, H * 2));
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
            ? count_runs(T, merge_gap(d, uint64_t(d.hidden) * partial_bytes(d)), [&](int t) {
                return std::any_of(send_dest + t * K, send_dest + (t + 1) * K,
                                   [p](int32_t dest) { return dest == p; });
              })
            : count_runs(T * K, 0, [&](int j) { return send_dest[j] == p; });
    writes[p] = std::max<uint64_t>(runs, 1);
  }
  return writes;
}

}  // namespace jax_moe::host
