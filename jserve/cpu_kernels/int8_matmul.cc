// int8 x int8 -> int32 matmul for a few rows: the weight-bound case (a lone decode, the LM head of one
// sequence), where XLA:CPU's int8 dot reads the weight at a few GB/s. Integer sums are exact, so the result
// is bit for bit the one XLA's dot gives: the engine can switch between them by batch size without changing
// any output.
//
// Each output feature's weight row is widened to int16 once and multiplied into every activation row with
// pairwise int16 products summed in int32 (AVX-512 VNNI or BW where compiled for; a plain loop elsewhere).

#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;        // activation rows kept in registers
constexpr int64_t kOutputBlock = 256;  // output features per work item

// out[r, o] = sum_i x[r, i] * w[o, i] for o in [begin, end); x16 is x widened to int16.
void MatmulBlock(const int8_t* x, const int16_t* x16, const int8_t* w, int32_t* out, int64_t rows, int64_t depth,
                 int64_t outputs, int64_t begin, int64_t end) {
  int64_t vector_depth = 0;
#if defined(__AVX512BW__)
  vector_depth = depth - depth % 32;
#endif
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* w_row = w + o * depth;
    int32_t sums[kMaxRows] = {};
#if defined(__AVX512BW__)
    __m512i acc[kMaxRows];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < vector_depth; i += 32) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + i)));
      for (int64_t r = 0; r < rows; ++r) {
        const __m512i xv = _mm512_loadu_si512(x16 + r * depth + i);
#if defined(__AVX512VNNI__)
        acc[r] = _mm512_dpwssd_epi32(acc[r], wv, xv);
#else
        acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(wv, xv));
#endif
      }
    }
    for (int64_t r = 0; r < rows; ++r) sums[r] = _mm512_reduce_add_epi32(acc[r]);
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* x_row = x + r * depth;
      int32_t sum = sums[r];
      for (int64_t i = vector_depth; i < depth; ++i) sum += int32_t(x_row[i]) * int32_t(w_row[i]);
      out[r * outputs + o] = sum;
    }
  }
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::S32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1]) {
    return ffi::Error::InvalidArgument("int8 matmul: x [rows, in] and w [out, in] must share `in`");
  }
  const int64_t rows = x_dims[0], depth = x_dims[1], outputs = w_dims[0];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("int8 matmul: at most 8 rows");
  const int8_t* xs = x.typed_data();
  const int8_t* ws = w.typed_data();
  int32_t* result = out->typed_data();
  std::vector<int16_t> x16(xs, xs + rows * depth);
  const int64_t blocks = (outputs + kOutputBlock - 1) / kOutputBlock;
  jserve::ParallelFor(pool, blocks, [&](int64_t b) {
    const int64_t begin = b * kOutputBlock, end = std::min(outputs, begin + kOutputBlock);
    MatmulBlock(xs, x16.data(), ws, result, rows, depth, outputs, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
