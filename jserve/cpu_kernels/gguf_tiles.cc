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
using jserve::ggml::kQ8_0;

constexpr int64_t kBlock = 32;
constexpr int kDigits = 3;                  // int8 digits per input: v = 2¹⁴·c2 + 2⁷·c1 + c0
constexpr float kDigitRange = 2080768.0f;   // |v| ≤ 127·2¹⁴: c2 stays an int8, c1 and c0 within ±64

// A format's block: bytes, and where a tile block's codes start (after the 16 rows' scales and minima).
struct Layout {
  int64_t block_bytes, header, tile_header, code_vectors;
};

constexpr Layout LayoutOf(int64_t type) {
  switch (type) {
    case kQ4_0: return {18, 2, 32, 4};
    case kQ4_1: return {20, 4, 64, 4};
    default: return {34, 2, 32, 8};  // kQ8_0
  }
}

const uint8_t* TileBlock(const uint8_t* tiles, int64_t type, int64_t blocks, int64_t tile, int64_t block) {
  return tiles + (tile * blocks + block) * kTileRows * LayoutOf(type).block_bytes;
}

// The integer v of input j of a token's block, and the codes of input j of row r in a tile block.
int32_t Digit(const int8_t* digits, int j) {
  return (digits[j] << 14) + (digits[kBlock + j] << 7) + digits[2 * kBlock + j];
}

int32_t Code(int64_t type, const uint8_t* tile_block, int r, int j) {
  const Layout layout = LayoutOf(type);
  const uint8_t* codes = tile_block + layout.tile_header;
  if (type == kQ8_0) return static_cast<int8_t>(codes[64 * (j / 4) + 4 * r + j % 4]);
  const int k = j % 16;
  const uint8_t byte = codes[64 * (k / 4) + 4 * r + k % 4];
  return j < 16 ? byte & 0xF : byte >> 4;
}

// The same products with plain loops (CPUs without AVX-512 VNNI): the same integer sums, then per block
// y += (d·s)·Σqv and the minimum's term, in the same order.
[[maybe_unused]] void ScalarRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
                const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
                float* y) {
  const int64_t blocks = a.blocks;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    for (int r = 0; r < kTileRows && tile * kTileRows + r < rows; ++r) {
      for (int64_t t = token_begin; t < token_end; ++t) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* tb = TileBlock(tiles, type, blocks, tile, b);
          const int8_t* digits = a.digits.data() + (t * blocks + b) * kDigits * kBlock;
          int64_t sum = 0;
          for (int j = 0; j < kBlock; ++j) sum += Code(type, tb, r, j) * Digit(digits, j);
          const float d = Half(tb + 2 * r), s = a.scale[t * blocks + b], x_sum = a.sum[t * blocks + b];
          acc = std::fma(static_cast<float>(sum), d * s, acc);
          if (type == kQ4_1) acc = std::fma(Half(tb + 32 + 2 * r), x_sum, acc);
          if (type == kQ4_0) acc = std::fma(d * -8.0f, x_sum, acc);
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

// One tile's 16 rows against kTokens tokens: each tile block's codes are loaded (and for 4-bit formats
// split into nibbles) once, then meet every token's three digit rows in three chains of int32 sums, whose
// combination 2¹⁴·Σq·c2 + 2⁷·Σq·c1 + Σq·c0 (in float: exact up to float's rounding of the total) scaled by
// d·s goes into one float accumulator per token.
template <int64_t kType, int kTokens>
void TilePass(const uint8_t* tile, const Activations& a, int64_t t0, int64_t outputs, int64_t o0, int64_t n,
              float* y) {
  constexpr Layout kLayout = LayoutOf(kType);
  constexpr int64_t kTileBlock = kTileRows * kLayout.block_bytes;
  const int64_t blocks = a.blocks;
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[kTokens];
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tb = tile + b * kTileBlock;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (kType == kQ4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32)));
    if constexpr (kType == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    __m512i codes[8];  // the 32 inputs' code vectors in digit order: inputs 4p..4p+3 at p
#pragma GCC unroll 8
    for (int p = 0; p < kLayout.code_vectors; ++p) {
      const __m512i v = _mm512_loadu_si512(tb + kLayout.tile_header + 64 * p);
      if constexpr (kType == kQ8_0) {
        codes[p] = _mm512_xor_si512(v, flip);  // unsigned for vpdpbusd: q + 128, taken off through the init
      } else {
        codes[p] = _mm512_and_si512(v, nibble);
        codes[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * blocks + b;
      const int8_t* digits = a.digits.data() + at * kDigits * kBlock;
      __m512i chain[kDigits];
#pragma GCC unroll 3
      for (int k = 0; k < kDigits; ++k) {  // Q8_0's flipped codes add 128·Σc: each chain starts without it
        chain[k] = kType == kQ8_0 ? _mm512_set1_epi32(-128 * a.digit_sums[kDigits * at + k]) : _mm512_setzero_si512();
      }
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
#pragma GCC unroll 3
        for (int k = 0; k < kDigits; ++k) chain[k] = Dot(chain[k], codes[p], digits + k * kBlock + 4 * p);
      }
      const __m512 sum = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(chain[0]), _mm512_set1_ps(16384.0f),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain[1]), _mm512_set1_ps(128.0f), _mm512_cvtepi32_ps(chain[2])));
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.scale[at]));
      acc[t] = _mm512_fmadd_ps(sum, ds, acc[t]);
      if constexpr (kType != kQ8_0) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[at]), acc[t]);
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
    default: return kPasses<kQ8_0>;
  }
}
#endif

}  // namespace

bool Tiled(int64_t type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

bool Vectorized() { return JSERVE_TILES_VNNI; }

int64_t SegmentBytes(int64_t type, int64_t rows, int64_t row_bytes) {
  return (Tiled(type) ? (rows + kTileRows - 1) / kTileRows * kTileRows : rows) * row_bytes;
}

void UntileRow(int64_t type, const uint8_t* tiles, int64_t row, int64_t blocks, uint8_t* out) {
  const Layout layout = LayoutOf(type);
  const int64_t tile = row / kTileRows, r = row % kTileRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tb = TileBlock(tiles, type, blocks, tile, b);
    uint8_t* block = out + b * layout.block_bytes;
    std::memcpy(block, tb + 2 * r, 2);                                   // d
    if (type == kQ4_1) std::memcpy(block + 2, tb + 32 + 2 * r, 2);       // m
    for (int64_t p = 0; p < layout.code_vectors; ++p) {
      std::memcpy(block + layout.header + 4 * p, tb + layout.tile_header + 64 * p + 4 * r, 4);
    }
  }
}

Activations::Activations(int64_t tokens, int64_t depth)
    : blocks(depth / kBlock),
      digits(tokens * blocks * kDigits * kBlock),
      scale(tokens * blocks),
      sum(tokens * blocks),
      digit_sums(tokens * blocks * kDigits) {}

void Quantize(const float* x, int64_t t, Activations* a) {
  for (int64_t b = 0; b < a->blocks; ++b) {
    const float* in = x + b * kBlock;
    const int64_t at = t * a->blocks + b;
    int8_t* digits = a->digits.data() + at * kDigits * kBlock;
    int32_t* sums = a->digit_sums.data() + at * kDigits;
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
    const uint8_t* first = TileBlock(tiles, type, a.blocks, tile, 0);
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
