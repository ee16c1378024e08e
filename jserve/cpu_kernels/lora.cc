// LoRA's two products for a step's tokens, each token with its own adapter slot (models/low_rank.py):
//   shrink: xa[t] = A[slot[t]] · x[t]     x [T, in], A [slots, W, in]  -> xa [T, W]
//           (x through the layer's RMSNorm first when its weight is given, as the projection's kernel does)
//   expand: y[t, offset:offset + out] += xa[t] · B[slot[t]]   xa [T, R], B [slots, R, out], y [T, Y]
// in place: y is the projection's output (a fused one's: each piece adds into its own columns), so nothing
// is added or concatenated after the kernel. A token without an adapter (slot < 0: the base model, or
// padding) gets zeros from shrink and is left as it is by expand, at no cost. XLA's
// matmuls would compute every slot for every token and read every slot's weights; here only the slots the
// step's tokens use are read, once per call: tokens are grouped by slot, and each weight row is multiplied
// against its group's tokens while it is in cache. A token's sums never depend on the other tokens of the
// step (each is its own dot product, in a fixed order), so a batch gives each request its solo result.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel.h"
#include "row_norm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A worker item: rows of A against a slot's tokens (both stay in cache while the item runs), or a block of
// outputs for a chunk of tokens; small enough that a decode step's few rows split over the cores.
constexpr int64_t kRowsPerItem = 8;
constexpr int64_t kTokensPerItem = 32;
constexpr int64_t kOutputsPerItem = 256;

constexpr int64_t kTokensPerPass = 4;     // tokens one pass over a row of A multiplies
constexpr int64_t kOutputsInRegisters = 64;

// A row of A times kTokensPerPass tokens' rows (x[k]; a group of fewer repeats its last token): the row is
// read once, and the sums are independent chains the core runs side by side. Every token's sum is formed
// in the same order whatever its group holds.
void Dots(const float* w, const float* const* x, int64_t n, float* sums) {
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  for (int64_t i = 0; i < n; ++i) {
    s0 += w[i] * x0[i];
    s1 += w[i] * x1[i];
    s2 += w[i] * x2[i];
    s3 += w[i] * x3[i];
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
}

// y[0:count] += Σ_r scale[r] · w[r, 0:count] (rows of w `stride` apart), the sums held in registers for a full
// block; each output adds its terms in r order either way.
template <int64_t kCount>
void AddRows(float* y, const float* scale, const float* w, int64_t rank, int64_t stride, int64_t count) {
  float acc[kCount ? kCount : kOutputsInRegisters];  // (a partial block: count < kOutputsInRegisters)
  for (int64_t j = 0; j < (kCount ? kCount : count); ++j) acc[j] = y[j];
  for (int64_t r = 0; r < rank; ++r) {
    const float* row = w + r * stride;
    for (int64_t j = 0; j < (kCount ? kCount : count); ++j) acc[j] += scale[r] * row[j];
  }
  for (int64_t j = 0; j < (kCount ? kCount : count); ++j) y[j] = acc[j];
}

// The step's tokens grouped by slot: groups[s] lists the tokens that read slot s.
std::vector<std::vector<int64_t>> GroupBySlot(const int32_t* slots, int64_t tokens, int64_t num_slots) {
  std::vector<std::vector<int64_t>> groups(num_slots);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && slots[t] < num_slots) groups[slots[t]].push_back(t);
  }
  return groups;
}

ffi::Error Shrink(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> norm,
                  ffi::Buffer<ffi::F32> a, ffi::Result<ffi::Buffer<ffi::F32>> out, float eps) {
  const auto x_dims = x.dimensions(), a_dims = a.dimensions();
  if (x_dims.size() != 2 || a_dims.size() != 3 || a_dims[2] != x_dims[1] || slots.element_count() != x_dims[0] ||
      (norm.element_count() != 0 && norm.element_count() != x_dims[1])) {
    return ffi::Error::InvalidArgument("lora shrink: x [T, in], slots [T], norm [in] or [0], A [slots, W, in]");
  }
  const int64_t tokens = x_dims[0], inputs = x_dims[1], num_slots = a_dims[0], width = a_dims[1];
  float* y = out->typed_data();
  std::fill(y, y + tokens * width, 0.0f);
  const auto groups = GroupBySlot(slots.typed_data(), tokens, num_slots);
  const float* xs = x.typed_data();
  std::vector<float> normed;  // the rows of tokens with an adapter, through the norm
  if (norm.element_count() != 0) {
    normed.resize(tokens * inputs);
    for (const auto& group : groups) {
      for (const int64_t t : group) {
        jserve::NormalizeRow(xs + t * inputs, inputs, norm.typed_data(), eps, &normed[t * inputs]);
      }
    }
    xs = normed.data();
  }
  struct Item {
    int64_t slot, first_row, first_token;  // first_token: an index into the slot's group
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t count = static_cast<int64_t>(groups[s].size());
    for (int64_t k = 0; k < count; k += kTokensPerItem) {
      for (int64_t row = 0; row < width; row += kRowsPerItem) items.push_back({s, row, k});
    }
  }
  const float* as = a.typed_data();
  jserve::ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item item = items[i];
    const auto& group = groups[item.slot];
    const int64_t end = std::min<int64_t>(item.first_token + kTokensPerItem, group.size());
    for (int64_t row = item.first_row; row < std::min(item.first_row + kRowsPerItem, width); ++row) {
      const float* weights = as + (item.slot * width + row) * inputs;
      for (int64_t k = item.first_token; k < end; k += kTokensPerPass) {
        const float* rows[kTokensPerPass];
        for (int64_t j = 0; j < kTokensPerPass; ++j) rows[j] = xs + group[std::min(k + j, end - 1)] * inputs;
        float sums[kTokensPerPass];
        Dots(weights, rows, inputs, sums);
        for (int64_t j = 0; j < kTokensPerPass && k + j < end; ++j) y[group[k + j] * width + row] = sums[j];
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error Expand(ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32> xa, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::F32> b, ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t offset) {
  const auto xa_dims = xa.dimensions(), b_dims = b.dimensions(), y_dims = out->dimensions();
  if (xa_dims.size() != 2 || b_dims.size() != 3 || y_dims.size() != 2 || b_dims[1] != xa_dims[1] ||
      slots.element_count() != xa_dims[0] || y_dims[0] != xa_dims[0] || offset < 0 ||
      offset + b_dims[2] > y_dims[1]) {
    return ffi::Error::InvalidArgument("lora expand: y [T, Y], xa [T, R], slots [T], B [slots, R, out], "
                                       "offset + out <= Y");
  }
  const int64_t tokens = xa_dims[0], rank = xa_dims[1], num_slots = b_dims[0], outputs = b_dims[2];
  const int64_t stride = y_dims[1];
  float* y = out->typed_data() + offset;
  const int32_t* token_slots = slots.typed_data();
  const float* xs = xa.typed_data();
  const float* bs = b.typed_data();
  if (std::none_of(token_slots, token_slots + tokens, [&](int32_t s) { return s >= 0 && s < num_slots; })) {
    return ffi::Error::Success();  // (no token has an adapter: y stays as it is)
  }
  const int64_t blocks = (outputs + kOutputsPerItem - 1) / kOutputsPerItem;
  jserve::ParallelFor(blocks * ((tokens + kTokensPerItem - 1) / kTokensPerItem), [&](int64_t item) {
    const int64_t block = item % blocks, first_token = item / blocks * kTokensPerItem;
    const int64_t first = block * kOutputsPerItem, last = std::min(first + kOutputsPerItem, outputs);
    for (int64_t t = first_token; t < std::min(first_token + kTokensPerItem, tokens); ++t) {
      const int64_t s = token_slots[t];
      if (s < 0 || s >= num_slots) continue;
      const float* weights = bs + s * rank * outputs;
      for (int64_t o = first; o < last; o += kOutputsInRegisters) {  // (along B's rows, in vectors)
        if (o + kOutputsInRegisters <= last) {
          AddRows<kOutputsInRegisters>(y + t * stride + o, xs + t * rank, weights + o, rank, outputs, 0);
        } else {
          AddRows<0>(y + t * stride + o, xs + t * rank, weights + o, rank, outputs, last - o);
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveLoraShrink, Shrink,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveLoraExpand, Expand,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("offset"));
