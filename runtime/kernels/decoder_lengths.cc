// A CPU kernel for the lengths a decoder's GroupQueryAttention reads, as the exporter writes them from the rows'
// positions: seqlens_k = Cast<int32>(positions), and total_sequence_length = Cast<int32>(ReduceMax(positions) + c).
// The runtime replaces those four nodes with this one when the library is loaded (runtime/decoder_lengths_fusion.py),
// in memory only: the graph on disk is unchanged.
//
// Why: four integer nodes of one value per row each cost a dispatch by ONNX Runtime's executor, which after the
// step's read of the weights runs from beyond L2 (docs/benchmarks.md#batch-1-what-reading-the-weights-costs-the-rest-of-the-step):
// fused, the default model's int8 decoder call took 0.962x-0.984x the time at 1 to 32 rows (Intel Xeon with AMX, one
// thread, two copies of each interleaved).
// Same values: int64 to int32 as Cast converts them (positions are far below 2^31), the largest plus the constant.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("decoder lengths", what); }

class DecoderLengthsKernel {
 public:
  explicit DecoderLengthsKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    offset_ = kernel_info.GetAttribute<int64_t>("offset");
    total_rank_ = kernel_info.GetAttribute<int64_t>("total_rank");
    if (total_rank_ != 0 && total_rank_ != 1) refuse("total_rank must be 0 (a scalar) or 1 (one value)");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue input = context.GetInput(0);
    const ShapeAndCount in = shape_and_count(input);
    const std::vector<int64_t>& shape = in.dims;
    const size_t count = static_cast<size_t>(in.count);
    if (count == 0) refuse("there must be at least one position");  // ReduceMax of no values has no largest either
    const int64_t* positions = input.GetTensorData<int64_t>();
    int32_t* lengths = context.GetOutput(0, shape).GetTensorMutableData<int32_t>();
    for (size_t row = 0; row < count; ++row) lengths[row] = static_cast<int32_t>(positions[row]);
    const std::vector<int64_t> total_shape = total_rank_ == 1 ? std::vector<int64_t>{1} : std::vector<int64_t>{};
    int32_t* total = context.GetOutput(1, total_shape).GetTensorMutableData<int32_t>();
    total[0] = static_cast<int32_t>(*std::max_element(positions, positions + count) + offset_);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  int64_t offset_ = 0, total_rank_ = 0;
};

struct DecoderLengthsOp : CpuKernelOp<DecoderLengthsOp, DecoderLengthsKernel> {
  const char* GetName() const { return "DecoderLengths"; }
  size_t GetInputTypeCount() const { return 1; }  // positions
  ONNXTensorElementDataType GetInputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
  size_t GetOutputTypeCount() const { return 2; }  // seqlens_k, total_sequence_length
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32; }
};

}  // namespace

const OrtCustomOp* decoder_lengths_op() {
  static DecoderLengthsOp op;
  return &op;
}

uint64_t decoder_lengths_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
