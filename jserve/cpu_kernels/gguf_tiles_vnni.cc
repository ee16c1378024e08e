// gguf_tiles.h's products with AVX-512 VNNI: one 64-byte load of a tile vector feeds vpdpbusd for the
// tile's 16 rows at once.
#include <algorithm>

#include "gguf_layout.h"
#include "row_norm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace jserve::gguf {
namespace {
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
  return ForType(type, [](auto format) { return kPasses<decltype(format)::value>; });
}

}  // namespace

bool VnniBuilt() { return true; }

void VnniRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
              const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
              float* y) {
  const PassFn* passes = PassesFor(type);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const uint8_t* first = TileBlock(tiles, type, BlocksPerRow(type, a), tile, 0);
    const int64_t n = std::min(kTileRows, rows - tile * kTileRows);
    for (int64_t t = token_begin; t < token_end; t += kTokensPerPass) {
      const int64_t count = std::min<int64_t>(kTokensPerPass, token_end - t);
      passes[count](first, a, t, outputs, first_row + tile * kTileRows, n, y);
    }
  }
}

}  // namespace jserve::gguf

#else

namespace jserve::gguf {

bool VnniBuilt() { return false; }
void VnniRows(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Activations&, int64_t, int64_t, int64_t,
              int64_t, float*) {}

}  // namespace jserve::gguf

#endif
