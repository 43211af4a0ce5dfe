// What a host rank's staging copy of a remote rank holds (ffi/host/remote_peers.h): the bytes
// this rank writes into that rank's buffer (sender_ranges, ffi/protocol/host_layout.h), in
// whole pages. The rest of the copy is address space only, so a copy costs about 1/R of a
// buffer in expert mode instead of a whole one; the engine and the cuda host proxies register
// just these extents.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "ffi/host/page_memory.h"
#include "ffi/protocol/host_layout.h"

namespace jax_moe::host {

// The page extents (buffer offsets, ascending, merged where they touch) covering
// sender_ranges(d, d.rank), for pages of `page` bytes; only its route block when the rows and
// combine terms leave from a device staging copy instead (`rows_on_device`,
// device_staging_ranges).
inline std::vector<ByteRange> staging_extents(const MoeDims& d, size_t page,
                                              bool rows_on_device = false) {
  const std::array<ByteRange, 3> ranges = sender_ranges(d, d.rank);
  std::vector<ByteRange> out;
  for (size_t i = 0; i < (rows_on_device ? 1 : ranges.size()); ++i) {
    const ByteRange& r = ranges[i];
    const size_t begin = r.offset / page * page;
    const size_t end = (r.offset + r.length + page - 1) / page * page;
    if (!out.empty() && begin <= out.back().offset + out.back().length) {
      out.back().length = end - out.back().offset;
    } else {
      out.push_back({begin, end - begin});
    }
  }
  return out;
}

// What a cuda proxy rank's device staging copy of a remote rank holds
// (ffi/cuda/device_staging.h): the rows part of sender_ranges(d, d.rank), its token rows and
// its combine terms (the routes stay in the host copy, where the CPU phases write them), each
// range one device allocation.
inline std::array<ByteRange, 2> device_staging_ranges(const MoeDims& d) {
  const std::array<ByteRange, 3> r = sender_ranges(d, d.rank);
  return {r[1], r[2]};
}

// Bytes one staging copy commits: the sum of its extents.
inline size_t staging_bytes(const MoeDims& d, size_t page, bool rows_on_device = false) {
  size_t total = 0;
  for (const ByteRange& e : staging_extents(d, page, rows_on_device)) total += e.length;
  return total;
}

}  // namespace jax_moe::host
