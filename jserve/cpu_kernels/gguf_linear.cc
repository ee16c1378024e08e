// y = norm(x) · wᵀ for float activations x [T, in] and a weight kept in llama.cpp's GGUF block formats:
// the checkpoint's own bytes, so a step reads as many weight bytes as the file holds (Q4_1: 0.56 bytes a
// weight, against float32's 4) and multiplies exactly the checkpoint's weights.
//
// Formats (ggml's layouts): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in blocks of 32 weights, and the K-quants Q4_K,
// Q5_K, Q6_K in super-blocks of 256. A weight may be several segments of rows, each in its own format
// (a fused q/k/v whose pieces the file stores differently), given as the attributes `types` and `rows`;
// its bytes are the segments' bytes back to back, each segment in tiles of 16 rows, multiplied by integer
// dot products against the inputs written as integer digits (gguf_tiles.h). Work items are runs of tiles
// within a segment and of tokens within the step. Rows are also looked up one at a time (an embedding),
// dequantized here as gguf-py dequantizes them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml.h"
#include "gguf_tiles.h"
#include "parallel.h"
#include "row_norm.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define JSERVE_AVX512 1
#else
#define JSERVE_AVX512 0
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jserve::ggml;  // type ids and Half

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

bool FormatOf(int64_t type, Format* format) {
  switch (type) {
    case kQ4_0: *format = {32, 18}; return true;
    case kQ4_1: *format = {32, 20}; return true;
    case kQ5_0: *format = {32, 22}; return true;
    case kQ5_1: *format = {32, 24}; return true;
    case kQ8_0: *format = {32, 34}; return true;
    case kQ4_K: *format = {256, 144}; return true;
    case kQ5_K: *format = {256, 176}; return true;
    case kQ6_K: *format = {256, 210}; return true;
    default: return false;
  }
}

uint32_t Word(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if JSERVE_AVX512
// The float steps with explicit rounding, so that -ffast-math fuses nothing: each weight is the product
// and sum gguf-py computes, bit for bit.
using jserve::kNearest;
__m512 Mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kNearest); }
__m512 Add(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, kNearest); }
__m512 Sub(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, kNearest); }

// 16 unsigned / signed bytes as floats.
__m512 Unsigned(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }
__m512 Signed(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
__m128i Low(__m128i bytes) { return _mm_and_si128(bytes, _mm_set1_epi8(0x0F)); }
__m128i High(__m128i bytes) { return _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F)); }
__m128i Load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Weights [32 i, 32 i + 32) of a row in format kType as two vectors: the formats most files use; the
// others take DequantizeRow's scalar loops.
template <int64_t kType>
inline void Dequant32(const uint8_t* row, int64_t i, __m512* w) {
  if constexpr (kType == kQ4_0) {
    const uint8_t* p = row + 18 * i;
    const __m512 d = _mm512_set1_ps(Half(p)), eight = _mm512_set1_ps(8.0f);
    const __m128i qs = Load16(p + 2);
    w[0] = Mul(d, Sub(Unsigned(Low(qs)), eight));
    w[1] = Mul(d, Sub(Unsigned(High(qs)), eight));
  } else if constexpr (kType == kQ4_1) {
    const uint8_t* p = row + 20 * i;
    const __m512 d = _mm512_set1_ps(Half(p)), m = _mm512_set1_ps(Half(p + 2));
    const __m128i qs = Load16(p + 4);
    w[0] = Add(Mul(d, Unsigned(Low(qs))), m);
    w[1] = Add(Mul(d, Unsigned(High(qs))), m);
  } else if constexpr (kType == kQ8_0) {
    const uint8_t* p = row + 34 * i;
    const __m512 d = _mm512_set1_ps(Half(p));
    w[0] = Mul(d, Signed(Load16(p + 2)));
    w[1] = Mul(d, Signed(Load16(p + 18)));
  } else if constexpr (kType == kQ4_K) {  // sub-block j of 8: the low (even j) or high nibbles of 32 bytes
    const uint8_t* p = row + 144 * (i / 8);
    const int j = static_cast<int>(i % 8);
    uint8_t sc, mn;
    jserve::ggml::ScaleMin(j, p + 4, &sc, &mn);
    const __m512 d = _mm512_set1_ps(Half(p) * sc), m = _mm512_set1_ps(Half(p + 2) * mn);
    const uint8_t* q = p + 16 + 32 * (j / 2);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = Load16(q + 16 * half);
      w[half] = Sub(Mul(d, Unsigned(j % 2 ? High(bytes) : Low(bytes))), m);
    }
  } else if constexpr (kType == kQ6_K) {  // group j of 4 in half h: 32 weights, 16 positions per scale
    const uint8_t* p = row + 210 * (i / 8);
    const int h = static_cast<int>(i % 8) / 4, j = static_cast<int>(i % 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * h;
    const float d = Half(p + 208);
    const uint8_t* ql = p + 64 * h + 32 * (j % 2);
    const uint8_t* qh = p + 128 + 32 * h;
    for (int is = 0; is < 2; ++is) {
      const __m128i lows = j < 2 ? Low(Load16(ql + 16 * is)) : High(Load16(ql + 16 * is));
      const __m128i bits = _mm_and_si128(_mm_srli_epi16(Load16(qh + 16 * is), 2 * j), _mm_set1_epi8(3));
      const __m128i q = _mm_sub_epi8(_mm_or_si128(lows, _mm_slli_epi16(bits, 4)), _mm_set1_epi8(32));
      w[is] = Mul(_mm512_set1_ps(d * static_cast<float>(sc[is + 2 * j])), Signed(q));
    }
  }
}

template <int64_t kType>
void DequantizeVectors(const uint8_t* row, int64_t blocks32, float* out) {
  for (int64_t i = 0; i < blocks32; ++i) {
    __m512 w[2];
    Dequant32<kType>(row, i, w);
    _mm512_storeu_ps(out + 32 * i, w[0]);
    _mm512_storeu_ps(out + 32 * i + 16, w[1]);
  }
}

bool DequantizeRowVectors(int64_t type, const uint8_t* in, int64_t blocks, float* out) {
  switch (type) {
    case kQ4_0: DequantizeVectors<kQ4_0>(in, blocks, out); return true;
    case kQ4_1: DequantizeVectors<kQ4_1>(in, blocks, out); return true;
    case kQ8_0: DequantizeVectors<kQ8_0>(in, blocks, out); return true;
    case kQ4_K: DequantizeVectors<kQ4_K>(in, 8 * blocks, out); return true;
    case kQ6_K: DequantizeVectors<kQ6_K>(in, 8 * blocks, out); return true;
    default: return false;
  }
}
#endif

// One row of `blocks` blocks of `type` at `in` into floats `out` (as gguf-py's dequantize computes them).
void DequantizeRow(int64_t type, const uint8_t* in, int64_t blocks, float* out) {
#if JSERVE_AVX512
  if (DequantizeRowVectors(type, in, blocks, out)) return;
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    switch (type) {
      case kQ4_0: {
        const uint8_t* p = in + 18 * b;
        const float d = Half(p);
        const uint8_t* qs = p + 2;
        float* y = out + 32 * b;
        for (int j = 0; j < 16; ++j) {
          y[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
          y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
        }
        break;
      }
      case kQ4_1: {
        const uint8_t* p = in + 20 * b;
        const float d = Half(p), m = Half(p + 2);
        const uint8_t* qs = p + 4;
        float* y = out + 32 * b;
        for (int j = 0; j < 16; ++j) {
          y[j] = d * static_cast<float>(qs[j] & 0xF) + m;
          y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
        }
        break;
      }
      case kQ5_0: {
        const uint8_t* p = in + 22 * b;
        const float d = Half(p);
        const uint32_t qh = Word(p + 2);
        const uint8_t* qs = p + 6;
        float* y = out + 32 * b;
        for (int j = 0; j < 16; ++j) {
          y[j] = d * static_cast<float>(static_cast<int>((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
          y[j + 16] = d * static_cast<float>(static_cast<int>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
        break;
      }
      case kQ5_1: {
        const uint8_t* p = in + 24 * b;
        const float d = Half(p), m = Half(p + 2);
        const uint32_t qh = Word(p + 4);
        const uint8_t* qs = p + 8;
        float* y = out + 32 * b;
        for (int j = 0; j < 16; ++j) {
          y[j] = d * static_cast<float>((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) + m;
          y[j + 16] = d * static_cast<float>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
        }
        break;
      }
      case kQ8_0: {
        const uint8_t* p = in + 34 * b;
        const float d = Half(p);
        const int8_t* qs = reinterpret_cast<const int8_t*>(p + 2);
        float* y = out + 32 * b;
        for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(qs[j]);
        break;
      }
      case kQ4_K:
      case kQ5_K: {
        const bool five = type == kQ5_K;
        const uint8_t* p = in + (five ? 176 : 144) * b;
        const float d = Half(p), dmin = Half(p + 2);
        const uint8_t* scales = p + 4;
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (five ? 48 : 16);
        float* y = out + 256 * b;
        for (int chunk = 0; chunk < 4; ++chunk) {  // 64 weights: the low nibbles of 32 bytes, then the high ones
          uint8_t sc[2], mn[2];
          jserve::ggml::ScaleMin(2 * chunk, scales, &sc[0], &mn[0]);
          jserve::ggml::ScaleMin(2 * chunk + 1, scales, &sc[1], &mn[1]);
          const float d1 = d * sc[0], m1 = dmin * mn[0], d2 = d * sc[1], m2 = dmin * mn[1];
          const uint8_t* q = qs + 32 * chunk;
          for (int l = 0; l < 32; ++l) {
            int lo = q[l] & 0xF, hi = q[l] >> 4;
            if (five) {
              lo |= ((qh[l] >> (2 * chunk)) & 1) << 4;
              hi |= ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
            }
            y[64 * chunk + l] = d1 * static_cast<float>(lo) - m1;
            y[64 * chunk + 32 + l] = d2 * static_cast<float>(hi) - m2;
          }
        }
        break;
      }
      case kQ6_K: {
        const uint8_t* p = in + 210 * b;
        const uint8_t* ql = p;
        const uint8_t* qh = p + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        const float d = Half(p + 208);
        float* y = out + 256 * b;
        for (int half = 0; half < 2; ++half) {  // 128 weights from 64 low-nibble bytes and 32 high-bit bytes
          const uint8_t* l4 = ql + 64 * half;
          const uint8_t* h2 = qh + 32 * half;
          const int8_t* s = sc + 8 * half;
          float* out128 = y + 128 * half;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((l4[l] & 0xF) | (((h2[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
            out128[l] = d * static_cast<float>(s[is]) * static_cast<float>(q1);
            out128[l + 32] = d * static_cast<float>(s[is + 2]) * static_cast<float>(q2);
            out128[l + 64] = d * static_cast<float>(s[is + 4]) * static_cast<float>(q3);
            out128[l + 96] = d * static_cast<float>(s[is + 6]) * static_cast<float>(q4);
          }
        }
        break;
      }
    }
  }
}

constexpr int64_t kRowsPerNorm = 8;
constexpr int64_t kTokenTile = 64;  // tokens per work item: their digits stay in L2
constexpr int64_t kWorkPerItem = int64_t{1} << 17;  // multiply-adds per work item

// A weight's runs of rows, each in one format: where its rows and bytes start.
struct Segment {
  int64_t type, rows, first_row, offset;
};

// The segments of a weight of rows `depth` weights long from the `types` and `rows` attributes, with the
// total rows and bytes; false if a type is unknown or its blocks do not tile `depth`.
bool ParseSegments(ffi::Span<const int64_t> types, ffi::Span<const int64_t> rows, int64_t depth,
                   std::vector<Segment>* segments, int64_t* outputs, int64_t* bytes) {
  *outputs = *bytes = 0;
  for (size_t s = 0; s < types.size(); ++s) {
    Format format;
    if (!FormatOf(types[s], &format) || depth % format.block) return false;
    segments->push_back({types[s], rows[s], *outputs, *bytes});
    *outputs += rows[s];
    *bytes += jserve::gguf::SegmentBytes(rows[s], depth / format.block * format.bytes);
  }
  return true;
}

// y = norm(x) · wᵀ. Arguments x, the number of x's leading rows that are real (the rest is a step's padding:
// its outputs are zeros), the RMSNorm weight applied to x first (or none: [0]), the weight's bytes; the
// result y. Attributes: eps, and per segment of rows its ggml type and row count.
ffi::Error GgufLinear(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> real_rows, ffi::Buffer<ffi::F32> norm,
                      ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y, float eps, ffi::Span<const int64_t> types,
                      ffi::Span<const int64_t> rows) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || real_rows.element_count() != 1 ||
      (norm.element_count() != 0 && norm.element_count() != x_dims[1]) || types.size() != rows.size()) {
    return ffi::Error::InvalidArgument("gguf linear: needs x [tokens, in], its real row count [1], a norm weight "
                                       "[in] or [0], the weight's bytes, and a type and row count per segment");
  }
  const int64_t count = x_dims[0], depth = x_dims[1];
  std::vector<Segment> segments;
  int64_t outputs, bytes;
  if (!ParseSegments(types, rows, depth, &segments, &outputs, &bytes)) {
    return ffi::Error::InvalidArgument("gguf linear: unsupported type, or inputs not a whole number of blocks");
  }
  if (bytes != static_cast<int64_t>(w.element_count()) || y->element_count() != count * outputs) {
    return ffi::Error::InvalidArgument("gguf linear: the weight's bytes or the result's size do not match");
  }
  const int64_t tokens = std::clamp<int64_t>(real_rows.typed_data()[0], 0, count);
  float* out = y->typed_data();
  std::fill(out + tokens * outputs, out + count * outputs, 0.0f);
  if (tokens == 0) return ffi::Error::Success();

  // The inputs, normalized if asked, as integer digits (gguf_tiles.h).
  const float* norm_weight = norm.element_count() ? norm.typed_data() : nullptr;
  jserve::gguf::Activations activations(tokens, depth);
  jserve::ParallelFor((tokens + kRowsPerNorm - 1) / kRowsPerNorm, [&](int64_t item) {
    thread_local std::vector<float> normed;
    normed.resize(depth);
    for (int64_t t = item * kRowsPerNorm; t < std::min(tokens, (item + 1) * kRowsPerNorm); ++t) {
      const float* row = x.typed_data() + t * depth;
      if (norm_weight) {
        jserve::NormalizeRow(row, depth, norm_weight, eps, normed.data());
        row = normed.data();
      }
      jserve::gguf::Quantize(row, t, &activations);
    }
  });
  // Work items: runs of whole tiles within one segment and of up to kTokenTile tokens, about kWorkPerItem
  // multiply-adds each.
  struct Item {
    int64_t segment, tile_begin, tile_end, token_begin, token_end;
  };
  std::vector<Item> items;
  constexpr int64_t kTile = jserve::gguf::kTileRows;
  const int64_t tiles_per_item = std::max<int64_t>(1, kWorkPerItem / (std::min(tokens, kTokenTile) * depth) / kTile);
  for (size_t s = 0; s < segments.size(); ++s) {
    const int64_t tiles = (segments[s].rows + kTile - 1) / kTile;
    for (int64_t t = 0; t < tokens; t += kTokenTile) {
      for (int64_t tile = 0; tile < tiles; tile += tiles_per_item) {
        items.push_back({static_cast<int64_t>(s), tile, std::min(tiles, tile + tiles_per_item), t,
                         std::min(tokens, t + kTokenTile)});
      }
    }
  }
  const uint8_t* weight = w.typed_data();
  jserve::ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const Segment& segment = segments[item.segment];
    jserve::gguf::TiledRows(segment.type, weight + segment.offset, segment.rows, item.tile_begin, item.tile_end,
                            activations, item.token_begin, item.token_end, outputs, segment.first_row, out);
  });
  return ffi::Error::Success();
}

// Rows `ids` of a table in one GGUF type, dequantized: the embedding lookup of a GGUF-native model.
ffi::Error GgufRows(ffi::Buffer<ffi::U8> table, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y,
                    int64_t type) {
  Format format;
  const auto y_dims = y->dimensions();
  if (!FormatOf(type, &format) || y_dims.size() != 2 || y_dims[0] != ids.element_count() ||
      y_dims[1] % format.block) {
    return ffi::Error::InvalidArgument("gguf rows: unsupported type, or the result is not [ids, whole blocks]");
  }
  const int64_t depth = y_dims[1], blocks = depth / format.block, row_bytes = blocks * format.bytes;
  const int64_t table_rows = static_cast<int64_t>(table.element_count()) / row_bytes;
  std::vector<uint8_t> row(row_bytes);  // the row back in ggml's block layout
  for (int64_t i = 0; i < ids.element_count(); ++i) {
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[i], 0, table_rows - 1);  // as XLA's gather clamps
    jserve::gguf::UntileRow(type, table.typed_data(), id, blocks, row.data());
    DequantizeRow(type, row.data(), blocks, y->typed_data() + i * depth);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveGgufLinear, GgufLinear,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<ffi::Span<const int64_t>>("types")
                                  .Attr<ffi::Span<const int64_t>>("rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveGgufRows, GgufRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type"));
