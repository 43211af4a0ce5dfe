// Splitting one rank's row loops over a few threads (the cuda backend's host proxies run one
// rank per thread otherwise; the host backend's ranks already have one XLA thread each and
// keep threads = 1). Every index is handled by exactly one thread with the same sequential
// code, so results are bit-identical to one thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace jax_moe::host {

// Runs body(begin, end) over [0, n) in at most `threads` contiguous chunks of at least
// `min_chunk` indices; the calling thread takes the first chunk. Returns when all are done.
template <typename Body>
void parallel_for(int threads, size_t n, size_t min_chunk, const Body& body) {
  const size_t most = std::max<size_t>(1, n / std::max<size_t>(min_chunk, 1));
  const size_t parts = std::min<size_t>(std::max(threads, 1), most);
  if (parts <= 1) {
    body(size_t{0}, n);
    return;
  }
  const size_t chunk = (n + parts - 1) / parts;
  std::vector<std::thread> helpers;
  for (size_t begin = chunk; begin < n; begin += chunk)
    helpers.emplace_back([&body, begin, end = std::min(n, begin + chunk)] { body(begin, end); });
  body(size_t{0}, std::min(n, chunk));
  for (std::thread& helper : helpers) helper.join();
}

}  // namespace jax_moe::host
