// Ragged paged attention for CPUs: the contract of jserve/attention/backend.py as an XLA FFI custom call.
//
// XLA:CPU has no fused gather-matmul, so the plain-JAX reference copies every K/V block it gathers and then
// reads it again. Here each key is read once, straight from its page. A work item is a block of up to
// kQueryBlock query tokens of one sequence, with all their heads, so every page is read whole and in order;
// it walks its causal key range a tile of kLanes keys at a time with an online softmax, in key blocks of
// fixed positions whose softmaxes are folded together in order (kKeyBlock). Pages are float32 or bfloat16
// (--kv-cache-dtype bfloat16: half the bytes to read; the math stays float32). Items are spread over the
// kernels' worker threads (parallel.h), and when there are fewer items than threads (a lone decode), their key
// blocks are. Measured against the reference: docs/benchmarks.md.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryBlock = 16;  // query tokens of one sequence in one work item
// Keys are attended in blocks at fixed positions ([0, kKeyBlock), [kKeyBlock, 2 kKeyBlock), ...), each block's
// softmax apart, and the blocks folded together in key order (FoldBlock): so a row's result depends only on its
// own keys, never on its step's other rows, sequences or chunking, whether its item's blocks run one after
// another on one thread or, when there are fewer items than threads (a lone decode), spread over them.
constexpr int kKeyBlock = 128;
constexpr float kMaskValue = -1e30f;
constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead Attend asks for keys and values

struct Problem {
  const float* q;  // [tokens, heads, dim]
  const void* k;   // [pages, page_size, kv_heads, dim], float32 or bfloat16
  const void* v;
  const int32_t* context_lens;     // [seqs]
  const int32_t* page_tables;      // [seqs, max_pages]
  const int32_t* query_start_loc;  // [seqs + 1]
  float* out;                      // [tokens, heads, dim]
  int64_t heads, kv_heads, dim, page_size, max_pages;
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
};

struct WorkItem {
  int32_t seq, first, count;  // query tokens [first, first + count) of `seq`, every head
  int64_t key_begin, key_end;  // the keys it attends: all the item's, or one key block of them
  // Where it leaves its one block's partial result (a SoftmaxState) for MergeBlocks, or -1: it attends all its
  // keys and writes out.
  int64_t partial;
};

// Softmax state of rows (a key block's partial, or the fold of blocks so far) in one buffer of rows * (dim + 2)
// floats: the unnormalised weighted sum of values [rows][dim], the max [rows], the denominator [rows].
struct SoftmaxState {
  float* sum;
  float* max;
  float* denom;

  static int64_t Size(int64_t rows, int64_t dim) { return rows * (dim + 2); }
  static SoftmaxState In(float* buffer, int64_t rows, int64_t dim) {
    return {buffer, buffer + rows * dim, buffer + rows * (dim + 1)};
  }
  // Nothing seen yet: what folding a first block into gives back that block's own values.
  static SoftmaxState Empty(std::vector<float>& buffer, int64_t rows, int64_t dim) {
    buffer.assign(Size(rows, dim), 0.0f);
    SoftmaxState state = In(buffer.data(), rows, dim);
    std::fill(state.max, state.max + rows, kMaskValue);
    return state;
  }
};

// The attention output of each row: its folded sum over its denominator (zeros for a row that saw no key).
__attribute__((noinline)) void WriteNormalised(int64_t rows, int64_t dim, const float* denom, const float* sum,
                                               float* out) {
  for (int64_t m = 0; m < rows; ++m) {
    const float inv = denom[m] > 0.0f ? 1.0f / denom[m] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) out[m * dim + d] = sum[m * dim + d] * inv;
  }
}

// Portable SIMD through GCC/Clang vector extensions, a register wide: 16 float lanes with AVX-512, else 8
// (AVX2's; on it, 16-lane vectors would be split in two and their cross-lane shuffles cost the kernel half
// its speed). A tile holds kLanes keys.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(4 * kLanes), aligned(4)));  // aligned(4): unaligned loads are fine
typedef int32_t IVec __attribute__((vector_size(4 * kLanes), aligned(4)));
#if defined(__AVX512F__)
constexpr IVec kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr IVec kIota = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

// One head_dim chunk of a K/V row as floats: float32 pages as they are; bfloat16 is a float32's high half.
inline Vec LoadRow(const float* row) { return *reinterpret_cast<const Vec*>(row); }
inline Vec LoadRow(const uint16_t* row) {
#if defined(__AVX512F__)
  // GCC splits the generic conversion below into four 128-bit pieces; this is one widening load and a shift.
  return (Vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))), 16);
#else
  typedef uint16_t Halves __attribute__((vector_size(2 * kLanes), aligned(2)));
  return (Vec)(__builtin_convertvector(*reinterpret_cast<const Halves*>(row), IVec) << 16);
#endif
}

// A key's slot (every KV head's row) as float32: float32 pages in place; bfloat16 ones widened into `wide`
// once per tile, so each row then feeds its whole GQA group of heads without being converted again.
inline const float* Widened(const float* slot, int64_t, float*) { return slot; }
inline const float* Widened(const uint16_t* slot, int64_t slot_size, float* wide) {
  for (int64_t i = 0; i < slot_size; i += kLanes) *reinterpret_cast<Vec*>(wide + i) = LoadRow(slot + i);
  return wide;
}

#if defined(__AVX512F__)
inline float Sum(Vec v) {
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Lane j's place in SumEach's result: j's 4 bits reversed.
constexpr int BitReverse(int j) { return ((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3); }

// 16 vectors -> one vector of their sums, lane k holding the sum of v[BitReverse(k)] (a tree of shuffles
// and adds: a third of the work of 16 separate sums). Callers put key j's vector at BitReverse(j).
inline Vec SumEach(const Vec* v) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
inline float Sum(Vec v) {
  typedef float Half __attribute__((vector_size(16)));
  Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (h[0] + h[2]) + (h[1] + h[3]);
}

// Lane j's place in SumEach's result: j's 3 bits reversed.
constexpr int BitReverse(int j) { return ((j & 1) << 2) | (j & 2) | ((j & 4) >> 2); }

// 8 vectors -> one vector of their sums, lane k holding the sum of v[BitReverse(k)] (the 16-lane tree, a
// level shorter). Callers put key j's vector at BitReverse(j).
inline Vec SumEach(const Vec* v) {
  Vec a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(b[0], b[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

inline float Max(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e), the fraction by a degree-6 polynomial
// (relative error ~2e-7), the integer part in the exponent bits; below -126 * ln 2 it is 0.
inline Vec Exp(Vec x) {
  const Vec t = x * 1.44269504088896341f;
  const Vec clamped = t < -126.0f ? Vec{} - 126.0f : t;
  IVec whole = __builtin_convertvector(clamped, IVec);  // truncates toward zero: floor for the negatives
  whole -= clamped < __builtin_convertvector(whole, Vec) ? 1 : 0;
  const Vec f = clamped - __builtin_convertvector(whole, Vec);  // in [0, 1)
  Vec poly = Vec{} + 1.535336188319500e-4f;
  poly = poly * f + 1.339887440266574e-3f;
  poly = poly * f + 9.618437357674640e-3f;
  poly = poly * f + 5.550332471162809e-2f;
  poly = poly * f + 2.402264791363012e-1f;
  poly = poly * f + 6.931472028550421e-1f;
  poly = poly * f + 1.0f;
  const IVec bits = (IVec)poly + (whole << 23);  // vector casts reinterpret the bits
  return t < -126.0f ? Vec{} : (Vec)bits;
}

// Folds a key block's partial softmax (per row: its max, denominator and unnormalised weighted sum of values)
// into the totals of the blocks before it. One function, never inlined, for both ways an item's blocks are run,
// so the two give the same bits. A block a row cannot see (max kMaskValue, zeros) leaves the row's totals as
// they were; folding into empty totals (kMaskValue, zeros) gives the block's own values. Rows a vector at a time
// (their rescaling factors by Exp), each row's sum a vector of head_dim at a time.
__attribute__((noinline)) void FoldBlock(int64_t rows, int64_t dim, const SoftmaxState& block,
                                         const SoftmaxState& total) {
  for (int64_t first = 0; first < rows; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, rows - first);
    Vec old_max = Vec{} + kMaskValue, block_max = Vec{} + kMaskValue;
    for (int64_t i = 0; i < n; ++i) old_max[i] = total.max[first + i], block_max[i] = block.max[first + i];
    const Vec new_max = old_max > block_max ? old_max : block_max;
    const Vec keep = Exp(old_max - new_max), add = Exp(block_max - new_max);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t m = first + i;
      total.denom[m] = total.denom[m] * keep[i] + block.denom[m] * add[i];
      total.max[m] = new_max[i];
      float* sum = total.sum + m * dim;
      const float* block_sum = block.sum + m * dim;
      for (int64_t d = 0; d < dim; d += kLanes) {
        *reinterpret_cast<Vec*>(sum + d) = *reinterpret_cast<Vec*>(sum + d) * keep[i] + LoadRow(block_sum + d) * add[i];
      }
    }
  }
}

// One item: rows m = (token i, query head h), m = i * heads + h, each a head_dim vector of kChunks * kLanes.
// An item covers every head, so each page is read whole and in order (all KV heads of a slot are adjacent).
template <int kChunks, typename Page>
void Attend(const Problem& p, const WorkItem& w, float* partials) {
  const Page* k_pages = static_cast<const Page*>(p.k);
  const Page* v_pages = static_cast<const Page*>(p.v);
  const int64_t heads = p.heads, group = heads / p.kv_heads, rows = w.count * heads;
  const int64_t seq_end = p.query_start_loc[w.seq + 1];
  const int64_t context = p.context_lens[w.seq];
  const int32_t* table = p.page_tables + w.seq * p.max_pages;
  const int64_t slot_size = p.kv_heads * p.dim;  // one slot: every KV head's row

  thread_local std::vector<Vec> buffer;
  buffer.assign(rows * (2 * kChunks + 1), Vec{});
  Vec* q = buffer.data();              // [rows][kChunks], scaled
  Vec* acc = q + rows * kChunks;       // [rows][kChunks]
  Vec* scores = acc + rows * kChunks;  // [rows]: the tile's scores, then probabilities
  thread_local std::vector<float> stats, wide, totals;
  stats.assign(2 * rows, 0.0f);
  if (!std::is_same_v<Page, float>) wide.resize(2 * kLanes * slot_size);
  float* running_max = stats.data();  // the current key block's
  float* denom = running_max + rows;
  for (int64_t m = 0; m < rows; ++m) running_max[m] = kMaskValue;
  const SoftmaxState total = SoftmaxState::Empty(totals, rows, p.dim);  // the blocks before the current one
  const SoftmaxState block{reinterpret_cast<float*>(acc), running_max, denom};
  const float* q_src = p.q + w.first * heads * p.dim;
  for (int64_t m = 0; m < rows; ++m) {
    for (int c = 0; c < kChunks; ++c) q[m * kChunks + c] = *reinterpret_cast<const Vec*>(q_src + m * p.dim + c * kLanes) * p.scale;
  }
  // Query token i sits at position context - (seq_end - token); it sees keys [position - window + 1, position].
  const int64_t first_position = context - (seq_end - w.first);
  auto slot_offset = [&](int64_t key) {
    return (int64_t(table[key / p.page_size]) * p.page_size + key % p.page_size) * slot_size;
  };

  const float* k_slots[kLanes];
  const float* v_slots[kLanes];
  for (int64_t start = w.key_begin; start < w.key_end; start += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, w.key_end - start);
    // Later tiles are on other pages, which no hardware prefetcher can guess: ask for the one kPrefetchTiles
    // ahead now, into L2 (a core keeps more misses in flight to L2 than to L1: 1.04-1.53x the GB/s of asking
    // for the next tile into L1 in decode from memory, docs/benchmarks.md).
    const int64_t ahead = start + kPrefetchTiles * kLanes;
    for (int64_t key = ahead; key < std::min<int64_t>(ahead + kLanes, w.key_end); ++key) {
      const int64_t offset = slot_offset(key);
      for (int64_t f = 0; f < slot_size; f += 64 / sizeof(Page)) {
        __builtin_prefetch(k_pages + offset + f, 0, 2);
        __builtin_prefetch(v_pages + offset + f, 0, 2);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t offset = slot_offset(start + j);
      k_slots[j] = Widened(k_pages + offset, slot_size, wide.data() + j * slot_size);
      v_slots[j] = Widened(v_pages + offset, slot_size, wide.data() + (kLanes + j) * slot_size);
    }
    for (int64_t j = n; j < kLanes; ++j) k_slots[j] = k_slots[0];  // past the context: scored, then masked
    // Scores: each row's query against the tile's keys, a vector per key summed 16 at a time (SumEach).
    for (int64_t kv = 0; kv < p.kv_heads; ++kv) {
      const float* k_rows[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) k_rows[j] = k_slots[j] + kv * p.dim;
      for (int64_t i = 0; i < w.count; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const Vec* qm = q + (i * heads + kv * group + g) * kChunks;
          Vec qv[kChunks];
          for (int c = 0; c < kChunks; ++c) qv[c] = qm[c];
          Vec dots[kLanes];
#pragma GCC unroll 16
          for (int j = 0; j < kLanes; ++j) {
            Vec dot = qv[0] * LoadRow(k_rows[j]);
            for (int c = 1; c < kChunks; ++c) dot += qv[c] * LoadRow(k_rows[j] + c * kLanes);
            dots[BitReverse(j)] = dot;
          }
          scores[i * heads + kv * group + g] = SumEach(dots);
        }
      }
    }
    const IVec key = int32_t(start) + kIota;
    for (int64_t m = 0; m < rows; ++m) {
      const int32_t pos = int32_t(first_position + m / heads);
      const int32_t first_key = p.window > 0 ? int32_t(pos - p.window + 1) : 0;
      Vec s = scores[m];
      if (p.soft_cap > 0.0f) {
        for (int l = 0; l < kLanes; ++l) s[l] = p.soft_cap * std::tanh(s[l] / p.soft_cap);
      }
      const IVec visible = (kIota < int32_t(n)) & (key <= pos) & (key >= first_key);
      s = visible ? s : Vec{} + kMaskValue;
      const float tile_max = Max(s);
      if (tile_max <= kMaskValue) {  // nothing visible to this row in the tile
        scores[m] = Vec{};
        continue;
      }
      const float new_max = std::max(running_max[m], tile_max);
      const float correction = std::exp(running_max[m] - new_max);
      const Vec probs = visible ? Exp(s - new_max) : Vec{};
      scores[m] = probs;
      running_max[m] = new_max;
      denom[m] = denom[m] * correction + Sum(probs);
      if (correction != 1.0f) {
        for (int c = 0; c < kChunks; ++c) acc[m * kChunks + c] *= correction;
      }
    }
    // Each row's accumulator stays in registers while the tile's values stream by.
    for (int64_t kv = 0; kv < p.kv_heads; ++kv) {
      const float* v_rows[kLanes];
      for (int64_t j = 0; j < n; ++j) v_rows[j] = v_slots[j] + kv * p.dim;
      for (int64_t i = 0; i < w.count; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t m = i * heads + kv * group + g;
          Vec a[kChunks];
          for (int c = 0; c < kChunks; ++c) a[c] = acc[m * kChunks + c];
          for (int64_t j = 0; j < n; ++j) {
            const float pj = scores[m][j];
            for (int c = 0; c < kChunks; ++c) a[c] += pj * LoadRow(v_rows[j] + c * kLanes);
          }
          for (int c = 0; c < kChunks; ++c) acc[m * kChunks + c] = a[c];
        }
      }
    }
    const bool block_ends = (start + kLanes) % kKeyBlock == 0 || start + kLanes >= w.key_end;
    if (block_ends && w.partial < 0) {  // fold the block into the totals, and start the next afresh
      FoldBlock(rows, p.dim, block, total);
      for (int64_t m = 0; m < rows; ++m) running_max[m] = kMaskValue, denom[m] = 0.0f;
      std::fill(acc, acc + rows * kChunks, Vec{});
    }
  }
  if (w.partial >= 0) {  // one key block of an item spread over threads: MergeBlocks folds it
    const SoftmaxState part = SoftmaxState::In(partials + w.partial, rows, p.dim);
    std::copy(block.sum, block.sum + rows * p.dim, part.sum);
    std::copy(block.max, block.max + rows, part.max);
    std::copy(block.denom, block.denom + rows, part.denom);
    return;
  }
  WriteNormalised(rows, p.dim, total.denom, total.sum, p.out + w.first * heads * p.dim);
}

// The result of an item whose key blocks ran as items of their own: their partials (`blocks` of them, in key
// order, from `part`) folded as Attend folds them.
void MergeBlocks(const Problem& p, const WorkItem& w, float* part, int64_t blocks) {
  const int64_t rows = w.count * p.heads, dim = p.dim, size = SoftmaxState::Size(rows, dim);
  thread_local std::vector<float> totals;
  const SoftmaxState total = SoftmaxState::Empty(totals, rows, dim);
  for (int64_t b = 0; b < blocks; ++b, part += size) {
    FoldBlock(rows, dim, SoftmaxState::In(part, rows, dim), total);
  }
  WriteNormalised(rows, dim, total.denom, total.sum, p.out + w.first * p.heads * dim);
}

// Head dims the kernel is compiled for (SUPPORTED_HEAD_DIMS in __init__.py; others take the reference).
bool Supported(int64_t dim) {
  return (dim == 32 || dim == 64 || dim == 80 || dim == 96 || dim == 128 || dim == 256);
}

template <typename Page>
void AttendItem(const Problem& p, const WorkItem& w, float* partials) {
  switch (p.dim) {
    case 32: return Attend<32 / kLanes, Page>(p, w, partials);
    case 64: return Attend<64 / kLanes, Page>(p, w, partials);
    case 80: return Attend<80 / kLanes, Page>(p, w, partials);
    case 96: return Attend<96 / kLanes, Page>(p, w, partials);
    case 128: return Attend<128 / kLanes, Page>(p, w, partials);
    case 256: return Attend<256 / kLanes, Page>(p, w, partials);
  }
}

ffi::Error RaggedPagedAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> page_tables,
                                ffi::Buffer<ffi::S32> query_start_loc,
                                ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window,
                                float soft_cap) {
  const auto q_dims = q.dimensions(), kv_dims = k_pages.dimensions(), table_dims = page_tables.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be 3-D, pages 4-D, page tables 2-D");
  }
  const int64_t tokens = q_dims[0], heads = q_dims[1], dim = q_dims[2], seqs = table_dims[0];
  const ffi::DataType page_type = k_pages.element_type();
  if (v_pages.element_type() != page_type || (page_type != ffi::F32 && page_type != ffi::BF16)) {
    return ffi::Error::InvalidArgument("paged attention: K and V pages must both be float32 or both bfloat16");
  }
  if (kv_dims[3] != dim || heads % kv_dims[2] != 0) {
    return ffi::Error::InvalidArgument("paged attention: head_dim or GQA group does not match the pages");
  }
  if (!Supported(dim)) return ffi::Error::InvalidArgument("paged attention: no build for this head_dim");
  Problem p{q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), context_lens.typed_data(),
            page_tables.typed_data(), query_start_loc.typed_data(), out->typed_data(), heads, kv_dims[2], dim,
            kv_dims[1], table_dims[1], scale, sliding_window, soft_cap};

  std::vector<WorkItem> items;
  for (int32_t s = 0; s < seqs; ++s) {
    const int32_t begin = p.query_start_loc[s], end = p.query_start_loc[s + 1];
    for (int32_t first = begin; first < end; first += kQueryBlock) {
      const int32_t count = std::min(kQueryBlock, end - first);
      const int64_t first_position = p.context_lens[s] - (end - first), last = first_position + count - 1;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_position - p.window + 1) : 0;
      items.push_back({s, first, count, lo - lo % kLanes, last + 1, -1});
    }
  }
  // Fewer items than threads (a decode of a few sequences): their key blocks become items of their own, each
  // leaving its partial result for MergeBlocks.
  std::vector<WorkItem> spread;  // the items whose blocks run apart, each with its first block's partial
  std::vector<int64_t> num_blocks;
  int64_t partial_floats = 0;
  if (int64_t(items.size()) < jserve::Workers::Get().NumThreads()) {
    std::vector<WorkItem> blocks;
    for (const WorkItem& w : items) {
      const int64_t first_block = w.key_begin / kKeyBlock, last_block = (w.key_end - 1) / kKeyBlock;
      if (w.key_end <= w.key_begin || first_block == last_block) {
        blocks.push_back(w);
        continue;
      }
      spread.push_back({w.seq, w.first, w.count, w.key_begin, w.key_end, partial_floats});
      num_blocks.push_back(last_block - first_block + 1);
      for (int64_t b = first_block; b <= last_block; ++b, partial_floats += SoftmaxState::Size(int64_t(w.count) * heads, dim)) {
        blocks.push_back({w.seq, w.first, w.count, std::max(w.key_begin, b * kKeyBlock),
                          std::min(w.key_end, (b + 1) * kKeyBlock), partial_floats});
      }
    }
    items.swap(blocks);
  }
  // Most query tokens first (prefill blocks before decodes), so no thread is left with a long item at the end.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.count > b.count; });
  const int64_t real = std::clamp<int64_t>(p.query_start_loc[seqs], 0, tokens);
  std::memset(p.out + real * heads * dim, 0, (tokens - real) * heads * dim * sizeof(float));  // padding -> 0
  const auto attend = page_type == ffi::F32 ? AttendItem<float> : AttendItem<uint16_t>;
  thread_local std::vector<float> partials;  // (per calling thread: XLA may run two calls at once)
  if (partials.size() < size_t(partial_floats)) partials.resize(partial_floats);
  float* partial = partials.data();
  jserve::ParallelFor(items.size(), [&](int64_t i) { attend(p, items[i], partial); });
  jserve::ParallelFor(spread.size(), [&](int64_t i) {
    MergeBlocks(p, spread[i], partial + spread[i].partial, num_blocks[i]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
