// A CPU kernel for one whole int8 weight product as the exporter writes it: the input rows quantized per row
// (RowQuantize), MatMulIntegerToFloat against constant int8 weights with per-column scales, then the stock nodes
// after it that touch each output alone: the bias Add, and a ReLU or the residual Add. The runtime replaces each such
// block with this one node when the library is loaded (runtime/quantized_matmul_fusion.py), in memory only: the graph
// on disk is unchanged.
//
// Why: at a few decoder rows a product reads its weights once and does little else, and ONNX Runtime's int8 GEMM
// spends more than the read on each call (the default model's 19 decoder products at 1 to 8 rows: 1.15x-1.40x this
// kernel's time, quantization included here and not there, on an Intel Xeon with AMX, whose tile kernels compute 16
// rows at every call); and the three to four nodes per product cost a dispatch each.
//
// Same bits as the nodes it replaces: the levels are RowQuantize's (row_quantization.h); the integer sums are exact
// (weights in [-64, 64] cannot overflow a 16-bit pair on AVX2, and VNNI sums in 32 bits); each output is then
// (float(sum) * weight scale) * row scale, as MatMulIntegerToFloat rounds it with a per-row activation scale, then
// + bias, + residual and max(0, .) in the graph's order, one rounding each.
//
// Weights are packed once, when the session makes the kernel: blocks of 16 columns, each block's k in fours, so that
// one 64-byte load feeds 16 four-term dot products (vpdpbusd), two 8-column halves (vpmaddubsw on AVX2) or, 16 such
// loads, one AMX tile.

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "row_quantization.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

constexpr const char* kKernel = "quantized weight product";

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse(kKernel, what); }

constexpr int64_t kBlock = 16;         // columns per packed block: one 512-bit register of 32-bit sums
constexpr int64_t kDepth = 4;          // k per 32-bit lane: vpdpbusd adds four u8 x s8 products
constexpr int64_t kBlockBytes = kBlock * kDepth;
constexpr int64_t kChunk = 64;         // k per AMX tile row; K is padded to it (zero levels meet zero weights)
constexpr int64_t kAmxRows = 16;       // rows per AMX tile; a call's last group is padded with zero levels
// From 8 rows a call runs on AMX tiles where the CPU has them. Below, the VNNI tiles are faster: the weights' read is
// the whole cost and a tile computes 16 rows whatever the call has (Intel Xeon with AMX, 1 thread, the engine with
// the tiles capped at VNNI against both, interleaved: AMX from 4 rows 0.90x the tokens/s at batch 1 beam 4, 1.17x and
// 1.30x at batch 8 greedy and beam 4; the default model's 19 decoder products alone, against ONNX Runtime's:
// 1.24x-1.26x on VNNI tiles at 1 and 2 rows, 1.06x-1.24x on AMX; at 8 rows 0.91x against 1.15x-1.19x).
constexpr int64_t kAmxMinRows = 8;
constexpr int kTileBlocks = 4;         // blocks per tile: its weights are read once for all its rows
constexpr int kTileRowsVnni = 4;       // 4 rows x 4 blocks = 16 accumulators of the 32 zmm registers
// AVX2: 8 accumulators of the 16 ymm registers, as 2 rows x 2 blocks x 2 halves for calls of 1 or 2 rows (both blocks'
// weights read once for the rows) and as 4 rows x 1 block x 2 halves from 3 rows. Tall tiles, each block's rows
// before the next block's, ran the products with outputs past L2 (the encoder's, the output projection from 32 rows)
// 1.4x-1.5x as fast as the wide ones on an AMD EPYC with AVX2 only (the 256 x 768 product at 800 rows 28 -> 44 GMAC/s;
// 256 x 8,000 at 32 and 128 rows 29-32 -> 45), level at 4 to 128 rows of the 256 x 768 and 1,024 x 256 products,
// measured in one process; wide tiles stay at 1 and 2 rows (the one-row output projection ran at 0.88x on tall ones).
constexpr int kWideRowsAvx2 = 2;
constexpr int kTallRowsAvx2 = 4;
constexpr int kTileBlocksAvx2 = 2;     // blocks per ParallelFor index

enum Input : size_t { kX = 0, kWeight = 1, kWeightScale = 2, kWeightZeroPoint = 3, kBias = 4, kResidual = 5, kInputs = 6 };

// The constant inputs, packed: per padded column its scale, bias (0 without one) and the sum's correction for the
// zero points, which is all of it except -zero_point[n] * (the row's sum of levels) when a weight zero point is set.
struct PackedWeights {
  int64_t inner = 0, width = 0, inner_padded = 0, blocks = 0;
  std::vector<int8_t> values;            // [blocks][inner_padded / 4][16 columns][4 k]
  std::vector<int32_t> column_offsets;   // inner * za * zb[n] - za * (sum over k of W[k][n])
  std::vector<int32_t> zero_points;      // zb[n]
  std::vector<float> scales, bias;
  // pairs_fit: every weight in [-64, 64], so that two u8 x s8 products fit vpmaddubsw's 16-bit lane (2 x 255 x 64 =
  // 32640); ONNX Runtime's reduce-range quantization writes exactly that range, +64 included.
  bool has_bias = false, any_zero_point = false, pairs_fit = true;
};

// One call's operands, as a tile reads them.
struct Operands {
  const PackedWeights* weights;
  const uint8_t* levels;   // rows x inner_padded
  const float* row_scales;
  const int32_t* row_sums;
  const float* residual;   // rows x width, or null
  float* out;              // rows x width
  int64_t rows;
  bool relu;
};

constexpr int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

// The epilogue of one block of one row on eight columns starting at n (all in range): float(sum) * scale * row scale,
// + bias, + residual, ReLU. Shared by both paths so the rounding order is written once.
inline void finish8(const Operands& op, int64_t row, int64_t n, __m256i sums, float* out) {
  const PackedWeights& w = *op.weights;
  sums = _mm256_add_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.column_offsets.data() + n)));
  if (w.any_zero_point) {
    const __m256i zero_points = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.zero_points.data() + n));
    sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(zero_points, _mm256_set1_epi32(op.row_sums[row])));
  }
  __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(w.scales.data() + n));
  y = _mm256_mul_ps(y, _mm256_set1_ps(op.row_scales[row]));
  if (w.has_bias) y = _mm256_add_ps(y, _mm256_loadu_ps(w.bias.data() + n));
  if (op.residual) {
    const float* residual = op.residual + row * w.width + n;
    if (n + 8 <= w.width) {
      y = _mm256_add_ps(y, _mm256_loadu_ps(residual));
    } else {
      alignas(32) float tail[8] = {};
      std::memcpy(tail, residual, static_cast<size_t>(w.width - n) * sizeof(float));
      y = _mm256_add_ps(y, _mm256_load_ps(tail));
    }
  }
  if (op.relu) y = _mm256_max_ps(y, _mm256_setzero_ps());
  _mm256_storeu_ps(out, y);
}

// Writes the eight columns from n of `row`, through a buffer where fewer than eight are in range.
inline void store8(const Operands& op, int64_t row, int64_t n, __m256i sums) {
  const int64_t width = op.weights->width;
  float* target = op.out + row * width + n;
  if (n + 8 <= width) {
    finish8(op, row, n, sums, target);
  } else if (n < width) {
    alignas(32) float buffer[8];
    finish8(op, row, n, sums, buffer);
    std::memcpy(target, buffer, static_cast<size_t>(width - n) * sizeof(float));
  }
}

// The AVX-512 form of store8 for `rows` rows of one block, their sums 16 apart from `sums`: the same operations in
// the same order, 16 columns at a time, the columns past N masked off, the block's per-column vectors loaded once for
// all the rows (loaded per row, the epilogue was 13% of the encoder's time at 160 rows, the AMX products 34%).
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void finish_block(const Operands& op, const int32_t* sums,
                                                                                           int64_t row0, int64_t rows, int64_t block) {
  const PackedWeights& w = *op.weights;
  const int64_t n = block * kBlock;
  const __mmask16 live = w.width - n >= kBlock ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (w.width - n)) - 1);
  const __m512i offsets = _mm512_loadu_si512(w.column_offsets.data() + n);
  const __m512i zero_points = w.any_zero_point ? _mm512_loadu_si512(w.zero_points.data() + n) : _mm512_setzero_si512();
  const __m512 scales = _mm512_loadu_ps(w.scales.data() + n);
  const __m512 bias = w.has_bias ? _mm512_loadu_ps(w.bias.data() + n) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    __m512i row_sums = _mm512_add_epi32(_mm512_load_si512(sums + r * kBlock), offsets);
    if (w.any_zero_point) row_sums = _mm512_sub_epi32(row_sums, _mm512_mullo_epi32(zero_points, _mm512_set1_epi32(op.row_sums[row])));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(row_sums), scales), _mm512_set1_ps(op.row_scales[row]));
    if (w.has_bias) y = _mm512_add_ps(y, bias);
    if (op.residual) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(live, op.residual + row * w.width + n));
    if (op.relu) y = _mm512_max_ps(y, _mm512_setzero_ps());
    _mm512_mask_storeu_ps(op.out + row * w.width + n, live, y);
  }
}

inline int32_t four_levels(const uint8_t* levels) {
  int32_t packed;
  std::memcpy(&packed, levels, sizeof(packed));
  return packed;
}

// AVX2: per k-quad and 8 columns, vpmaddubsw adds pairs of u8 x s8 products in 16 bits (exact for weights in [-64, 64]:
// 2 x 255 x 64 < 32767) and vpmaddwd the two pairs into 32 bits.
template <int Rows, int Blocks>
void tile_avx2(const Operands& op, int64_t row0, int64_t block0) {
  const PackedWeights& w = *op.weights;
  const int64_t quads = w.inner_padded / kDepth;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[Rows][Blocks][2];
  for (auto& row : sums)
    for (auto& block : row) block[0] = block[1] = _mm256_setzero_si256();
  const int8_t* weights = w.values.data() + block0 * quads * kBlockBytes;
  for (int64_t quad = 0; quad < quads; ++quad) {
    __m256i b[Blocks][2];
    for (int c = 0; c < Blocks; ++c) {
      const int8_t* at = weights + (c * quads + quad) * kBlockBytes;
      b[c][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      b[c][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
    }
    for (int r = 0; r < Rows; ++r) {
      const __m256i a = _mm256_set1_epi32(four_levels(op.levels + (row0 + r) * w.inner_padded + quad * kDepth));
      for (int c = 0; c < Blocks; ++c)
        for (int half = 0; half < 2; ++half)
          sums[r][c][half] = _mm256_add_epi32(sums[r][c][half], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[c][half]), ones));
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Blocks; ++c)
      for (int half = 0; half < 2; ++half) store8(op, row0 + r, (block0 + c) * kBlock + half * 8, sums[r][c][half]);
}

// The 4 x 1 tile written out, one named accumulator each, 35 instructions a k-quad: the template's array form compiled
// (GCC 12, -O3) to 42, 9 of them register copies and a stack spill, and so did this form with partial redundancy
// elimination on (AMD EPYC, AVX2 only, in one process: 1.0x-1.4x the template's GMAC/s at 8 to 800 rows, most
// 1.1x-1.17x).
__attribute__((optimize("no-tree-partial-pre"))) void tile_avx2_tall(const Operands& op, int64_t row0, int64_t block0) {
  const PackedWeights& w = *op.weights;
  const int64_t quads = w.inner_padded / kDepth, stride = w.inner_padded;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
  const int8_t* weights = w.values.data() + block0 * quads * kBlockBytes;
  const uint8_t* levels = op.levels + row0 * stride;
  for (int64_t quad = 0; quad < quads; ++quad) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + quad * kBlockBytes));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + quad * kBlockBytes + 32));
    const uint8_t* at = levels + quad * kDepth;
    __m256i a = _mm256_set1_epi32(four_levels(at));
    s00 = _mm256_add_epi32(s00, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
    s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    a = _mm256_set1_epi32(four_levels(at + stride));
    s10 = _mm256_add_epi32(s10, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
    s11 = _mm256_add_epi32(s11, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    a = _mm256_set1_epi32(four_levels(at + 2 * stride));
    s20 = _mm256_add_epi32(s20, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
    s21 = _mm256_add_epi32(s21, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    a = _mm256_set1_epi32(four_levels(at + 3 * stride));
    s30 = _mm256_add_epi32(s30, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
    s31 = _mm256_add_epi32(s31, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
  }
  const int64_t n = block0 * kBlock;
  store8(op, row0, n, s00);
  store8(op, row0, n + 8, s01);
  store8(op, row0 + 1, n, s10);
  store8(op, row0 + 1, n + 8, s11);
  store8(op, row0 + 2, n, s20);
  store8(op, row0 + 2, n + 8, s21);
  store8(op, row0 + 3, n, s30);
  store8(op, row0 + 3, n + 8, s31);
}

// AVX-512 VNNI: vpdpbusd adds four u8 x s8 products into each 32-bit lane of 16 columns.
template <int Rows, int Blocks>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_vnni(const Operands& op, int64_t row0, int64_t block0) {
  const PackedWeights& w = *op.weights;
  const int64_t quads = w.inner_padded / kDepth;
  __m512i sums[Rows][Blocks];
  for (auto& row : sums)
    for (auto& block : row) block = _mm512_setzero_si512();
  const int8_t* weights = w.values.data() + block0 * quads * kBlockBytes;
  for (int64_t quad = 0; quad < quads; ++quad) {
    __m512i b[Blocks];
    for (int c = 0; c < Blocks; ++c) b[c] = _mm512_loadu_si512(weights + (c * quads + quad) * kBlockBytes);
    for (int r = 0; r < Rows; ++r) {
      const __m512i a = _mm512_set1_epi32(four_levels(op.levels + (row0 + r) * w.inner_padded + quad * kDepth));
      for (int c = 0; c < Blocks; ++c) sums[r][c] = _mm512_dpbusd_epi32(sums[r][c], a, b[c]);
    }
  }
  alignas(64) int32_t block_sums[Rows * kBlock];
  for (int c = 0; c < Blocks; ++c) {
    for (int r = 0; r < Rows; ++r) _mm512_store_si512(block_sums + r * kBlock, sums[r][c]);
    finish_block(op, block_sums, row0, Rows, block0 + c);
  }
}

using Tile = void (*)(const Operands&, int64_t, int64_t);

// AMX: the packed layout is the tiles' own (a block's weights for 64 k are 16 quads x 64 bytes). The tile shapes are
// ONNX Runtime's own AMX configuration (8 tiles of 16 rows x 64 bytes), so loading it never changes a configuration
// its int8 GEMM relies on.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) void load_tile_config() {
  static const TileConfig wanted = [] {
    TileConfig config;
    for (int tile = 0; tile < 8; ++tile) {
      config.bytes_per_row[tile] = kChunk;
      config.rows[tile] = kAmxRows;
    }
    return config;
  }();
  alignas(64) TileConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &wanted, sizeof(wanted)) != 0) _tile_loadconfig(&wanted);
}


// Groups x 16 rows by Blocks x 16 columns (each at most 2): the sums in tmm0-3 (group g, block b: tmm 2g + b), the
// groups' levels for 64 k in tmm4-5, the blocks' weights for those k in tmm6-7, each level tile used for every block
// and each weight tile for every group. At K = 1024 two blocks' weights (32 KB) stay in L1 for all the rows where
// four did not (64 KB: the default model's FFN output product ran at half ONNX Runtime's speed at 128 rows).
template <int Groups, int Blocks>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_amx(const Operands& op, int64_t row0,
                                                                                              int64_t block0) {
  const PackedWeights& w = *op.weights;
  const int64_t stride = w.inner_padded, block_bytes = w.inner_padded / kDepth * kBlockBytes;
  const uint8_t* levels = op.levels + row0 * stride;
  const int8_t* weights = w.values.data() + block0 * block_bytes;
  _tile_zero(0);
  if constexpr (Blocks > 1) _tile_zero(1);
  if constexpr (Groups > 1) _tile_zero(2);
  if constexpr (Groups > 1 && Blocks > 1) _tile_zero(3);
  for (int64_t k = 0; k < w.inner_padded; k += kChunk) {
    const int8_t* at = weights + k / kDepth * kBlockBytes;
    _tile_loadd(4, levels + k, stride);
    _tile_loadd(6, at, kBlockBytes);
    _tile_dpbusd(0, 4, 6);
    if constexpr (Blocks > 1) {
      _tile_loadd(7, at + block_bytes, kBlockBytes);
      _tile_dpbusd(1, 4, 7);
    }
    if constexpr (Groups > 1) {
      _tile_loadd(5, levels + kAmxRows * stride + k, stride);
      _tile_dpbusd(2, 5, 6);
      if constexpr (Blocks > 1) _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t sums[kAmxRows * kBlock];
  _tile_stored(0, sums, kBlock * sizeof(int32_t));
  finish_block(op, sums, row0, std::min(kAmxRows, op.rows - row0), block0);
  if constexpr (Blocks > 1) {
    _tile_stored(1, sums, kBlock * sizeof(int32_t));
    finish_block(op, sums, row0, std::min(kAmxRows, op.rows - row0), block0 + 1);
  }
  if constexpr (Groups > 1) {
    _tile_stored(2, sums, kBlock * sizeof(int32_t));
    finish_block(op, sums, row0 + kAmxRows, std::min(kAmxRows, op.rows - row0 - kAmxRows), block0);
  }
  if constexpr (Groups > 1 && Blocks > 1) {
    _tile_stored(3, sums, kBlock * sizeof(int32_t));
    finish_block(op, sums, row0 + kAmxRows, std::min(kAmxRows, op.rows - row0 - kAmxRows), block0 + 1);
  }
}

using AmxTile = void (*)(const Operands&, int64_t, int64_t);
const AmxTile kAmxTiles[2][2] = {{tile_amx<1, 1>, tile_amx<1, 2>}, {tile_amx<2, 1>, tile_amx<2, 2>}};

// A column tile's rows on AMX tiles, two blocks at a time, the row groups in pairs (the last group padded).
void run_amx(const Operands& op, int64_t block0, int blocks) {
  load_tile_config();  // per call: the thread may have run another library's tiles since
  for (int64_t block = block0; block < block0 + blocks; block += 2) {
    const int pair = static_cast<int>(std::min<int64_t>(2, block0 + blocks - block));
    for (int64_t row = 0; row < op.rows; row += 2 * kAmxRows) {
      const int groups = op.rows - row > kAmxRows ? 2 : 1;
      kAmxTiles[groups - 1][pair - 1](op, row, block);
    }
  }
}

// Whether this process may run AMX tiles: the CPU has AMX-TILE and AMX-INT8 and Linux grants the tile state.
bool amx_permitted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return tile && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// The tiles of each instruction set, indexed [rows - 1][blocks - 1] for the ragged edges.
const Tile kAvx2WideTiles[kWideRowsAvx2][kTileBlocksAvx2] = {{tile_avx2<1, 1>, tile_avx2<1, 2>}, {tile_avx2<2, 1>, tile_avx2<2, 2>}};
const Tile kAvx2TallTiles[kTallRowsAvx2] = {tile_avx2<1, 1>, tile_avx2<2, 1>, tile_avx2<3, 1>, tile_avx2_tall};
const Tile kVnniTiles[kTileRowsVnni][kTileBlocks] = {
    {tile_vnni<1, 1>, tile_vnni<1, 2>, tile_vnni<1, 3>, tile_vnni<1, 4>},
    {tile_vnni<2, 1>, tile_vnni<2, 2>, tile_vnni<2, 3>, tile_vnni<2, 4>},
    {tile_vnni<3, 1>, tile_vnni<3, 2>, tile_vnni<3, 3>, tile_vnni<3, 4>},
    {tile_vnni<4, 1>, tile_vnni<4, 2>, tile_vnni<4, 3>, tile_vnni<4, 4>}};

struct ColumnTask {
  Operands operands;
  bool vnni, amx;
};

// One ParallelFor index: one tile's columns (AVX2: each of its blocks in turn) for every row, so its weights come in
// once and stay in L1 for the rows.
void run_column_tile(void* raw_task, size_t index) {
  const ColumnTask& task = *static_cast<const ColumnTask*>(raw_task);
  const Operands& op = task.operands;
  const int tile_blocks = task.vnni ? kTileBlocks : kTileBlocksAvx2;
  const int64_t block0 = static_cast<int64_t>(index) * tile_blocks;
  const int blocks = static_cast<int>(std::min<int64_t>(tile_blocks, op.weights->blocks - block0));
  if (task.amx && op.rows >= kAmxMinRows) {  // every row: the last group's levels are padded to 16 rows with zero bytes
    run_amx(op, block0, blocks);
    return;
  }
  if (task.vnni || op.rows <= kWideRowsAvx2) {
    const int tile_rows = task.vnni ? kTileRowsVnni : kWideRowsAvx2;
    for (int64_t row = 0; row < op.rows; row += tile_rows) {
      const int rows = static_cast<int>(std::min<int64_t>(tile_rows, op.rows - row));
      const Tile tile = task.vnni ? kVnniTiles[rows - 1][blocks - 1] : kAvx2WideTiles[rows - 1][blocks - 1];
      tile(op, row, block0);
    }
    return;
  }
  for (int64_t block = block0; block < block0 + blocks; ++block) {
    for (int64_t row = 0; row < op.rows; row += kTallRowsAvx2) {
      const int rows = static_cast<int>(std::min<int64_t>(kTallRowsAvx2, op.rows - row));
      kAvx2TallTiles[rows - 1](op, row, block);
    }
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

// A per-column constant: one value for all columns, or one per column.
template <typename T>
T per_column(const std::vector<T>& values, int64_t n) {
  return values.size() == 1 ? values[0] : values[static_cast<size_t>(n)];
}

PackedWeights pack(const Ort::ConstKernelInfo& info, int zero_point) {
  int is_constant = 0;
  const Ort::ConstValue weight = info.GetTensorConstantInput(kWeight, &is_constant);
  if (!is_constant) refuse("the weight must be a constant initializer");
  const std::vector<int64_t> shape = weight.GetTensorTypeAndShapeInfo().GetShape();
  if (shape.size() != 2 || weight.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
    refuse("the weight must be int8 (K, N)");
  PackedWeights w;
  w.inner = shape[0];
  w.width = shape[1];
  w.inner_padded = round_up(w.inner, kChunk);
  w.blocks = round_up(w.width, kBlock) / kBlock;
  const int64_t padded_width = w.blocks * kBlock;
  const std::vector<float> scales = constant_values<float>(info, kWeightScale, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kKernel, "the weight scale");
  const std::vector<int8_t> zero_points =
      constant_values<int8_t>(info, kWeightZeroPoint, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, kKernel, "the weight zero point");
  std::vector<float> bias;
  w.has_bias = has_input(info, kBias);
  if (w.has_bias) bias = constant_values<float>(info, kBias, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kKernel, "the bias");
  for (const std::vector<float>* sizes : {&scales, static_cast<const std::vector<float>*>(&bias)})
    if (!sizes->empty() && sizes->size() != 1 && static_cast<int64_t>(sizes->size()) != w.width)
      refuse("scales and bias need one value or N");
  if (zero_points.size() != 1 && static_cast<int64_t>(zero_points.size()) != w.width) refuse("the weight zero point needs one value or N");
  const int8_t* values = weight.GetTensorData<int8_t>();
  w.values.assign(static_cast<size_t>(w.blocks * (w.inner_padded / kDepth) * kBlockBytes), 0);
  w.column_offsets.assign(static_cast<size_t>(padded_width), 0);
  w.zero_points.assign(static_cast<size_t>(padded_width), 0);
  w.scales.assign(static_cast<size_t>(padded_width), 0.0f);
  w.bias.assign(static_cast<size_t>(padded_width), 0.0f);
  for (int64_t n = 0; n < w.width; ++n) {
    const int64_t block = n / kBlock, lane = n % kBlock;
    int32_t column_sum = 0;
    for (int64_t k = 0; k < w.inner; ++k) {
      const int8_t value = values[k * w.width + n];
      w.pairs_fit = w.pairs_fit && value >= -64 && value <= 64;
      column_sum += value;
      w.values[static_cast<size_t>(((block * (w.inner_padded / kDepth) + k / kDepth) * kBlock + lane) * kDepth + k % kDepth)] = value;
    }
    const int32_t zb = per_column(zero_points, n);
    w.zero_points[n] = zb;
    w.any_zero_point = w.any_zero_point || zb != 0;
    w.column_offsets[n] = static_cast<int32_t>(w.inner) * zero_point * zb - zero_point * column_sum;
    w.scales[n] = per_column(scales, n);
    if (w.has_bias) w.bias[n] = per_column(bias, n);
  }
  return w;
}

class QuantizedMatMulKernel {
 public:
  explicit QuantizedMatMulKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    inverse_levels_ = kernel_info.GetAttribute<float>("inverse_levels");
    const int64_t zero_point = kernel_info.GetAttribute<int64_t>("zero_point");
    relu_ = optional_attribute<int64_t>(kernel_info, "relu", 0) != 0;
    if (zero_point < 0 || zero_point > 255) refuse("zero_point must be a uint8 value");
    if (!(inverse_levels_ > 0.0f)) refuse("inverse_levels must be positive");
    zero_point_ = static_cast<int>(zero_point);
    has_residual_ = has_input(kernel_info, kResidual);
    weights_ = pack(kernel_info, zero_point_);
    const std::string isa = kernels_isa_cap();  // tests/test_quantized_matmul_fusion.py runs each path the CPU can
    vnni_ = isa != "avx2" && cpu_has_vnni();
    amx_ = vnni_ && isa != "avx512-vnni" && amx_permitted();
    // Wider weights would overflow vpmaddubsw's 16-bit pairs: without VNNI the runtime then makes the session without
    // its in-memory fusions (runtime/ort_step.py).
    if (!vnni_ && !weights_.pairs_fit) refuse("weights outside [-64, 64] need VNNI on this CPU");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue input = context.GetInput(kX);
    ShapeAndCount in = shape_and_count(input);
    std::vector<int64_t>& shape = in.dims;
    if (shape.empty() || shape.back() != weights_.inner) refuse("the input's last axis must be the weight's K");
    const int64_t rows = in.count / std::max<int64_t>(weights_.inner, 1);
    shape.back() = weights_.width;
    Ort::UnownedValue output = context.GetOutput(0, shape);
    const float* residual = nullptr;
    if (has_residual_) {
      const Ort::ConstValue value = context.GetInput(kResidual);
      if (value.GetTensorTypeAndShapeInfo().GetShape() != shape) refuse("the residual must have the output's shape");
      residual = value.GetTensorData<float>();
    }
    thread_local std::vector<uint8_t> levels;
    thread_local std::vector<float> row_scales;
    thread_local std::vector<int32_t> row_sums;
    quantize(input.GetTensorData<float>(), rows, amx_ ? round_up(rows, kAmxRows) : rows, levels, row_scales, row_sums);
    const Operands operands{&weights_, levels.data(), row_scales.data(), row_sums.data(), residual,
                            output.GetTensorMutableData<float>(), rows, relu_};
    ColumnTask task{operands, vnni_, amx_};
    const int tile_blocks = vnni_ ? kTileBlocks : kTileBlocksAvx2;
    if (rows > 0) context.ParallelFor(run_column_tile, static_cast<size_t>((weights_.blocks + tile_blocks - 1) / tile_blocks), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // Each row's levels (k padded to a multiple of 64 with zero bytes, which meet zero weights; padding rows all zero
  // bytes), scale and level sum.
  void quantize(const float* x, int64_t rows, int64_t padded_rows, std::vector<uint8_t>& levels, std::vector<float>& row_scales,
                std::vector<int32_t>& row_sums) const {
    const int64_t inner = weights_.inner, padded = weights_.inner_padded;
    levels.resize(static_cast<size_t>(padded_rows * padded));  // quantize_row writes each row's first K bytes
    if (padded > inner)
      for (int64_t row = 0; row < rows; ++row) std::fill_n(levels.data() + row * padded + inner, padded - inner, uint8_t{0});
    std::fill(levels.begin() + rows * padded, levels.end(), uint8_t{0});
    row_scales.resize(static_cast<size_t>(rows));
    row_sums.assign(static_cast<size_t>(rows), 0);
    for (int64_t row = 0; row < rows; ++row) {
      const float* source = x + row * inner;
      uint8_t* target = levels.data() + row * padded;
      row_scales[row] = max_abs(source, inner) * inverse_levels_;
      quantize_row(source, inner, row_scales[row], zero_point_, target);
      if (weights_.any_zero_point)
        for (int64_t k = 0; k < inner; ++k) row_sums[row] += target[k];
    }
  }

  PackedWeights weights_;
  float inverse_levels_ = 0.0f;
  int zero_point_ = 0;
  bool relu_ = false, has_residual_ = false, vnni_ = false, amx_ = false;
};

struct QuantizedMatMulOp : CpuKernelOp<QuantizedMatMulOp, QuantizedMatMulKernel> {
  const char* GetName() const { return "QuantizedMatMul"; }
  size_t GetInputTypeCount() const { return kInputs; }  // x, weight, weight scale, weight zero point, bias, residual
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == kWeight || index == kWeightZeroPoint ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= kBias ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* quantized_matmul_op() {
  static QuantizedMatMulOp op;
  return &op;
}

uint64_t quantized_matmul_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
