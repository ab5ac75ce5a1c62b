// A CPU kernel for one whole float weight product as the exporter writes it: MatMul against a constant (K, N) weight,
// then the stock nodes after it that touch each output alone: the bias Add, and a ReLU or the residual Add. The
// runtime replaces each such block of a float graph with this one node when the library is loaded
// (runtime/float_matmul_fusion.py), in memory only: the graph on disk is unchanged.
//
// Why: at one decoder row a float step is the read of its weights (19.2 MB for the default model's 19 products), and
// ONNX Runtime's MatMul read them at 24.8 GB/s where one core reads such a buffer at 28.4 GB/s (Intel Xeon with AMX);
// and a product with its bias, residual and ReLU costs up to four node dispatches and three passes over its output.
//
// Within float rounding of the nodes it replaces, not the same bits: each output is one fused multiply-add per k in
// k's order from zero, then + bias, + residual and max(0, .) in the graph's order. The AVX-512 and AVX2 paths do
// exactly that, so they agree bit for bit, and a row's outputs do not depend on the other rows of the call.
//
// Weights are packed once, when the session makes the kernel: panels of 16 columns, each panel's K rows of 16
// floats in a row, so that a tile streams each of its panels from one address upward.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

constexpr const char* kKernel = "float weight product";

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse(kKernel, what); }

enum Input : size_t { kX, kWeight, kBias, kResidual, kInputs };

constexpr int64_t kPanel = 16;      // columns per packed panel: one 512-bit register, two 256-bit ones
constexpr int kTilePanels = 4;      // panels per column task: its weights come in once for all the rows
constexpr int kTileRows512 = 6;     // AVX-512: 6 rows x 4 panels = 24 accumulators of the 32 zmm registers
constexpr int kTileRowsAvx2 = 6;    // AVX2: 6 rows x 1 panel x 2 halves = 12 accumulators of the 16 ymm registers

struct AlignedFree {
  void operator()(float* data) const { std::free(data); }
};

struct PackedWeights {
  int64_t inner = 0, width = 0, panels = 0;
  std::unique_ptr<float[], AlignedFree> values;  // panels x inner x 16, 64-byte aligned; columns past N are zeros
  std::vector<float> bias;                       // panels x 16; zeros past N and where the node has no bias
  bool has_bias = false;
};

struct Operands {
  const PackedWeights* weights;
  const float* x;         // rows x inner
  const float* residual;  // rows x width, or null
  float* out;             // rows x width
  int64_t rows;
  bool relu;
};

// The AVX2 path's epilogue of one row's 16 columns from `column`, those in range: + bias, + residual, ReLU, in the
// order and with the values of the AVX-512 path's vector epilogue (its max(y, 0) gives +0 for -0 and for NaN).
inline void finish(const Operands& op, int64_t row, int64_t column, const float* sums) {
  const PackedWeights& w = *op.weights;
  const int64_t lanes = std::min<int64_t>(kPanel, w.width - column);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    float y = sums[lane];
    if (w.has_bias) y = y + w.bias[column + lane];
    if (op.residual) y = y + op.residual[row * w.width + column + lane];
    if (op.relu) y = y > 0.0f ? y : 0.0f;
    op.out[row * w.width + column + lane] = y;
  }
}

// Rows [row0, row0 + Rows) x panels [panel0, panel0 + Panels) on AVX-512.
template <int Rows, int Panels>
__attribute__((target("avx512f"))) void tile_avx512(const Operands& op, int64_t row0, int64_t panel0) {
  const PackedWeights& w = *op.weights;
  const int64_t inner = w.inner;
  __m512 sums[Rows][Panels];
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p) sums[r][p] = _mm512_setzero_ps();
  const float* panel = w.values.get() + panel0 * inner * kPanel;
  const float* x = op.x + row0 * inner;
  for (int64_t k = 0; k < inner; ++k) {
    __m512 weights[Panels];
    for (int p = 0; p < Panels; ++p) weights[p] = _mm512_load_ps(panel + (p * inner + k) * kPanel);
    for (int r = 0; r < Rows; ++r) {
      const __m512 value = _mm512_set1_ps(x[r * inner + k]);
      for (int p = 0; p < Panels; ++p) sums[r][p] = _mm512_fmadd_ps(value, weights[p], sums[r][p]);
    }
  }
  for (int p = 0; p < Panels; ++p) {
    const int64_t column = (panel0 + p) * kPanel;
    const int64_t lanes = std::min<int64_t>(kPanel, w.width - column);
    const __mmask16 mask = static_cast<__mmask16>(lanes == kPanel ? 0xFFFF : (1u << lanes) - 1);
    const __m512 bias = _mm512_loadu_ps(w.bias.data() + column);
    for (int r = 0; r < Rows; ++r) {
      const int64_t row = row0 + r;
      __m512 y = sums[r][p];
      if (w.has_bias) y = _mm512_add_ps(y, bias);
      if (op.residual) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, op.residual + row * w.width + column));
      if (op.relu) y = _mm512_maskz_max_ps(0xFFFF, y, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(op.out + row * w.width + column, mask, y);
    }
  }
}

// Rows [row0, row0 + Rows) x one panel on AVX2 + FMA, as two 8-column halves.
template <int Rows>
void tile_avx2(const Operands& op, int64_t row0, int64_t panel_index) {
  const PackedWeights& w = *op.weights;
  const int64_t inner = w.inner;
  __m256 low[Rows], high[Rows];
  for (int r = 0; r < Rows; ++r) low[r] = high[r] = _mm256_setzero_ps();
  const float* panel = w.values.get() + panel_index * inner * kPanel;
  const float* x = op.x + row0 * inner;
  for (int64_t k = 0; k < inner; ++k) {
    const __m256 weights_low = _mm256_load_ps(panel + k * kPanel), weights_high = _mm256_load_ps(panel + k * kPanel + 8);
    for (int r = 0; r < Rows; ++r) {
      const __m256 value = _mm256_broadcast_ss(x + r * inner + k);
      low[r] = _mm256_fmadd_ps(value, weights_low, low[r]);
      high[r] = _mm256_fmadd_ps(value, weights_high, high[r]);
    }
  }
  const int64_t column = panel_index * kPanel;
  for (int r = 0; r < Rows; ++r) {
    alignas(32) float sums[kPanel];
    _mm256_store_ps(sums, low[r]);
    _mm256_store_ps(sums + 8, high[r]);
    finish(op, row0 + r, column, sums);
  }
}

using Tile512 = void (*)(const Operands&, int64_t, int64_t);
const Tile512 kTiles512[kTileRows512][kTilePanels] = {
    {tile_avx512<1, 1>, tile_avx512<1, 2>, tile_avx512<1, 3>, tile_avx512<1, 4>},
    {tile_avx512<2, 1>, tile_avx512<2, 2>, tile_avx512<2, 3>, tile_avx512<2, 4>},
    {tile_avx512<3, 1>, tile_avx512<3, 2>, tile_avx512<3, 3>, tile_avx512<3, 4>},
    {tile_avx512<4, 1>, tile_avx512<4, 2>, tile_avx512<4, 3>, tile_avx512<4, 4>},
    {tile_avx512<5, 1>, tile_avx512<5, 2>, tile_avx512<5, 3>, tile_avx512<5, 4>},
    {tile_avx512<6, 1>, tile_avx512<6, 2>, tile_avx512<6, 3>, tile_avx512<6, 4>}};
using TileAvx2 = void (*)(const Operands&, int64_t, int64_t);
const TileAvx2 kTilesAvx2[kTileRowsAvx2] = {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};

struct ColumnTask {
  Operands operands;
  bool avx512;
};

// One ParallelFor index: up to four panels' columns for every row, so that their weights come in once.
void run_column_task(void* raw_task, size_t index) {
  const ColumnTask& task = *static_cast<const ColumnTask*>(raw_task);
  const Operands& op = task.operands;
  const int64_t panel0 = static_cast<int64_t>(index) * kTilePanels;
  const int panels = static_cast<int>(std::min<int64_t>(kTilePanels, op.weights->panels - panel0));
  if (task.avx512) {
    for (int64_t row = 0; row < op.rows; row += kTileRows512) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows512, op.rows - row));
      kTiles512[rows - 1][panels - 1](op, row, panel0);
    }
    return;
  }
  for (int64_t panel = panel0; panel < panel0 + panels; ++panel) {
    for (int64_t row = 0; row < op.rows; row += kTileRowsAvx2) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRowsAvx2, op.rows - row));
      kTilesAvx2[rows - 1](op, row, panel);
    }
  }
}

PackedWeights pack(const Ort::ConstKernelInfo& info) {
  int is_constant = 0;
  const Ort::ConstValue weight = info.GetTensorConstantInput(kWeight, &is_constant);
  if (!is_constant) refuse("the weight must be a constant initializer");
  const Ort::TensorTypeAndShapeInfo type = weight.GetTensorTypeAndShapeInfo();
  const std::vector<int64_t> shape = type.GetShape();
  if (shape.size() != 2 || type.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) refuse("the weight must be float (K, N)");
  PackedWeights w;
  w.inner = shape[0];
  w.width = shape[1];
  w.panels = (w.width + kPanel - 1) / kPanel;
  const int64_t padded_width = w.panels * kPanel;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(w.panels * w.inner * kPanel, 1)) * sizeof(float);
  w.values.reset(static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (!w.values) refuse("cannot allocate the packed weights");
  std::memset(w.values.get(), 0, bytes);
  const float* values = weight.GetTensorData<float>();
  for (int64_t k = 0; k < w.inner; ++k)
    for (int64_t n = 0; n < w.width; ++n) w.values[((n / kPanel) * w.inner + k) * kPanel + n % kPanel] = values[k * w.width + n];
  w.bias.assign(static_cast<size_t>(padded_width), 0.0f);
  w.has_bias = has_input(info, kBias);
  if (w.has_bias) {
    const std::vector<float> bias = constant_values<float>(info, kBias, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kKernel, "the bias");
    if (static_cast<int64_t>(bias.size()) != w.width) refuse("the bias needs N values");
    std::copy(bias.begin(), bias.end(), w.bias.begin());
  }
  return w;
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

class FloatMatMulKernel {
 public:
  explicit FloatMatMulKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    relu_ = optional_attribute<int64_t>(kernel_info, "relu", 0) != 0;
    has_residual_ = has_input(kernel_info, kResidual);
    weights_ = pack(kernel_info);
    avx512_ = kernels_isa_cap() != "avx2" && cpu_has_avx512();  // tests/test_float_matmul_fusion.py runs both paths
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue input = context.GetInput(kX);
    ShapeAndCount in = shape_and_count(input);
    std::vector<int64_t>& shape = in.dims;
    if (shape.empty() || shape.back() != weights_.inner) refuse("the input's last axis must be the weight's K");
    int64_t rows = 1;  // the product of the leading dimensions (MatMul's batch), whatever K
    for (size_t axis = 0; axis + 1 < shape.size(); ++axis) rows *= shape[axis];
    shape.back() = weights_.width;
    Ort::UnownedValue output = context.GetOutput(0, shape);
    const float* residual = nullptr;
    if (has_residual_) {
      const Ort::ConstValue value = context.GetInput(kResidual);
      if (value.GetTensorTypeAndShapeInfo().GetShape() != shape) refuse("the residual must have the output's shape");
      residual = value.GetTensorData<float>();
    }
    ColumnTask task{{&weights_, input.GetTensorData<float>(), residual, output.GetTensorMutableData<float>(), rows, relu_}, avx512_};
    if (rows > 0 && weights_.width > 0)
      context.ParallelFor(run_column_task, static_cast<size_t>((weights_.panels + kTilePanels - 1) / kTilePanels), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  PackedWeights weights_;
  bool relu_ = false, has_residual_ = false, avx512_ = false;
};

struct FloatMatMulOp : CpuKernelOp<FloatMatMulOp, FloatMatMulKernel> {
  const char* GetName() const { return "FloatMatMul"; }
  size_t GetInputTypeCount() const { return kInputs; }  // x, weight, bias, residual
  ONNXTensorElementDataType GetInputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= kBias ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* float_matmul_op() {
  static FloatMatMulOp op;
  return &op;
}

uint64_t float_matmul_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
