// The step's new K/V rows into their cache slots, in place (the pages are aliased to the results). XLA's
// scatter does this in place for float32 pages, but into bfloat16 pages XLA:CPU converts the whole cache
// to float32 and back for every write (208 ms for one layer's 246 MB of pages). Rows are float32; bfloat16
// pages get them rounded to nearest even, as XLA's convert rounds. Slots < 0 (padding) are skipped.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

uint16_t ToBfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void WriteRows(const float* rows, const int32_t* slots, int64_t count, int64_t row_size, int64_t num_slots,
               ffi::DataType type, void* pages) {
  for (int64_t t = 0; t < count; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;
    const float* row = rows + t * row_size;
    if (type == ffi::F32) {
      std::memcpy(static_cast<float*>(pages) + slot * row_size, row, row_size * sizeof(float));
    } else {
      uint16_t* out = static_cast<uint16_t*>(pages) + slot * row_size;
      for (int64_t i = 0; i < row_size; ++i) out[i] = ToBfloat16(row[i]);
    }
  }
}

// Arguments: K pages, V pages [pages, page_size, kv_heads, dim] (float32 or bfloat16), the new K and V
// [T, kv_heads, dim] float32, their slots [T]; results: the pages, aliased to the arguments.
ffi::Error WriteKv(ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_pages,
                   ffi::Result<ffi::AnyBuffer> v_pages) {
  const auto dims = k_pages->dimensions(), row_dims = k.dimensions();
  const ffi::DataType type = k_pages->element_type();
  if (dims.size() != 4 || row_dims.size() != 3 || v_pages->element_type() != type ||
      (type != ffi::F32 && type != ffi::BF16) || row_dims[1] != dims[2] || row_dims[2] != dims[3] ||
      v.element_count() != k.element_count() || slots.element_count() != row_dims[0] ||
      v_pages->element_count() != k_pages->element_count()) {
    return ffi::Error::InvalidArgument("write kv: float32 or bfloat16 pages [pages, page_size, kv_heads, dim], "
                                       "float32 rows [T, kv_heads, dim] and int32 slots [T]");
  }
  const int64_t row_size = dims[2] * dims[3], num_slots = dims[0] * dims[1];
  WriteRows(k.typed_data(), slots.typed_data(), row_dims[0], row_size, num_slots, type, k_pages->untyped_data());
  WriteRows(v.typed_data(), slots.typed_data(), row_dims[0], row_size, num_slots, type, v_pages->untyped_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
