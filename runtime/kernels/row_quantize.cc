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
#include "row_quantization.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("row quantization", what); }

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
    ShapeAndCount in = shape_and_count(input);
    std::vector<int64_t>& shape = in.dims;
    if (shape.empty()) refuse("the input needs at least one axis");
    Ort::UnownedValue levels = context.GetOutput(0, shape);
    const int64_t width = shape.back();
    shape.back() = 1;
    Ort::UnownedValue scales = context.GetOutput(1, shape);
    const size_t rows = width == 0 ? 0 : static_cast<size_t>(in.count) / static_cast<size_t>(width);
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

struct RowQuantizeOp : CpuKernelOp<RowQuantizeOp, RowQuantizeKernel> {
  const char* GetName() const { return "RowQuantize"; }
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
