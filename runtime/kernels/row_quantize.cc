// A CPU kernel for one whole per-row activation quantization: x -> (uint8 levels, the row scales). In the graphs the
// exporter writes it is five stock nodes per weight product (Abs, ReduceMax, Mul by 1/127, QuantizeLinear of the
// zero points, blocked QuantizeLinear); the runtime replaces each such chain with this one node when the library is
// loaded (runtime/row_quantize_fusion.py), in memory only: the graph on disk is unchanged.
//
// Why: at one decoder row each of those nodes costs more in dispatch than in arithmetic; the chains are about a third
// of the int8 decoder's nodes. Same bytes: the row's max of |x| and its product with the constant are exact in any
// order, and each level is round-half-to-even(x / scale) clamped, then shifted by the zero point, as ONNX Runtime's
// QuantizeLinear computes it (a division, not a product with the reciprocal).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("row quantization", what); }

float max_abs(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float result = 0.0f;
  for (float lane : lanes) result = std::max(result, lane);
  for (; i < n; ++i) result = std::max(result, std::fabs(x[i]));
  return result;
}

// One level: NaN (0 / 0 in a row of zeros) becomes the lowest level, as the vector path's max(NaN, low) = low does.
uint8_t level(float x, float scale, float low, float high, int zero_point) {
  float v = x / scale;
  v = v > low ? v : low;
  v = v < high ? v : high;
  return static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)) + zero_point);
}

__m256i levels8(const float* x, __m256 scale, __m256 low, __m256 high) {
  const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x), scale), low), high);
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

void quantize_row(const float* x, int64_t n, float scale, int zero_point, uint8_t* out) {
  const float low = static_cast<float>(-zero_point), high = static_cast<float>(255 - zero_point);
  const __m256 scale8 = _mm256_set1_ps(scale), low8 = _mm256_set1_ps(low), high8 = _mm256_set1_ps(high);
  const __m256i shift = _mm256_set1_epi16(static_cast<int16_t>(zero_point));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i low16 = _mm256_add_epi16(_mm256_packs_epi32(levels8(x + i, scale8, low8, high8), levels8(x + i + 8, scale8, low8, high8)), shift);
    const __m256i high16 = _mm256_add_epi16(_mm256_packs_epi32(levels8(x + i + 16, scale8, low8, high8), levels8(x + i + 24, scale8, low8, high8)), shift);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low16, high16), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bytes);
  }
  for (; i < n; ++i) out[i] = level(x[i], scale, low, high, zero_point);
}

struct RowQuantizeTask {
  const float* input;
  int64_t width;
  float inverse_levels;
  int zero_point;
  uint8_t* levels;
  float* scales;
};

void quantize_rows(void* raw_task, size_t row) {
  const RowQuantizeTask& task = *static_cast<const RowQuantizeTask*>(raw_task);
  const float* x = task.input + row * task.width;
  const float scale = max_abs(x, task.width) * task.inverse_levels;
  task.scales[row] = scale;
  quantize_row(x, task.width, scale, task.zero_point, task.levels + row * task.width);
}

class RowQuantizeKernel {
 public:
  explicit RowQuantizeKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    inverse_levels_ = kernel_info.GetAttribute<float>("inverse_levels");
    const int64_t zero_point = kernel_info.GetAttribute<int64_t>("zero_point");
    if (zero_point < 0 || zero_point > 255) refuse("zero_point must be a uint8 value");
    if (!(inverse_levels_ > 0.0f)) refuse("inverse_levels must be positive");
    zero_point_ = static_cast<int>(zero_point);
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue input = context.GetInput(0);
    std::vector<int64_t> shape = input.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty()) refuse("the input needs at least one axis");
    Ort::UnownedValue levels = context.GetOutput(0, shape);
    const int64_t width = shape.back();
    shape.back() = 1;
    Ort::UnownedValue scales = context.GetOutput(1, shape);
    const size_t rows = width == 0 ? 0 : input.GetTensorTypeAndShapeInfo().GetElementCount() / static_cast<size_t>(width);
    RowQuantizeTask task{input.GetTensorData<float>(), width, inverse_levels_, zero_point_,
                         levels.GetTensorMutableData<uint8_t>(), scales.GetTensorMutableData<float>()};
    if (width == 0) std::fill_n(task.scales, scales.GetTensorTypeAndShapeInfo().GetElementCount(), 0.0f);
    context.ParallelFor(quantize_rows, rows, 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  float inverse_levels_ = 0.0f;
  int zero_point_ = 0;
};

struct RowQuantizeOp : Ort::CustomOpBase<RowQuantizeOp, RowQuantizeKernel> {
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const { return new RowQuantizeKernel(info); }
  const char* GetName() const { return "RowQuantize"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 2; }  // levels, row scales
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace

const OrtCustomOp* row_quantize_op() {
  static RowQuantizeOp op;
  return &op;
}

uint64_t row_quantize_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
