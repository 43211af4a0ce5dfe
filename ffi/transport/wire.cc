#include "ffi/transport/wire.h"

#include <cstring>

#include "ffi/transport/errors.h"

namespace jax_moe::transport {
namespace {

constexpr char kRegionMagic[4] = {'J', 'M', 'M', 'R'};
constexpr char kCardMagic[4] = {'J', 'M', 'T', 'E'};

// FNV-1a, 64-bit: catches corrupted descriptors (a flipped key), not forgery.
uint64_t fnv1a(const char* data, size_t n) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    hash ^= static_cast<uint8_t>(data[i]);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

template <typename T>
void put(std::string& out, T value) {
  // Little-endian on every platform libfabric runs on that we build for (x86-64, aarch64).
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// Reads sequentially from a blob; every read is bounds-checked against the blob's size.
class Reader {
 public:
  Reader(const std::string& bytes, const char* what) : bytes_(bytes), what_(what) {}

  template <typename T>
  T get() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  std::string get_string(size_t length) {
    need(length);
    std::string s = bytes_.substr(pos_, length);
    pos_ += length;
    return s;
  }

  void expect_magic(const char (&magic)[4], const char* kind) {
    if (bytes_.size() < 4 || std::memcmp(bytes_.data(), magic, 4) != 0) {
      fail(std::string("is not ") + kind);
    }
    pos_ = 4;
  }

  void expect_end() {
    if (pos_ != bytes_.size()) {
      fail("has " + std::to_string(bytes_.size() - pos_) + " trailing bytes");
    }
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw TransportError(std::string(what_) + " (" + std::to_string(bytes_.size()) +
                         " bytes) " + why);
  }

 private:
  void need(size_t n) const {
    if (pos_ + n > bytes_.size()) fail("is truncated");
  }

  const std::string& bytes_;
  const char* what_;
  size_t pos_ = 0;
};

// A rail count read from a blob: 1..kMaxRails.
size_t read_rails(Reader& reader) {
  const size_t rails = reader.get<uint16_t>();
  if (rails == 0 || rails > kMaxRails) {
    reader.fail("names " + std::to_string(rails) + " rails; an engine has 1 to " +
                std::to_string(kMaxRails));
  }
  return rails;
}

RegionDescriptor read_region(Reader& reader) {
  RegionDescriptor region;
  region.addr = reader.get<uint64_t>();
  region.size = reader.get<uint64_t>();
  region.owner_rank = reader.get<uint32_t>();
  region.engine_id = reader.get<uint64_t>();
  region.keys.resize(read_rails(reader));
  for (uint64_t& key : region.keys) key = reader.get<uint64_t>();
  return region;
}

}  // namespace

std::string encode_region(const RegionDescriptor& region) {
  std::string out(kRegionMagic, 4);
  put(out, region.addr);
  put(out, region.size);
  put(out, region.owner_rank);
  put(out, region.engine_id);
  put(out, static_cast<uint16_t>(region.keys.size()));
  for (uint64_t key : region.keys) put(out, key);
  put(out, fnv1a(out.data(), out.size()));
  return out;
}

RegionDescriptor decode_region(const std::string& bytes, const char* what) {
  Reader reader(bytes, what);
  reader.expect_magic(kRegionMagic, "a region descriptor (from MemoryRegion.descriptor)");
  RegionDescriptor region = read_region(reader);
  const uint64_t checksum = reader.get<uint64_t>();
  reader.expect_end();
  if (checksum != fnv1a(bytes.data(), bytes.size() - sizeof(uint64_t))) {
    reader.fail("fails its checksum: it was altered after MemoryRegion.descriptor made it");
  }
  return region;
}

std::string encode_card(const AddressCard& card) {
  std::string out(kCardMagic, 4);
  put(out, card.rank);
  put(out, card.engine_id);
  put(out, static_cast<uint16_t>(card.provider.size()));
  out += card.provider;
  put(out, static_cast<uint16_t>(card.endpoint_names.size()));
  for (const std::string& name : card.endpoint_names) {
    put(out, static_cast<uint16_t>(name.size()));
    out += name;
  }
  const std::string signal = encode_region(card.signal);
  put(out, static_cast<uint16_t>(signal.size()));
  out += signal;
  return out;
}

AddressCard decode_card(const std::string& bytes, const char* what) {
  Reader reader(bytes, what);
  reader.expect_magic(kCardMagic, "an engine address (from TransferEngine.address)");
  AddressCard card;
  card.rank = reader.get<uint32_t>();
  card.engine_id = reader.get<uint64_t>();
  card.provider = reader.get_string(reader.get<uint16_t>());
  card.endpoint_names.resize(read_rails(reader));
  for (std::string& name : card.endpoint_names) {
    name = reader.get_string(reader.get<uint16_t>());
    if (name.empty()) reader.fail("has an empty endpoint name");
  }
  const std::string region_bytes = reader.get_string(reader.get<uint16_t>());
  card.signal = decode_region(region_bytes, what);
  if (card.signal.keys.size() != card.endpoint_names.size()) {
    reader.fail("has a signal region of " + std::to_string(card.signal.keys.size()) +
                " rails for " + std::to_string(card.endpoint_names.size()) + " endpoints");
  }
  reader.expect_end();
  return card;
}

}  // namespace jax_moe::transport
