// int8 x int8 -> int32 matmul for decode-sized steps (up to 128 activation digit rows), which XLA:CPU's
// int8 dot runs on one thread each: a lone decode's at a fifth of memory speed. Integer sums are exact, so
// the result is bit for bit XLA's dot: the engine can pick either by step size without changing any output.
//
// With AVX-512 VNNI, vpdpbusd multiplies unsigned by signed bytes, 64 per instruction. The activations
// are made unsigned by adding 128, and 128 * (the weight row's sum) is taken off again; the row sums come
// from the same instruction against a vector of ones, so the weight is read once and needs no
// preparation. Work is split by output features over XLA's thread pool. Elsewhere a plain loop (the
// compiler vectorises it).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JSERVE_VNNI 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;  // activation rows per pass over the weight
// Multiply-adds per work item. A lone decode's projection (~3.5M) stays on one thread: splitting it over
// XLA's pool measured no faster (waking a helper costs about what it saves); larger ones split.
constexpr int64_t kWorkPerItem = int64_t{4} << 20;

#if JSERVE_VNNI
// out[r, o] for o in [begin, end), r < kRows; xu holds the rows + 128 as bytes, `stride` bytes apart.
template <int kRows>
void Block(const uint8_t* xu, int64_t stride, const int8_t* w, int64_t depth, int32_t* out, int64_t outputs,
           int64_t begin, int64_t end) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t full = depth / 64;
  const __mmask64 tail = depth % 64 ? (~0ULL >> (64 - depth % 64)) : 0;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* row = w + o * depth;
    __m512i acc[kRows], sum = _mm512_setzero_si512();
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_si512();
    _mm_prefetch(reinterpret_cast<const char*>(row + 8 * depth), _MM_HINT_T0);
    for (int64_t c = 0; c <= full; ++c) {
      if (c == full && !tail) break;
      const __m512i wv = c < full ? _mm512_loadu_si512(row + 64 * c) : _mm512_maskz_loadu_epi8(tail, row + 64 * c);
      sum = _mm512_dpbusd_epi32(sum, ones, wv);
      for (int r = 0; r < kRows; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(xu + r * stride + 64 * c), wv);
      }
    }
    const int32_t offset = 128 * _mm512_reduce_add_epi32(sum);
    for (int r = 0; r < kRows; ++r) out[r * outputs + o] = _mm512_reduce_add_epi32(acc[r]) - offset;
  }
}

using BlockFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*, int64_t, int64_t, int64_t);
constexpr BlockFn kBlocks[kMaxRows + 1] = {nullptr,   Block<1>, Block<2>, Block<3>, Block<4>,
                                           Block<5>,  Block<6>, Block<7>, Block<8>};
#endif

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::S32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1]) {
    return ffi::Error::InvalidArgument("int8 matmul: x [rows, in] and w [out, in] must share `in`");
  }
  const int64_t rows = x_dims[0], depth = x_dims[1], outputs = w_dims[0];
  const int8_t* xs = x.typed_data();
  const int8_t* ws = w.typed_data();
  int32_t* result = out->typed_data();
  const int64_t per_item = std::max<int64_t>(1, kWorkPerItem / std::max<int64_t>(rows * depth, 1));
  const int64_t items = (outputs + per_item - 1) / per_item;
#if JSERVE_VNNI
  const int64_t stride = (depth + 63) / 64 * 64;  // padded so whole 64-byte vectors can be read
  std::vector<uint8_t> xu(rows * stride, 0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t k = 0; k < depth; ++k) xu[i * stride + k] = static_cast<uint8_t>(xs[i * depth + k] + 128);
  }
  jserve::ParallelFor(pool, items, [&](int64_t item) {
    const int64_t begin = item * per_item, end = std::min(outputs, begin + per_item);
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int64_t n = std::min(kMaxRows, rows - r);
      kBlocks[n](xu.data() + r * stride, stride, ws, depth, result + r * outputs, outputs, begin, end);
    }
  });
#else
  jserve::ParallelFor(pool, items, [&](int64_t item) {
    const int64_t begin = item * per_item, end = std::min(outputs, begin + per_item);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = begin; o < end; ++o) {
        int32_t sum = 0;
        for (int64_t k = 0; k < depth; ++k) sum += int32_t(xs[r * depth + k]) * int32_t(ws[o * depth + k]);
        result[r * outputs + o] = sum;
      }
    }
  });
#endif
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
