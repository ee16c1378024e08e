// gguf_tiles.h's products with AVX2 (CPUs without AVX-512 VNNI): each 64-byte tile vector is two 32-byte
// sides of 8 rows, and a side's codes meet the digits in vpmaddubsw, unsigned codes times signed digits
// into int16 pairs, summed in int16 over as many inputs as cannot overflow, then into int32 (vpmaddwd).
// The integer sums are gguf_tiles_vnni.cc's, so both give the same products up to float rounding.
#include <algorithm>

#include "gguf_layout.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

namespace jserve::gguf {
namespace {

constexpr int64_t kSideRows = 8;

// How many vpmaddubsw results (pairs of code·digit, |digit| ≤ 127) an int16 holds: the largest code times
// 254 per result, under 2¹⁵. Q8_0's signed codes go in as |q| ≤ 128 with the digits' signs flipped.
constexpr int GroupOf(int64_t type) {
  return type == kQ8_0 ? 1 : type == kQ6_K ? 2 : (type == kQ5_0 || type == kQ5_1 || type == kQ5_K) ? 4 : 8;
}

// A side's part for one 32-input activation block (part j): its 8 rows' codes of inputs 4p..4p+3 in
// codes[p] (unsigned bytes; Q8_0's |q|, with q in signs[p]), the scale d of their sums, the coefficient of
// the inputs' float sum, and for Q6_K the int8 factors of its two halves.
struct Part {
  __m256i codes[8], signs[8];
  __m256 d, min, half[2];
};

// v as computed, hidden from the optimizer: under -ffast-math it would otherwise reassociate a part's
// scale products with a token's where a pass has one token, rounding a token's result by its step's size.
inline void Pin(__m256& v) { asm("" : "+x"(v)); }

inline __m256i Vector(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 float16 values from p.
inline __m256 Halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The low (high = 0) or high (1) nibbles of v's bytes.
inline __m256i Nibbles(__m256i v, int high) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * high)), _mm256_set1_epi8(0x0F));
}

// codes + 16 where the byte of `bits` tests set in `v`.
inline __m256i AddSixteenWhere(__m256i codes, __m256i v, __m256i bits) {
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
  return _mm256_add_epi8(codes, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// codes + 16 where the 5th bit is set: byte b of each lane takes bit first + b of the lane's 32-bit word.
inline __m256i WithFifthBits(__m256i codes, __m256i words, int first) {
  // Each lane's byte first / 8 into all 4 of its bytes (vpshufb indexes within 16-byte groups), then
  // byte b tests bit first % 8 + b.
  const __m256i lane_base = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808,
                                              0x0C0C0C0C);
  const __m256i spread = _mm256_shuffle_epi8(words, _mm256_add_epi8(lane_base, _mm256_set1_epi8(first / 8)));
  return AddSixteenWhere(codes, spread, _mm256_set1_epi32(static_cast<int>(0x08040201u << (first % 8))));
}

// Byte `byte` of each 32-bit lane, as an unsigned int32 or a signed float.
inline __m256i LaneByte(__m256i v, int byte) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * byte)), _mm256_set1_epi32(0xFF));
}
inline __m256 SignedLaneByte(__m256i v, int byte) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * byte)), 24));
}

// Q6_K's codes of stream k: 4 bits of `low` (its low nibbles for k < 2, else its high ones) and bits 2k
// and 2k + 1 of `high`, moved to bits 4 and 5. `low` and `high` point at the side's half of each vector.
template <int kStream>
inline void Q6Codes(const uint8_t* low, const uint8_t* high, __m256i* codes) {
  for (int p = 0; p < 8; ++p) {
    const __m256i v = Vector(high + 64 * p);
    const __m256i top = kStream < 3 ? _mm256_slli_epi16(v, 4 - 2 * kStream) : _mm256_srli_epi16(v, 2);
    const __m256i l = Vector(low + 64 * p);
    const __m256i lows = kStream < 2 ? l : _mm256_srli_epi16(l, 4);
    codes[p] = _mm256_or_si256(_mm256_and_si256(lows, _mm256_set1_epi8(0x0F)),
                               _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
  }
}

// Side s (rows 8s..8s+7) of a tile block's part j. A 64-byte vector's side is its bytes 32s..32s+31, a
// float16 field's its values 8s..8s+7.
template <int64_t kType>
inline void LoadPart(const uint8_t* tb, int j, int s, Part* part) {
  constexpr Layout kLayout = LayoutOf(kType);
  const int64_t side = 32 * s, values = 16 * s;
  part->d = Halves(tb + values);
  part->min = _mm256_setzero_ps();
  if constexpr (Nibbled(kType)) {
    if constexpr (kType == kQ4_1 || kType == kQ5_1) part->min = Halves(tb + 32 + values);
    if constexpr (kType == kQ4_0) part->min = _mm256_mul_ps(part->d, _mm256_set1_ps(-8.0f));
    if constexpr (kType == kQ5_0) part->min = _mm256_mul_ps(part->d, _mm256_set1_ps(-16.0f));
    for (int p = 0; p < 4; ++p) {
      const __m256i v = Vector(tb + kLayout.Offset(kLayout.count - 1) + 64 * p + side);
      part->codes[p] = Nibbles(v, 0);
      part->codes[p + 4] = Nibbles(v, 1);
    }
    if constexpr (kType == kQ5_0 || kType == kQ5_1) {  // 5th bits: bit i of lane r's word is row r's input i
      const __m256i words = Vector(tb + kLayout.Offset(kLayout.count - 2) + side);
      for (int p = 0; p < 8; ++p) part->codes[p] = WithFifthBits(part->codes[p], words, 4 * (p % 4) + 16 * (p / 4));
    }
  } else if constexpr (kType == kQ8_0) {
    for (int p = 0; p < 8; ++p) {
      part->signs[p] = Vector(tb + kLayout.Offset(1) + 64 * p + side);
      part->codes[p] = _mm256_abs_epi8(part->signs[p]);  // -128's 0x80 reads as 128 unsigned
    }
  } else if constexpr (PackedScales(kType)) {
    const uint8_t* scales = tb + kLayout.Offset(2) + side;
    const __m256i packed[3] = {Vector(scales), Vector(scales + 64), Vector(scales + 128)};
    auto byte = [&](int i) { return LaneByte(packed[i / 4], i % 4); };
    __m256i scale, min;
    if (j < 4) {
      scale = _mm256_and_si256(byte(j), _mm256_set1_epi32(63));
      min = _mm256_and_si256(byte(j + 4), _mm256_set1_epi32(63));
    } else {
      const __m256i low = _mm256_set1_epi32(0xF);
      scale = _mm256_or_si256(_mm256_and_si256(byte(j + 4), low),
                              _mm256_slli_epi32(_mm256_srli_epi32(byte(j - 4), 6), 4));
      min = _mm256_or_si256(_mm256_srli_epi32(byte(j + 4), 4), _mm256_slli_epi32(_mm256_srli_epi32(byte(j), 6), 4));
    }
    part->d = _mm256_mul_ps(part->d, _mm256_cvtepi32_ps(scale));
    part->min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(Halves(tb + 32 + values), _mm256_cvtepi32_ps(min)));
    const uint8_t* codes = tb + kLayout.Offset(kLayout.count - 1) + 64 * 8 * (j / 2) + side;
    for (int p = 0; p < 8; ++p) part->codes[p] = Nibbles(Vector(codes + 64 * p), j % 2);
    if constexpr (kType == kQ5_K) {  // 5th bits: bit j of the high-bit bytes of inputs 4p..4p+3
      const uint8_t* high = tb + kLayout.Offset(3) + side;
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
      for (int p = 0; p < 8; ++p) part->codes[p] = AddSixteenWhere(part->codes[p], Vector(high + 64 * p), bit);
    }
  } else {  // kQ6_K: part j is stream k of half h; its 6-bit codes are 4 bits of `low` and 2 of `high`
    const int h = j / 4, k = j % 4;
    const __m256i scales = Vector(tb + kLayout.Offset(1) + 64 * (2 * h + k / 2) + side);
    part->half[0] = SignedLaneByte(scales, 2 * (k % 2));
    part->half[1] = SignedLaneByte(scales, 2 * (k % 2) + 1);
    constexpr int64_t kLowAt[4] = {kLayout.Offset(kQ6Low[0]), kLayout.Offset(kQ6Low[1]), kLayout.Offset(kQ6Low[2]),
                                   kLayout.Offset(kQ6Low[3])};
    constexpr int64_t kHighAt[2] = {kLayout.Offset(kQ6High[0]), kLayout.Offset(kQ6High[1])};
    const uint8_t* low = tb + kLowAt[2 * h + k % 2] + side;
    const uint8_t* high = tb + kHighAt[h] + side;
    switch (k) {
      case 0: Q6Codes<0>(low, high, part->codes); break;
      case 1: Q6Codes<1>(low, high, part->codes); break;
      case 2: Q6Codes<2>(low, high, part->codes); break;
      default: Q6Codes<3>(low, high, part->codes);
    }
  }
  Pin(part->d);
  Pin(part->min);
  if constexpr (kType == kQ6_K) Pin(part->half[0]), Pin(part->half[1]);
}

// 2¹⁴·c2 + 2⁷·c1 + c0 of three chains, in float (exact up to float's rounding of the total).
inline __m256 Combine(const __m256i* chain) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(chain[0]), _mm256_set1_ps(16384.0f),
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(chain[1]), _mm256_set1_ps(128.0f),
                                         _mm256_cvtepi32_ps(chain[2])));
}

// One side's 8 rows against kTokens tokens, as gguf_tiles_vnni.cc's TilePass: each part's codes loaded
// (and unpacked) once, then int32 chains per digit (per half block for Q6_K) for every token.
template <int64_t kType, int kTokens>
void SidePass(const uint8_t* tile, int s, const Activations& a, int64_t t0, int64_t outputs, int64_t o0, int64_t n,
              float* y) {
  constexpr Layout kLayout = LayoutOf(kType);
  constexpr int64_t kParts = kLayout.inputs / kBlock, kTileBlock = kTileRows * kLayout.block_bytes;
  constexpr int kChains = kType == kQ6_K ? 2 * kDigits : kDigits, kGroup = GroupOf(kType);
  const int64_t blocks = a.blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    Part part;
    LoadPart<kType>(tile + b / kParts * kTileBlock, static_cast<int>(b % kParts), s, &part);
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * blocks + b;
      const int8_t* digits = a.digits.data() + at * kDigits * kBlock;
      const int32_t* sums = a.digit_sums.data() + kDigits * at;
      const int32_t* first_half = a.half_sums.data() + kDigits * at;
      __m256i chain[kChains];
      for (int k = 0; k < kChains; ++k) {  // Q6_K's codes start without their offset of 32
        if constexpr (kType == kQ6_K) {
          const int32_t half = k < kDigits ? first_half[k] : sums[k - kDigits] - first_half[k - kDigits];
          chain[k] = _mm256_set1_epi32(-32 * half);
        } else {
          chain[k] = _mm256_setzero_si256();
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < 8; g += kGroup) {
        __m256i* into = chain + (kType == kQ6_K && g >= 4 ? kDigits : 0);
#pragma GCC unroll 3
        for (int k = 0; k < kDigits; ++k) {
          __m256i pairs = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int p = g; p < g + kGroup; ++p) {
            int32_t four;
            __builtin_memcpy(&four, digits + k * kBlock + 4 * p, 4);
            __m256i operand = _mm256_set1_epi32(four);
            if constexpr (kType == kQ8_0) operand = _mm256_sign_epi8(operand, part.signs[p]);
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(part.codes[p], operand));
          }
          into[k] = _mm256_add_epi32(into[k], _mm256_madd_epi16(pairs, ones));
        }
      }
      __m256 sum = Combine(chain);
      if constexpr (kType == kQ6_K) {
        sum = _mm256_fmadd_ps(sum, part.half[0], _mm256_mul_ps(Combine(chain + kDigits), part.half[1]));
      }
      acc[t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(part.d, _mm256_set1_ps(a.scale[at])), acc[t]);
      if constexpr (HasMin(kType)) acc[t] = _mm256_fmadd_ps(part.min, _mm256_set1_ps(a.sum[at]), acc[t]);
    }
  }
  const int64_t count = std::min(kSideRows, n - kSideRows * s);
  for (int t = 0; t < kTokens; ++t) {
    float* out = y + (t0 + t) * outputs + o0 + kSideRows * s;
    if (count == kSideRows) {
      _mm256_storeu_ps(out, acc[t]);
    } else {
      alignas(32) float row[kSideRows];
      _mm256_store_ps(row, acc[t]);
      std::copy(row, row + count, out);
    }
  }
}

// Tokens per pass: AVX2 has 16 vector registers, which the codes of a part already half fill.
constexpr int kTokensPerPass = 4;
using PassFn = void (*)(const uint8_t*, int, const Activations&, int64_t, int64_t, int64_t, int64_t, float*);

template <int64_t kType>
constexpr PassFn kPasses[kTokensPerPass + 1] = {nullptr, SidePass<kType, 1>, SidePass<kType, 2>, SidePass<kType, 3>,
                                                SidePass<kType, 4>};

const PassFn* PassesFor(int64_t type) {
  return ForType(type, [](auto format) { return kPasses<decltype(format)::value>; });
}

}  // namespace

bool Avx2Built() { return true; }

void Avx2Rows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
              const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
              float* y) {
  const PassFn* passes = PassesFor(type);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const uint8_t* first = TileBlock(tiles, type, BlocksPerRow(type, a), tile, 0);
    const int64_t n = std::min(kTileRows, rows - tile * kTileRows);
    for (int s = 0; s * kSideRows < n; ++s) {
      for (int64_t t = token_begin; t < token_end; t += kTokensPerPass) {
        const int64_t count = std::min<int64_t>(kTokensPerPass, token_end - t);
        passes[count](first, s, a, t, outputs, first_row + tile * kTileRows, n, y);
      }
    }
  }
}

}  // namespace jserve::gguf

#else

namespace jserve::gguf {

bool Avx2Built() { return false; }
void Avx2Rows(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Activations&, int64_t, int64_t, int64_t,
              int64_t, float*) {}

}  // namespace jserve::gguf

#endif
