// Tiled GGUF rows times integer activations: the layout and arithmetic gguf_tiles.h describes.
#include "gguf_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ggml.h"
#include "row_norm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JSERVE_TILES_VNNI 1
#else
#define JSERVE_TILES_VNNI 0
#endif

namespace jserve::gguf {
namespace {

using jserve::ggml::Half;
using jserve::ggml::kQ4_0;
using jserve::ggml::kQ4_1;
using jserve::ggml::kQ4_K;
using jserve::ggml::kQ5_0;
using jserve::ggml::kQ5_1;
using jserve::ggml::kQ5_K;
using jserve::ggml::kQ6_K;
using jserve::ggml::kQ8_0;

constexpr int64_t kBlock = 32;
constexpr int kDigits = 3;                  // int8 digits per input: v = 2¹⁴·c2 + 2⁷·c1 + c0
constexpr float kDigitRange = 2080768.0f;   // |v| ≤ 127·2¹⁴: c2 stays an int8, c1 and c0 within ±64

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

const uint8_t* TileBlock(const uint8_t* tiles, int64_t type, int64_t blocks, int64_t tile, int64_t block) {
  return tiles + (tile * blocks + block) * kTileRows * LayoutOf(type).block_bytes;
}

// The format's blocks per row for activations of a.blocks blocks of 32 inputs.
int64_t BlocksPerRow(int64_t type, const Activations& a) { return a.blocks * kBlock / LayoutOf(type).inputs; }

// Byte i of row r's field f in a tile block.
uint8_t FieldByte(const Layout& layout, const uint8_t* tile_block, int f, int r, int64_t i) {
  const int64_t lane = layout.Lane(f);
  return tile_block[layout.Offset(f) + kTileRows * lane * (i / lane) + lane * r + i % lane];
}

// The integer v of input j of a token's block.
int32_t Digit(const int8_t* digits, int j) {
  return (digits[j] << 14) + (digits[kBlock + j] << 7) + digits[2 * kBlock + j];
}

// Row r's share of one 32-input activation block (part j of a tile block): the codes the digits meet (Q8_0
// signed, Q6_K less its 32), per half of 16 inputs a factor (Q6_K's int8 scales, else 1), the scale d of
// the halves' sum, and the coefficient of the inputs' float sum (Q4_1's m, Q4_0's −8·d, Q4_K's −dmin·m).
struct RowPart {
  int32_t q[kBlock];
  float half[2] = {1.0f, 1.0f}, d, min = 0.0f;
};

RowPart PartOf(int64_t type, const uint8_t* tb, int r, int j) {
  const Layout layout = LayoutOf(type);
  RowPart part;
  part.d = Half(tb + 2 * r);
  auto byte = [&](int f, int64_t i) { return static_cast<int32_t>(FieldByte(layout, tb, f, r, i)); };
  for (int i = 0; i < kBlock; ++i) {
    switch (type) {
      case kQ8_0: part.q[i] = static_cast<int8_t>(byte(1, i)); break;
      case kQ4_K: part.q[i] = byte(3, 32 * (j / 2) + i) >> (4 * (j % 2)) & 0xF; break;
      case kQ5_K: part.q[i] = (byte(4, 32 * (j / 2) + i) >> (4 * (j % 2)) & 0xF) | (byte(3, i) >> j & 1) << 4; break;
      case kQ6_K: {
        const int h = j / 4, k = j % 4;
        const int32_t low = byte(kQ6Low[2 * h + k % 2], i) >> (4 * (k / 2)) & 0xF;
        part.q[i] = (low | (byte(kQ6High[h], i) >> (2 * k) & 3) << 4) - 32;
        break;
      }
      default: {  // Q4_0, Q4_1, Q5_0, Q5_1: input i's 5th bit is bit i of a 32-bit word
        part.q[i] = byte(layout.count - 1, i % 16) >> (4 * (i / 16)) & 0xF;
        if (type == kQ5_0 || type == kQ5_1) part.q[i] |= (byte(layout.count - 2, i / 8) >> (i % 8) & 1) << 4;
      }
    }
  }
  if (type == kQ4_0) part.min = -8.0f * part.d;
  if (type == kQ5_0) part.min = -16.0f * part.d;
  if (type == kQ4_1 || type == kQ5_1) part.min = Half(tb + 32 + 2 * r);
  if (PackedScales(type)) {
    uint8_t scale, min, packed[12];
    for (int i = 0; i < 12; ++i) packed[i] = static_cast<uint8_t>(byte(2, i));
    jserve::ggml::ScaleMin(j, packed, &scale, &min);
    part.min = -(Half(tb + 32 + 2 * r) * static_cast<float>(min));
    part.d *= static_cast<float>(scale);
  }
  if (type == kQ6_K) {
    for (int h = 0; h < 2; ++h) part.half[h] = static_cast<int8_t>(byte(1, 8 * (j / 4) + 2 * (j % 4) + h));
  }
  return part;
}

// The same products with plain loops (CPUs without AVX-512 VNNI): the same integer sums per half block,
// then y += (d·s)·(f0·Σ0 + f1·Σ1) and the minimum's term.
[[maybe_unused]] void ScalarRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
                                 const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs,
                                 int64_t first_row, float* y) {
  const int64_t parts = LayoutOf(type).inputs / kBlock, blocks = BlocksPerRow(type, a);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    for (int r = 0; r < kTileRows && tile * kTileRows + r < rows; ++r) {
      for (int64_t t = token_begin; t < token_end; ++t) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          const RowPart part = PartOf(type, TileBlock(tiles, type, blocks, tile, b / parts), r, b % parts);
          const int8_t* digits = a.digits.data() + (t * a.blocks + b) * kDigits * kBlock;
          int64_t sums[2] = {0, 0};
          for (int i = 0; i < kBlock; ++i) sums[i / 16] += part.q[i] * Digit(digits, i);
          const float total = static_cast<float>(sums[0]) * part.half[0] + static_cast<float>(sums[1]) * part.half[1];
          acc = std::fma(total, part.d * a.scale[t * a.blocks + b], acc);
          acc = std::fma(part.min, a.sum[t * a.blocks + b], acc);
        }
        y[t * outputs + first_row + tile * kTileRows + r] = acc;
      }
    }
  }
}

#if JSERVE_TILES_VNNI
using jserve::Lanes;

// acc + Σ of wv's unsigned bytes times the 4 signed bytes at `four`, per lane (vpdpbusd, `four` broadcast;
// in assembly as int8_linear.cc's, which found GCC moving accumulators between registers otherwise).
inline __m512i Dot(__m512i acc, __m512i wv, const int8_t* four) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(wv), "m"(*reinterpret_cast<const int32_t*>(four)));
  return acc;
}

// A tile block's part for one 32-input activation block (part j): the 16 rows' codes of its inputs 4p..4p+3
// in codes[p] (unsigned bytes for vpdpbusd), the scale d of their sums, the coefficient of the inputs'
// float sum, and for Q6_K the int8 factors of its two halves.
struct Part {
  __m512i codes[8];
  __m512 d, min, half[2];
};

// The low (high = 0) or high (1) nibbles of v's bytes.
inline __m512i Nibbles(__m512i v, int high) {
  return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(4 * high)), _mm512_set1_epi8(0x0F));
}

inline __m512 Halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i Vector(const uint8_t* p) { return _mm512_loadu_si512(p); }

// codes + 16 where the 5th bit is set: byte b of each lane takes bit first + b of the lane's 32-bit word.
inline __m512i WithFifthBits(__m512i codes, __m512i words, int first) {
  // Each lane's byte first / 8 into all 4 of its bytes (vpshufb indexes within 16-byte groups), then
  // byte b tests bit first % 8 + b.
  const __m512i lane_base = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000);
  const __m512i spread = _mm512_shuffle_epi8(words, _mm512_add_epi8(lane_base, _mm512_set1_epi8(first / 8)));
  const __m512i bits = _mm512_set1_epi32(static_cast<int>(0x08040201u << (first % 8)));
  return _mm512_mask_add_epi8(codes, _mm512_test_epi8_mask(spread, bits), codes, _mm512_set1_epi8(16));
}

// Byte `byte` of each 32-bit lane, as an unsigned or signed int32.
inline __m512i LaneByte(__m512i v, int byte) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * byte)), _mm512_set1_epi32(0xFF));
}
inline __m512 SignedLaneByte(__m512i v, int byte) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * byte)), 24));
}

// Q6_K's codes of stream k: 4 bits of `low` (its low nibbles for k < 2, else its high ones) and bits 2k
// and 2k + 1 of `high`, moved to bits 4 and 5.
template <int kStream>
inline void Q6Codes(const uint8_t* low, const uint8_t* high, __m512i* codes) {
  for (int p = 0; p < 8; ++p) {
    const __m512i v = Vector(high + 64 * p);
    const __m512i top = kStream < 3 ? _mm512_slli_epi16(v, 4 - 2 * kStream) : _mm512_srli_epi16(v, 2);
    const __m512i l = Vector(low + 64 * p);
    const __m512i lows = kStream < 2 ? l : _mm512_srli_epi16(l, 4);
    // (lows & 0x0F) | (top & 0x30)
    codes[p] = _mm512_ternarylogic_epi32(lows, _mm512_and_si512(top, _mm512_set1_epi8(0x30)), _mm512_set1_epi8(0x0F),
                                         0xEC);
  }
}

template <int64_t kType>
inline void LoadPart(const uint8_t* tb, int j, Part* part) {
  constexpr Layout kLayout = LayoutOf(kType);
  part->d = Halves(tb);
  part->min = _mm512_setzero_ps();
  if constexpr (Nibbled(kType)) {
    if constexpr (kType == kQ4_1 || kType == kQ5_1) part->min = Halves(tb + 32);
    if constexpr (kType == kQ4_0) part->min = _mm512_mul_ps(part->d, _mm512_set1_ps(-8.0f));
    if constexpr (kType == kQ5_0) part->min = _mm512_mul_ps(part->d, _mm512_set1_ps(-16.0f));
    for (int p = 0; p < 4; ++p) {
      const __m512i v = Vector(tb + kLayout.Offset(kLayout.count - 1) + 64 * p);
      part->codes[p] = Nibbles(v, 0);
      part->codes[p + 4] = Nibbles(v, 1);
    }
    if constexpr (kType == kQ5_0 || kType == kQ5_1) {  // 5th bits: bit i of lane r's word is row r's input i
      const __m512i words = Vector(tb + kLayout.Offset(kLayout.count - 2));
      for (int p = 0; p < 8; ++p) part->codes[p] = WithFifthBits(part->codes[p], words, 4 * (p % 4) + 16 * (p / 4));
    }
  } else if constexpr (kType == kQ8_0) {
    for (int p = 0; p < 8; ++p) {  // unsigned for vpdpbusd: q + 128, taken off through the chains' start
      part->codes[p] = _mm512_xor_si512(Vector(tb + kLayout.Offset(1) + 64 * p), _mm512_set1_epi8(char(0x80)));
    }
  } else if constexpr (PackedScales(kType)) {
    const uint8_t* scales = tb + kLayout.Offset(2);
    const __m512i packed[3] = {Vector(scales), Vector(scales + 64), Vector(scales + 128)};
    auto byte = [&](int i) { return LaneByte(packed[i / 4], i % 4); };
    __m512i scale, min;
    if (j < 4) {
      scale = _mm512_and_si512(byte(j), _mm512_set1_epi32(63));
      min = _mm512_and_si512(byte(j + 4), _mm512_set1_epi32(63));
    } else {
      const __m512i low = _mm512_set1_epi32(0xF);
      scale = _mm512_or_si512(_mm512_and_si512(byte(j + 4), low),
                              _mm512_slli_epi32(_mm512_srli_epi32(byte(j - 4), 6), 4));
      min = _mm512_or_si512(_mm512_srli_epi32(byte(j + 4), 4), _mm512_slli_epi32(_mm512_srli_epi32(byte(j), 6), 4));
    }
    part->d = _mm512_mul_ps(part->d, _mm512_cvtepi32_ps(scale));
    part->min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(Halves(tb + 32), _mm512_cvtepi32_ps(min)));
    const uint8_t* codes = tb + kLayout.Offset(kLayout.count - 1) + 64 * 8 * (j / 2);
    for (int p = 0; p < 8; ++p) part->codes[p] = Nibbles(Vector(codes + 64 * p), j % 2);
    if constexpr (kType == kQ5_K) {  // 5th bits: bit j of the high-bit bytes of inputs 4p..4p+3
      const uint8_t* high = tb + kLayout.Offset(3);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << j)), sixteen = _mm512_set1_epi8(16);
      for (int p = 0; p < 8; ++p) {
        const __mmask64 set = _mm512_test_epi8_mask(Vector(high + 64 * p), bit);
        part->codes[p] = _mm512_mask_add_epi8(part->codes[p], set, part->codes[p], sixteen);
      }
    }
  } else {  // kQ6_K: part j is stream k of half h; its 6-bit codes are 4 bits of `low` and 2 of `high`
    const int h = j / 4, k = j % 4;
    const __m512i scales = Vector(tb + kLayout.Offset(1) + 64 * (2 * h + k / 2));
    part->half[0] = SignedLaneByte(scales, 2 * (k % 2));
    part->half[1] = SignedLaneByte(scales, 2 * (k % 2) + 1);
    constexpr int64_t kLowAt[4] = {kLayout.Offset(kQ6Low[0]), kLayout.Offset(kQ6Low[1]), kLayout.Offset(kQ6Low[2]),
                                   kLayout.Offset(kQ6Low[3])};
    constexpr int64_t kHighAt[2] = {kLayout.Offset(kQ6High[0]), kLayout.Offset(kQ6High[1])};
    const uint8_t* low = tb + kLowAt[2 * h + k % 2];
    const uint8_t* high = tb + kHighAt[h];
    switch (k) {
      case 0: Q6Codes<0>(low, high, part->codes); break;
      case 1: Q6Codes<1>(low, high, part->codes); break;
      case 2: Q6Codes<2>(low, high, part->codes); break;
      default: Q6Codes<3>(low, high, part->codes);
    }
  }
}

// 2¹⁴·c2 + 2⁷·c1 + c0 of three chains, in float (exact up to float's rounding of the total).
inline __m512 Combine(const __m512i* chain) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain[0]), _mm512_set1_ps(16384.0f),
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain[1]), _mm512_set1_ps(128.0f),
                                         _mm512_cvtepi32_ps(chain[2])));
}

// One tile's 16 rows against kTokens tokens: each tile block part's codes are loaded (and unpacked) once,
// then meet every token's three digit rows in chains of int32 sums (one chain per digit, per half block for
// Q6_K), whose combination scaled by d·s goes into one float accumulator per token.
template <int64_t kType, int kTokens>
void TilePass(const uint8_t* tile, const Activations& a, int64_t t0, int64_t outputs, int64_t o0, int64_t n,
              float* y) {
  constexpr Layout kLayout = LayoutOf(kType);
  constexpr int64_t kParts = kLayout.inputs / kBlock, kTileBlock = kTileRows * kLayout.block_bytes;
  constexpr int kChains = kType == kQ6_K ? 2 * kDigits : kDigits;
  const int64_t blocks = a.blocks;
  __m512 acc[kTokens];
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    Part part;
    LoadPart<kType>(tile + b / kParts * kTileBlock, static_cast<int>(b % kParts), &part);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * blocks + b;
      const int8_t* digits = a.digits.data() + at * kDigits * kBlock;
      const int32_t* sums = a.digit_sums.data() + kDigits * at;
      const int32_t* first_half = a.half_sums.data() + kDigits * at;
      __m512i chain[kChains];
#pragma GCC unroll 6
      for (int k = 0; k < kChains; ++k) {  // offset codes (Q8_0's flipped, Q6_K's) start without the offset
        if constexpr (kType == kQ8_0) chain[k] = _mm512_set1_epi32(-128 * sums[k]);
        else if constexpr (kType == kQ6_K) {
          const int32_t half = k < kDigits ? first_half[k] : sums[k - kDigits] - first_half[k - kDigits];
          chain[k] = _mm512_set1_epi32(-32 * half);
        } else chain[k] = _mm512_setzero_si512();
      }
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        __m512i* into = chain + (kType == kQ6_K && p >= 4 ? kDigits : 0);
#pragma GCC unroll 3
        for (int k = 0; k < kDigits; ++k) into[k] = Dot(into[k], part.codes[p], digits + k * kBlock + 4 * p);
      }
      __m512 sum = Combine(chain);
      if constexpr (kType == kQ6_K) {
        sum = _mm512_fmadd_ps(sum, part.half[0], _mm512_mul_ps(Combine(chain + kDigits), part.half[1]));
      }
      acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(part.d, _mm512_set1_ps(a.scale[at])), acc[t]);
      if constexpr (HasMin(kType)) {
        acc[t] = _mm512_fmadd_ps(part.min, _mm512_set1_ps(a.sum[at]), acc[t]);
      }
    }
  }
  const __mmask16 lanes = Lanes(n);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * outputs + o0, lanes, acc[t]);
}

constexpr int kTokensPerPass = 8;
using PassFn = void (*)(const uint8_t*, const Activations&, int64_t, int64_t, int64_t, int64_t, float*);

template <int64_t kType>
constexpr PassFn kPasses[kTokensPerPass + 1] = {
    nullptr,           TilePass<kType, 1>, TilePass<kType, 2>, TilePass<kType, 3>, TilePass<kType, 4>,
    TilePass<kType, 5>, TilePass<kType, 6>, TilePass<kType, 7>, TilePass<kType, 8>};

const PassFn* PassesFor(int64_t type) {
  switch (type) {
    case kQ4_0: return kPasses<kQ4_0>;
    case kQ4_1: return kPasses<kQ4_1>;
    case kQ5_0: return kPasses<kQ5_0>;
    case kQ5_1: return kPasses<kQ5_1>;
    case kQ4_K: return kPasses<kQ4_K>;
    case kQ5_K: return kPasses<kQ5_K>;
    case kQ6_K: return kPasses<kQ6_K>;
    default: return kPasses<kQ8_0>;
  }
}
#endif

}  // namespace

bool Vectorized() { return JSERVE_TILES_VNNI; }

int64_t SegmentBytes(int64_t rows, int64_t row_bytes) {
  return (rows + kTileRows - 1) / kTileRows * kTileRows * row_bytes;
}

void UntileRow(int64_t type, const uint8_t* tiles, int64_t row, int64_t blocks, uint8_t* out) {
  const Layout layout = LayoutOf(type);
  const int64_t tile = row / kTileRows, r = row % kTileRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tb = TileBlock(tiles, type, blocks, tile, b);
    uint8_t* block = out + b * layout.block_bytes;
    for (int f = 0; f < layout.count; ++f) {
      const Field field = layout.fields[f];
      for (int64_t i = 0; i < field.bytes; ++i) block[field.at + i] = FieldByte(layout, tb, f, r, i);
    }
  }
}

Activations::Activations(int64_t tokens, int64_t depth)
    : blocks(depth / kBlock),
      digits(tokens * blocks * kDigits * kBlock),
      scale(tokens * blocks),
      sum(tokens * blocks),
      digit_sums(tokens * blocks * kDigits),
      half_sums(tokens * blocks * kDigits) {}

void Quantize(const float* x, int64_t t, Activations* a) {
  for (int64_t b = 0; b < a->blocks; ++b) {
    const float* in = x + b * kBlock;
    const int64_t at = t * a->blocks + b;
    int8_t* digits = a->digits.data() + at * kDigits * kBlock;
    int32_t *sums = a->digit_sums.data() + at * kDigits, *half = a->half_sums.data() + at * kDigits;
#if defined(__AVX512F__)
    const __m512 v[2] = {_mm512_loadu_ps(in), _mm512_loadu_ps(in + 16)};
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const __m512 inverse = _mm512_set1_ps(top == 0.0f ? 0.0f : jserve::Div(kDigitRange, top));
    __m512i totals[kDigits] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int h = 0; h < 2; ++h) {
      __m512i rest =
          _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(v[h], inverse, jserve::kNearest), jserve::kNearest);
      for (int k = 0; k < kDigits; ++k) {  // c = round(rest / 2^shift), rounding halves up
        const int shift = 7 * (kDigits - 1 - k);
        const __m512i c = shift ? _mm512_srai_epi32(_mm512_add_epi32(rest, _mm512_set1_epi32(1 << (shift - 1))), shift)
                                : rest;
        rest = _mm512_sub_epi32(rest, _mm512_slli_epi32(c, shift));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + k * kBlock + 16 * h), _mm512_cvtepi32_epi8(c));
        totals[k] = _mm512_add_epi32(totals[k], c);
        if (h == 0) half[k] = _mm512_reduce_add_epi32(c);
      }
    }
    for (int k = 0; k < kDigits; ++k) sums[k] = _mm512_reduce_add_epi32(totals[k]);
    a->sum[at] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
#else
    float top = 0.0f, sum = 0.0f;
    for (int j = 0; j < kBlock; ++j) top = std::max(top, std::fabs(in[j]));
    const float inverse = top == 0.0f ? 0.0f : kDigitRange / top;
    for (int k = 0; k < kDigits; ++k) sums[k] = 0;
    for (int j = 0; j < kBlock; ++j) {
      int32_t rest = static_cast<int32_t>(std::nearbyint(in[j] * inverse));
      for (int k = 0; k < kDigits; ++k) {
        const int shift = 7 * (kDigits - 1 - k);
        const int32_t c = shift ? (rest + (1 << (shift - 1))) >> shift : rest;
        rest -= c << shift;
        digits[k * kBlock + j] = static_cast<int8_t>(c);
        sums[k] += c;
        if (j == 15) half[k] = sums[k];
      }
      sum += in[j];
    }
    a->sum[at] = sum;
#endif
    a->scale[at] = top / kDigitRange;
  }
}

void TiledRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
               const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
               float* y) {
#if JSERVE_TILES_VNNI
  const PassFn* passes = PassesFor(type);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const uint8_t* first = TileBlock(tiles, type, BlocksPerRow(type, a), tile, 0);
    const int64_t n = std::min(kTileRows, rows - tile * kTileRows);
    for (int64_t t = token_begin; t < token_end; t += kTokensPerPass) {
      const int64_t count = std::min<int64_t>(kTokensPerPass, token_end - t);
      passes[count](first, a, t, outputs, first_row + tile * kTileRows, n, y);
    }
  }
#else
  ScalarRows(type, tiles, rows, tile_begin, tile_end, a, token_begin, token_end, outputs, first_row, y);
#endif
}

}  // namespace jserve::gguf

// y [tokens, rows] = x [tokens, depth] · wᵀ for one tiled weight, outside XLA: lets the tests run a build
// compiled without AVX-512 (its scalar loops) against the kernel.
extern "C" void JserveGgufTilesProduct(int64_t type, const uint8_t* tiles, int64_t rows, int64_t depth,
                                       const float* x, int64_t tokens, float* y) {
  jserve::gguf::Activations a(tokens, depth);
  for (int64_t t = 0; t < tokens; ++t) jserve::gguf::Quantize(x + t * depth, t, &a);
  const int64_t tiles_count = (rows + jserve::gguf::kTileRows - 1) / jserve::gguf::kTileRows;
  jserve::gguf::TiledRows(type, tiles, rows, 0, tiles_count, a, 0, tokens, rows, 0, y);
}
