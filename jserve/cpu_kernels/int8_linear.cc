// y = x · wᵀ for float activations x [T, in] and an int8 weight w [out, in] with a float scale per output:
// quantization.py's schemes (q/k/v and gate/up come fused, one weight each: models/fused.py). With
// `group` 0 (--quantization int8) each row of x becomes two int8 digit rows (a coarse one and the residual
// it missed, each with a scale); with `group` 32 (w8a8) one digit row with a scale per 32 inputs, half
// the multiply-adds. The int8 × int8 sums are exact in int32, then floats. Each float step is an IEEE
// operation spelled with explicit rounding (so -ffast-math cannot fuse or reorder it): a token's output never
// depends on the other tokens of the step. XLA's ops compute the same except where XLA fuses a product
// and a sum into an FMA differently (about 1e-6 of a row).
//
// The weights come in quantization.py's tiles, [out / 16, in / 4, 16, 4]: the layout of AVX-512 VNNI's
// vpdpbusd, which multiplies 4 unsigned bytes by 4 signed ones into each of 16 int32 lanes. A tile of 16
// outputs is read once, front to back (one stream for the hardware prefetcher), against up to 16 digit rows
// held in registers; tiles measured 1.3-2x faster than reading rows and summing across lanes, from 1 to 64
// tokens (docs/benchmarks.md). The weight is made unsigned by flipping its sign bit (w + 128), and
// 128 · Σ digits is taken off again. Each pass over a tile prefetches its share of the next tile, so the
// memory stays busy through all of a tile's passes, not only the first. Work is split over the kernels'
// workers (parallel.h) by outputs and by tiles of tokens. Without AVX-512 VNNI the library says so
// (JserveInt8LinearSupported) and the weights stay in rows for XLA's ops.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "row_norm.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JSERVE_VNNI 1
#else
#define JSERVE_VNNI 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kOutputs = 16;      // outputs per tile (one vector of int32 sums)
constexpr int64_t kDepth = 4;         // inputs per line of a tile (vpdpbusd's 4 bytes per lane)
constexpr int64_t kGroup = 32;        // inputs per activation scale with `group` (and tiles' input padding)
constexpr int64_t kGroupLines = kGroup / kDepth;
constexpr int64_t kTokenTile = 64;    // tokens per work item: their digits stay in L2 while the weight streams
constexpr int64_t kTokensPerPass = 8; // tokens (8 or 16 digit rows, 16 accumulators) per pass over a tile
constexpr int64_t kRowsPerItem = 8;   // rows of x per work item of normalizing and quantizing
// Multiply-adds per work item: a lone decode's smallest projection (SmolLM2's 576 x 576) splits in five.
constexpr int64_t kWorkPerItem = int64_t{1} << 17;
constexpr int64_t kMinTiles = 8;  // per work item: each tile's loads prefetch the next one's

#if JSERVE_VNNI
// One token's activations as two int8 digit rows with their scales and digit sums.
struct Quantized {
  float scale[2];
  int32_t sum[2];
};

using jserve::Add;
using jserve::Div;
using jserve::kNearest;
using jserve::Lanes;
using jserve::NormalizeRow;

// x[0, depth) as digits (zero padded to `stride`): d = round(x / s) with s = max|x| / 127, twice.
Quantized QuantizeRow(const float* x, int64_t depth, int8_t* coarse, int8_t* fine, float* residual) {
  Quantized q;
  const float* in = x;
  int8_t* digits[2] = {coarse, fine};
  for (int pass = 0; pass < 2; ++pass) {
    __m512 top = _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; k += 16) {
      const __mmask16 m = Lanes(depth - k);
      top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, in + k)));
    }
    const float scale = Div(_mm512_reduce_max_ps(top), 127.0f);
    const __m512 divisor = _mm512_set1_ps(scale == 0.0f ? 1.0f : scale), s = _mm512_set1_ps(scale);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < depth; k += 16) {
      const __mmask16 m = Lanes(depth - k);
      const __m512 v = _mm512_maskz_loadu_ps(m, in + k);
      const __m512 d = _mm512_roundscale_ps(_mm512_div_round_ps(v, divisor, kNearest), kNearest);
      const __m512i di = _mm512_cvtps_epi32(d);
      sum = _mm512_add_epi32(sum, di);
      _mm_mask_storeu_epi8(digits[pass] + k, m, _mm512_cvtepi32_epi8(di));
      // XLA:CPU fuses this subtraction and product into one FMA; so does this.
      if (pass == 0) _mm512_mask_storeu_ps(residual + k, m, _mm512_fnmadd_round_ps(d, s, v, kNearest));
    }
    q.scale[pass] = scale;
    q.sum[pass] = _mm512_reduce_add_epi32(sum);
    in = residual;
  }
  return q;
}

// x[0, depth) as one digit row with a scale per kGroup inputs: d = round(x · (127 / m)) for the group's
// m = max|x|, scale m / 127 (a product, which XLA computes the same way; it turns x / s into x · (1 / s),
// which can land the other side of a rounding tie). init[h] = -128 · Σ of group h's digits, the sum the
// weights' sign flip adds to it.
void QuantizeGroups(const float* x, int64_t depth, int8_t* digits, float* scale, int32_t* init) {
  for (int64_t k = 0; k < depth; k += kGroup) {
    __m512 v[2];
    __mmask16 m[2];
    for (int i = 0; i < 2; ++i) {
      m[i] = Lanes(depth - k - 16 * i);
      v[i] = _mm512_maskz_loadu_ps(m[i], x + k + 16 * i);
    }
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const __m512 inverse = _mm512_set1_ps(top == 0.0f ? 0.0f : Div(127.0f, top));
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 2; ++i) {
      const __m512 d = _mm512_roundscale_ps(_mm512_mul_round_ps(v[i], inverse, kNearest), kNearest);
      const __m512i di = _mm512_cvtps_epi32(d);
      sum = _mm512_add_epi32(sum, di);
      _mm_mask_storeu_epi8(digits + k + 16 * i, m[i], _mm512_cvtepi32_epi8(di));
    }
    scale[k / kGroup] = Div(top, 127.0f);
    init[k / kGroup] = -128 * _mm512_reduce_add_epi32(sum);
  }
}

// acc + Σ of wv's unsigned bytes times the 4 signed bytes at `four`, per lane (vpdpbusd, `four` broadcast).
// Spelled in assembly: with the intrinsic, GCC 12 moves every accumulator to another register on each
// iteration (measured 1.3x slower).
inline __m512i Dot(__m512i acc, __m512i wv, const int8_t* four) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(wv), "m"(*reinterpret_cast<const int32_t*>(four)));
  return acc;
}

// Where a pass over a tile prefetches: `first` is its share of the next tile, and line g of the pass asks for
// line (g · step) >> 16 of it, step = 2^16 / passes: together the passes cover the next tile once.
struct Prefetch {
  const int8_t* first;
  int64_t step;
  const char* Line(int64_t g) const { return reinterpret_cast<const char*>(first + 64 * ((g * step) >> 16)); }
};

// y[t, o0 + j] for j < n ≤ 16 and kTokens tokens (digit rows 2t coarse and 2t + 1 fine) from one tile of
// 16 outputs: tile[g][j][0..3] is w[o0 + j][4g..4g+3], so one 64-byte load feeds 16 outputs and each digit
// row's 4 bytes are broadcast to meet it; every accumulator lane is one output's sum, with no reduction
// across lanes. The 2·kTokens accumulators stay in registers while the tile streams by once.
// Every loop over accumulators is unrolled, so that they stay in registers (indexed at run time, the array
// lives in memory, and the inner loop stores all 16 on every iteration: 3x slower).
template <int kTokens>
void Tile(const int8_t* digits, int64_t stride, const Quantized* q, const int8_t* tile, Prefetch prefetch,
          int64_t lines, const float* w_scale, int64_t outputs, int64_t o0, int64_t n, float* y) {
  constexpr int kRows = 2 * kTokens;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < lines; ++g) {
    _mm_prefetch(prefetch.Line(g), _MM_HINT_T0);
    const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * g), flip);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) acc[r] = Dot(acc[r], wv, digits + r * stride + 4 * g);
  }
  const __mmask16 m = Lanes(n);
  const __m512 ws = _mm512_maskz_loadu_ps(m, w_scale + o0);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    __m512 sums[2];
#pragma GCC unroll 2
    for (int d = 0; d < 2; ++d) {
      sums[d] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * t + d], _mm512_set1_epi32(128 * q[t].sum[d])));
    }
    // (coarse · s1 + fine · s2) · w_scale, with the first product and the sum as one FMA, as XLA:CPU fuses it.
    const __m512 fine = _mm512_mul_round_ps(sums[1], _mm512_set1_ps(q[t].scale[1]), kNearest);
    const __m512 both = _mm512_fmadd_round_ps(sums[0], _mm512_set1_ps(q[t].scale[0]), fine, kNearest);
    const __m512 out = _mm512_mul_round_ps(both, ws, kNearest);
    _mm512_mask_storeu_ps(y + t * outputs + o0, m, out);
  }
}

// The same with one digit row per token and a scale per kGroup inputs (kGroupLines lines): each group's
// int32 sums start at init (-128 · its digit sum) and go into float accumulators, scaled, at its end. With
// one or two tokens the sums alternate between chains of accumulators, so vpdpbusd's latency overlaps.
template <int kTokens>
void GroupTile(const int8_t* digits, int64_t stride, const float* scale, const int32_t* init, int64_t groups,
               const int8_t* tile, Prefetch prefetch, const float* w_scale, int64_t outputs, int64_t o0, int64_t n,
               float* y) {
  constexpr int kChains = kTokens == 1 ? 4 : kTokens == 2 ? 2 : 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 sums[kTokens];
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) sums[t] = _mm512_setzero_ps();
  for (int64_t h = 0; h < groups; ++h) {
    __m512i acc[kTokens * kChains];
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      acc[t * kChains] = _mm512_set1_epi32(init[t * groups + h]);
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) acc[t * kChains + c] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < kGroupLines; ++i) {
      const int64_t g = h * kGroupLines + i;
      _mm_prefetch(prefetch.Line(g), _MM_HINT_T0);
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * g), flip);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        acc[t * kChains + i % kChains] = Dot(acc[t * kChains + i % kChains], wv, digits + t * stride + 4 * g);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      __m512i a = acc[t * kChains];
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) a = _mm512_add_epi32(a, acc[t * kChains + c]);
      sums[t] = _mm512_fmadd_round_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(scale[t * groups + h]), sums[t], kNearest);
    }
  }
  const __mmask16 m = Lanes(n);
  const __m512 ws = _mm512_maskz_loadu_ps(m, w_scale + o0);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    _mm512_mask_storeu_ps(y + t * outputs + o0, m, _mm512_mul_round_ps(sums[t], ws, kNearest));
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const Quantized*, const int8_t*, Prefetch, int64_t,
                        const float*, int64_t, int64_t, int64_t, float*);
constexpr TileFn kTiles[kTokensPerPass + 1] = {nullptr,  Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                               Tile<5>, Tile<6>, Tile<7>, Tile<8>};
using GroupTileFn = void (*)(const int8_t*, int64_t, const float*, const int32_t*, int64_t, const int8_t*,
                             Prefetch, const float*, int64_t, int64_t, int64_t, float*);
constexpr GroupTileFn kGroupTiles[kTokensPerPass + 1] = {
    nullptr, GroupTile<1>, GroupTile<2>, GroupTile<3>, GroupTile<4>, GroupTile<5>, GroupTile<6>, GroupTile<7>,
    GroupTile<8>};
#endif

// y = norm(x) · wᵀ. Arguments x, the number of x's leading rows that are real (the rest is a step's
// padding: its outputs are zeros, computed by nobody), the RMSNorm weight applied to x first (or none: [0]),
// the tiled weight w and its scales; the result y. Attribute `group`: 0 for two digits per row, kGroup for
// one digit per kGroup inputs.
ffi::Error Int8Linear(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> real_rows, ffi::Buffer<ffi::F32> norm,
                      ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y,
                      float eps, int64_t group) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || real_rows.element_count() != 1 ||
      (norm.element_count() != 0 && norm.element_count() != x_dims[1])) {
    return ffi::Error::InvalidArgument("int8 linear: needs x [tokens, in], its real row count [1], a norm weight "
                                       "[in] or [0], then the weight and its scales");
  }
  if (group != 0 && group != kGroup) return ffi::Error::InvalidArgument("int8 linear: group must be 0 or 32");
  const int64_t rows = x_dims[0], depth = x_dims[1], groups = (depth + kGroup - 1) / kGroup;
  const int64_t lines = groups * kGroupLines;  // tiles pad the inputs to whole groups
  const int64_t tokens = std::clamp<int64_t>(real_rows.typed_data()[0], 0, rows);
  const int64_t outputs = w_scale.element_count();
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 4 || w_dims[0] != (outputs + kOutputs - 1) / kOutputs || w_dims[1] != lines ||
      w_dims[2] != kOutputs || w_dims[3] != kDepth || y->element_count() != rows * outputs) {
    return ffi::Error::InvalidArgument("int8 linear: the weight must be tiled [out/16, in/4, 16, 4] (out "
                                       "rounded up to 16, in to 32) with out float32 scales");
  }
  float* out = y->typed_data();
  std::fill(out + tokens * outputs, out + rows * outputs, 0.0f);
  if (tokens == 0) return ffi::Error::Success();
#if JSERVE_VNNI
  const int64_t digit_rows = group ? 1 : 2;  // per token
  const int64_t stride = (depth + 63) / 64 * 64;  // QuantizeRow writes whole vectors; zeros past depth
  std::vector<int8_t> digits(digit_rows * tokens * stride, 0);
  std::vector<Quantized> quantized(group ? 0 : tokens);
  std::vector<float> group_scale(group ? tokens * groups : 0);
  std::vector<int32_t> group_init(group ? tokens * groups : 0);
  const int64_t row_items = (tokens + kRowsPerItem - 1) / kRowsPerItem;
  const float* norm_weight = norm.element_count() ? norm.typed_data() : nullptr;
  jserve::ParallelFor(row_items, [&](int64_t item) {
    std::vector<float> residual(group ? 0 : depth), normed(norm_weight ? depth : 0);
    for (int64_t t = item * kRowsPerItem; t < std::min(tokens, (item + 1) * kRowsPerItem); ++t) {
      const float* row_x = x.typed_data() + t * depth;
      if (norm_weight) {
        NormalizeRow(row_x, depth, norm_weight, eps, normed.data());
        row_x = normed.data();
      }
      int8_t* row = digits.data() + digit_rows * t * stride;
      if (group) {
        QuantizeGroups(row_x, depth, row, group_scale.data() + t * groups, group_init.data() + t * groups);
      } else {
        quantized[t] = QuantizeRow(row_x, depth, row, row + stride, residual.data());
      }
    }
  });
  // Work items: (first output, tile of tokens), each about kWorkPerItem multiply-adds.
  struct Item {
    int64_t o_begin, o_end, t_begin;
  };
  const int64_t tile_tokens = std::min(tokens, kTokenTile);
  const int64_t per_item = std::max<int64_t>(
      kMinTiles * kOutputs, kWorkPerItem / (digit_rows * tile_tokens * depth) / kOutputs * kOutputs);
  std::vector<Item> items;
  for (int64_t t = 0; t < tokens; t += kTokenTile) {
    for (int64_t o = 0; o < outputs; o += per_item) items.push_back({o, std::min(outputs, o + per_item), t});
  }
  const int64_t tile_bytes = lines * kDepth * kOutputs;
  jserve::ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const int64_t t_end = std::min(tokens, item.t_begin + kTokenTile);
    const int64_t passes = (t_end - item.t_begin + kTokensPerPass - 1) / kTokensPerPass;
    const int64_t step = ((int64_t{1} << 16) + passes - 1) / passes;
    for (int64_t o0 = item.o_begin; o0 < item.o_end; o0 += kOutputs) {
      const int8_t* tile = w.typed_data() + o0 / kOutputs * tile_bytes;
      const int8_t* next = o0 + kOutputs < item.o_end ? tile + tile_bytes : tile;  // the last asks for itself
      const int64_t n = std::min(kOutputs, item.o_end - o0);
      for (int64_t t = item.t_begin, pass = 0; t < t_end; t += kTokensPerPass, ++pass) {
        const int64_t count = std::min(kTokensPerPass, t_end - t);
        const Prefetch prefetch{next + 64 * (pass * lines / passes), step};
        float* y_rows = out + t * outputs;
        if (group) {
          kGroupTiles[count](digits.data() + t * stride, stride, group_scale.data() + t * groups,
                             group_init.data() + t * groups, groups, tile, prefetch, w_scale.typed_data(), outputs,
                             o0, n, y_rows);
        } else {
          kTiles[count](digits.data() + 2 * t * stride, stride, quantized.data() + t, tile, prefetch, lines,
                        w_scale.typed_data(), outputs, o0, n, y_rows);
        }
      }
    }
  });
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "int8 linear: this build has no AVX-512 VNNI");
#endif
}

}  // namespace

extern "C" int JserveInt8LinearSupported() { return JSERVE_VNNI; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveInt8Linear, Int8Linear,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("group"));
