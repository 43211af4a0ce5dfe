// What peers exchange before they talk: an engine's address card and memory-region
// descriptors, as byte strings (files, sockets or the JAX key-value store carry them).
// All integers little-endian; each blob starts with a 4-byte magic so a mix-up (a descriptor
// passed as an address, a truncated string) is caught with a clear message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_moe::transport {

// An engine has one endpoint per rail (a NIC, transfer_engine.h), and a region is registered
// with every rail's domain: a write arriving on rail r uses `keys[r]`.
constexpr size_t kMaxRails = 16;

// How a peer addresses one registered region: a remote write goes to `addr + offset` with the
// key of the rail it arrives on. `addr` is the region's virtual address when the provider's
// mr_mode has FI_MR_VIRT_ADDR, else 0 (offsets are then relative to the region's start).
// Providers drop writes with a wrong key silently (shm and tcp;ofi_rxm in 1.17 report no
// error on either side), so a descriptor names its owner (rank and engine incarnation) and
// carries a checksum: create_group rejects corrupted, misattributed or stale descriptors.
struct RegionDescriptor {
  uint64_t addr = 0;
  std::vector<uint64_t> keys;  // [the owner's rails]
  uint64_t size = 0;
  uint32_t owner_rank = 0;
  uint64_t engine_id = 0;  // random per engine: a restarted peer's old descriptors are stale
};

// Who a peer is: its rank, the provider that made its endpoints (peers must agree), each
// rail's endpoint name from fi_getname, and its signal region (the target of barrier writes
// and of zero-length scatter slices).
struct AddressCard {
  uint32_t rank = 0;
  uint64_t engine_id = 0;
  std::string provider;
  std::vector<std::string> endpoint_names;  // [rails], 1..kMaxRails
  RegionDescriptor signal;
};

// Layout: "JMMR" | addr u64 | size u64 | owner_rank u32 | engine_id u64 | rails u16 |
//         key u64 x rails | checksum u64 (FNV-1a over everything before it)
//         (42 + 8 x rails bytes).
std::string encode_region(const RegionDescriptor& region);
// Throws TransportError naming `what` when the bytes are not a descriptor.
RegionDescriptor decode_region(const std::string& bytes, const char* what);

// Layout: "JMTE" | rank u32 | engine_id u64 | provider length u16 | provider | rails u16 |
//         (name length u16 | name) x rails | descriptor length u16 | signal region descriptor.
std::string encode_card(const AddressCard& card);
AddressCard decode_card(const std::string& bytes, const char* what);

}  // namespace jax_moe::transport
