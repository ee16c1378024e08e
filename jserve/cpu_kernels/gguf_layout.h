// The tile layout of gguf_tiles.h, field by field, and the entry points of its vector passes: shared by
// gguf_tiles.cc (layout, activations, scalar loops) and each instruction set's passes
// (gguf_tiles_vnni.cc, gguf_tiles_avx2.cc).
#pragma once

#include <cstdint>
#include <type_traits>

#include "ggml.h"
#include "gguf_tiles.h"

namespace jserve::gguf {

using jserve::ggml::kQ4_0;
using jserve::ggml::kQ4_1;
using jserve::ggml::kQ4_K;
using jserve::ggml::kQ5_0;
using jserve::ggml::kQ5_1;
using jserve::ggml::kQ5_K;
using jserve::ggml::kQ6_K;
using jserve::ggml::kQ8_0;

constexpr int64_t kBlock = 32;
constexpr int kDigits = 3;  // int8 digits per input: v = 2¹⁴·c2 + 2⁷·c1 + c0

// One field of a format's block: its offset in ggml's block and its bytes per row. A tile block holds the
// 16 rows' fields in the layout's order, a 2-byte field as 16 values, a longer one as 64-byte vectors whose
// lane r holds 4 bytes of row r (gguf_tiles.py writes them).
struct Field {
  int64_t at, bytes;
};

struct Layout {
  int64_t inputs, block_bytes;  // per block
  int count;
  Field fields[8];

  constexpr int64_t Lane(int f) const { return fields[f].bytes < 4 ? fields[f].bytes : 4; }
  // Where field f starts in a tile block.
  constexpr int64_t Offset(int f) const {
    int64_t offset = 0;
    for (int i = 0; i < f; ++i) offset += kTileRows * fields[i].bytes;
    return offset;
  }
};

constexpr Layout LayoutOf(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, 2, {{0, 2}, {2, 16}}};                              // d, codes
    case kQ4_1: return {32, 20, 3, {{0, 2}, {2, 2}, {4, 16}}};                      // d, m, codes
    case kQ5_0: return {32, 22, 3, {{0, 2}, {2, 4}, {6, 16}}};                      // d, 5th bits, codes
    case kQ5_1: return {32, 24, 4, {{0, 2}, {2, 2}, {4, 4}, {8, 16}}};              // d, m, 5th bits, codes
    case kQ4_K: return {256, 144, 4, {{0, 2}, {2, 2}, {4, 12}, {16, 128}}};         // d, dmin, scales, codes
    case kQ5_K: return {256, 176, 5, {{0, 2}, {2, 2}, {4, 12}, {16, 32}, {48, 128}}};  // ... 5th bits, codes
    // d, scales, then the 4 low bits and 2 high bits of the codes in the order the parts read them
    // (kQ6Low, kQ6High): one stream through the tile block, not two.
    case kQ6_K:
      return {256, 210, 8, {{208, 2}, {192, 16}, {0, 32}, {128, 32}, {32, 32}, {64, 32}, {160, 32}, {96, 32}}};
    default: return {32, 34, 2, {{0, 2}, {2, 32}}};                                 // kQ8_0: d, codes
  }
}

// Q6_K's fields holding the low bits of half h's streams k = 0, 2 (2h) and 1, 3 (2h + 1), and its high bits.
constexpr int kQ6Low[4] = {2, 4, 5, 7}, kQ6High[2] = {3, 6};

// Formats of 32-input blocks with 4-bit codes (and a 5th bit), and those with Q4_K's packed 6-bit scales.
constexpr bool Nibbled(int64_t type) { return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1; }
constexpr bool PackedScales(int64_t type) { return type == kQ4_K || type == kQ5_K; }
// Formats whose weights have a term independent of the code (a minimum, or Q4_0's −8·d and Q5_0's −16·d).
constexpr bool HasMin(int64_t type) { return type != kQ8_0 && type != kQ6_K; }

// f(std::integral_constant<int64_t, type>{}) for a format the tiles take (Q8_0 for any other): a pass
// compiled per format, picked at run time.
template <typename F>
auto ForType(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    default: return f(std::integral_constant<int64_t, kQ8_0>{});
  }
}

inline const uint8_t* TileBlock(const uint8_t* tiles, int64_t type, int64_t blocks, int64_t tile, int64_t block) {
  return tiles + (tile * blocks + block) * kTileRows * LayoutOf(type).block_bytes;
}

// The format's blocks per row for activations of a.blocks blocks of 32 inputs.
inline int64_t BlocksPerRow(int64_t type, const Activations& a) { return a.blocks * kBlock / LayoutOf(type).inputs; }

// Each instruction set's TiledRows (same arguments), and whether this build has it: a build for a CPU
// without the instructions compiles the pass to nothing.
bool VnniBuilt();
void VnniRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
              const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
              float* y);
bool Avx2Built();
void Avx2Rows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
              const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
              float* y);

}  // namespace jserve::gguf
