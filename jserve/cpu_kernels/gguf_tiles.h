// GGUF weights in tiles of 16 rows, multiplied by integer dot products (gguf_tiles.cc).
//
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are blocks of 32 integer codes with a float16 scale (and Q4_1, Q5_1 a
// float16 minimum; Q5_x's 5th bits in a 32-bit word): w = d·q (+ m). Q4_K, Q5_K and Q6_K are super-blocks
// of 256: Q4_K and Q5_K have a float16 d and dmin and per 32 inputs 6-bit integers sc and m (w = d·sc·q −
// dmin·m), Q6_K a float16 d and per 16 inputs an int8 sc (w = d·sc·(q − 32), its 6-bit codes split into 4
// low and 2 high bits). Rows are kept 16 at a time, block by block: a tile block holds each field of the
// 16 rows' blocks in turn, a float16 as 16 values, anything longer (codes, high bits, packed scales) as
// 64-byte vectors whose lane r is 4 bytes of row r (the codes of 4 inputs, or in the 4-bit fields the
// codes of 4 inputs in the low nibbles and of 4 others in the high ones, as ggml packs them). Bytes and
// values are the file's; only their order changes, and a tile block takes exactly the 16 blocks' bytes.
// One 64-byte load then feeds AVX-512 VNNI's vpdpbusd for 16 outputs at once (gguf_tiles_vnni.cc), or
// each 32-byte half AVX2's vpmaddubsw for 8 (gguf_tiles_avx2.cc); codes split over several fields are put
// together in registers, once per tile block for all of a step's tokens.
//
// The activations meet the codes as integers: per 32 inputs x ≈ s·v with v = round(x / s), s = max|x| /
// (127·2¹⁴), written as three int8 digits v = 2¹⁴·c2 + 2⁷·c1 + c0 (|c2| ≤ 127, |c1|, |c0| ≤ 64). The
// codes are exact and the int32 sums Σ q·c are exact, so the only approximation is v's: 2⁻²² of each 32
// inputs' largest, about float32's own rounding of it, with every token's result independent of the others
// in its step. (Two digits, 2⁻¹⁵, moved SmolLM2's logits by 0.06.) The float work is a few scales per 32
// inputs: y += (d·s)·Σq·v (the K-quants' d·sc, Q6_K's sc per 16 inputs: exact in float), and the minimum's
// (Q4_0's −8·d, Q5_0's −16·d, the K-quants' −dmin·m) m·Σx with the inputs' float sum.
#pragma once

#include <cstdint>
#include <vector>

namespace jserve::gguf {

constexpr int64_t kTileRows = 16;

// Bytes of `rows` rows of `row_bytes` each, in whole tiles (the last padded with zero rows).
int64_t SegmentBytes(int64_t rows, int64_t row_bytes);

// Row `row` of a tiled run of rows, `blocks` blocks long, back in ggml's own block layout at `out`.
void UntileRow(int64_t type, const uint8_t* tiles, int64_t row, int64_t blocks, uint8_t* out);

// Tokens' activations as the tiled products take them, per block of 32 inputs.
struct Activations {
  Activations(int64_t tokens, int64_t depth);  // depth a multiple of 32
  int64_t blocks;
  std::vector<int8_t> digits;       // [token][block][3][32]: c2 of the block's 32 inputs, c1, c0
  std::vector<float> scale, sum;    // [token][block]: s, and Σ x
  std::vector<int32_t> digit_sums;  // [token][block][3]: Σ c2, Σ c1, Σ c0
  std::vector<int32_t> half_sums;   // [token][block][3]: the same over the block's first 16 inputs
};

// Token t's activations x [depth] into `a`.
void Quantize(const float* x, int64_t t, Activations* a);

// The instructions this build multiplies tiles with ("AVX-512 VNNI", "AVX2"), or nullptr for scalar loops
// (the same integers).
const char* Vectorized();

// y[t, first_row + r] for the rows of tiles [tile_begin, tile_end) of a run of `rows` rows and tokens
// [token_begin, token_end) of `a`; y's rows are `outputs` long.
void TiledRows(int64_t type, const uint8_t* tiles, int64_t rows, int64_t tile_begin, int64_t tile_end,
               const Activations& a, int64_t token_begin, int64_t token_end, int64_t outputs, int64_t first_row,
               float* y);

}  // namespace jserve::gguf
