// Tiled GGUF rows times integer activations (gguf_tiles.h): the activations' digits, rows untiled, the scalar
// loops, and each step's products handed to the widest pass this build has (gguf_tiles_vnni.cc, _avx2.cc).
#include "gguf_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ggml.h"
#include "gguf_layout.h"
#include "row_norm.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jserve::gguf {
namespace {

using jserve::ggml::Half;

constexpr float kDigitRange = 2080768.0f;  // |v| ≤ 127·2¹⁴: c2 stays an int8, c1 and c0 within ±64

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

// The same products with plain loops (CPUs without AVX2): the same integer sums per half block,
// then y += (d·s)·(f0·Σ0 + f1·Σ1) and the minimum's term.
void ScalarRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
                const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
                float* y) {
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

}  // namespace

const char* Vectorized() { return VnniBuilt() ? "AVX-512 VNNI" : Avx2Built() ? "AVX2" : nullptr; }

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
  if (VnniBuilt()) {
    VnniRows(type, tiles, rows, tile_begin, tile_end, a, token_begin, token_end, outputs, first_row, y);
  } else if (Avx2Built()) {
    Avx2Rows(type, tiles, rows, tile_begin, tile_end, a, token_begin, token_end, outputs, first_row, y);
  } else {
    ScalarRows(type, tiles, rows, tile_begin, tile_end, a, token_begin, token_end, outputs, first_row, y);
  }
}

}  // namespace jserve::gguf

extern "C" const char* JserveGgufTilesVectorized() { return jserve::gguf::Vectorized(); }

// y [tokens, rows] = x [tokens, depth] · wᵀ for one tiled weight, outside XLA: lets the tests run a build
// compiled for another instruction set (or none: its scalar loops) against the kernel.
extern "C" void JserveGgufTilesProduct(int64_t type, const uint8_t* tiles, int64_t rows, int64_t depth,
                                       const float* x, int64_t tokens, float* y) {
  jserve::gguf::Activations a(tokens, depth);
  for (int64_t t = 0; t < tokens; ++t) jserve::gguf::Quantize(x + t * depth, t, &a);
  const int64_t tiles_count = (rows + jserve::gguf::kTileRows - 1) / jserve::gguf::kTileRows;
  jserve::gguf::TiledRows(type, tiles, rows, 0, tiles_count, a, 0, tokens, rows, 0, y);
}
