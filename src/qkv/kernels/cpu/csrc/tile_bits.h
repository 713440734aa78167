// Bits of a 64-key tile row, shared by the layout builders (tile_layout.cpp, chosen_blocks.cpp):
// bit c of a tile row is key first + c of the tile that starts at key `first`.
#pragma once

#include <cstdint>

namespace qkv_cpu {

constexpr int64_t BK = 64;  // keys per tile (one uint64 of bits per tile row)

// the low n bits (n clamped to 0 … 64)
inline uint64_t low_bits(int64_t n) {
  if (n <= 0) return 0;
  if (n >= BK) return ~uint64_t(0);
  return (uint64_t(1) << n) - 1;
}

// bits of keys [a, b] (inclusive, already inside tile `first … first + 63`) within that tile
inline uint64_t span_bits(int64_t a, int64_t b, int64_t first) {
  return a > b ? 0 : low_bits(b - a + 1) << (a - first);
}

}  // namespace qkv_cpu
