// A CPU kernel for an int8 decoder's input embedding as the exporter and the int8 quantizer write it: the token rows
// Gathered from a uint8 table and dequantized, scaled by sqrt(d_model), plus the position rows Gathered from their own
// uint8 table, dequantized and unsqueezed to the tokens' (rows, 1, d_model). The runtime replaces those seven nodes
// with this one when the library is loaded (runtime/decoder_embedding_fusion.py), in memory only: the graph on disk
// is unchanged.
//
// Why: at a few rows each node does a few hundred multiply-adds, and each costs a dispatch by ONNX Runtime's
// executor, which after the step's read of the weights runs from beyond L2: fused, the default model's int8 decoder
// call took 0.965x-0.99x the time at 1 to 32 rows (Intel Xeon with AMX, one thread, two copies of each interleaved).
//
// Same bits on every CPU: ONNX Runtime's DequantizeLinear computes float(level - zero point) * scale on each of its
// paths (its reference loop and its vector kernels subtract in integers, convert exactly, then multiply once), and so
// does this kernel, then the embedding scale's product and the position's sum, each one IEEE float operation in the
// nodes' order; no step depends on the instruction set (tests/test_decoder_embedding_fusion.py compares a fused
// decoder's outputs with the stock graph's bit for bit).

// GCC would otherwise fuse a product and the addition after it into one FMA (the library is built with -mfma), which
// rounds once where the nodes round twice.
#pragma GCC optimize("fp-contract=off")

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

constexpr const char* kKernel = "decoder embedding";

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse(kKernel, what); }

enum Input : size_t {
  kTokenTable = 0, kTokenScale = 1, kTokenZeroPoint = 2, kTokenIds = 3, kEmbedScale = 4,
  kPositionTable = 5, kPositionScale = 6, kPositionZeroPoint = 7, kPositions = 8, kInputs = 9
};

// A uint8 table's shape and its per-tensor dequantization, read once when the session makes the kernel; its levels
// are read at each call from the input (the session's own copy of the initializer, not duplicated here).
struct Table {
  int64_t rows = 0, width = 0;
  float scale = 0.0f;
  int32_t zero_point = 0;
};

Table table(const Ort::ConstKernelInfo& info, size_t levels, size_t scale, size_t zero_point, const std::string& name) {
  int is_constant = 0;
  const Ort::ConstValue value = info.GetTensorConstantInput(levels, &is_constant);
  if (!is_constant) refuse("the " + name + " table must be a constant initializer");
  const std::vector<int64_t> shape = value.GetTensorTypeAndShapeInfo().GetShape();
  if (shape.size() != 2) refuse("the " + name + " table must be (rows, width)");
  const std::vector<float> scales = constant_values<float>(info, scale, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kKernel, "the " + name + " scale");
  const std::vector<uint8_t> zero_points =
      constant_values<uint8_t>(info, zero_point, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, kKernel, "the " + name + " zero point");
  if (scales.size() != 1 || zero_points.size() != 1) refuse("the " + name + " table needs one scale and one zero point");
  return Table{shape[0], shape[1], scales[0], static_cast<int32_t>(zero_points[0])};
}

class DecoderEmbeddingKernel {
 public:
  explicit DecoderEmbeddingKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    tokens_ = table(kernel_info, kTokenTable, kTokenScale, kTokenZeroPoint, "token");
    positions_ = table(kernel_info, kPositionTable, kPositionScale, kPositionZeroPoint, "position");
    if (tokens_.width != positions_.width) refuse("the token and position tables must be as wide");
    has_embed_scale_ = has_input(kernel_info, kEmbedScale);
    if (has_embed_scale_) {
      const std::vector<float> scale = constant_values<float>(kernel_info, kEmbedScale, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kKernel,
                                                              "the embedding scale");
      if (scale.size() != 1) refuse("the embedding scale must be one value");
      embed_scale_ = scale[0];
    }
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue ids = context.GetInput(kTokenIds), steps = context.GetInput(kPositions);
    const std::vector<int64_t> id_shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t rows = static_cast<int64_t>(steps.GetTensorTypeAndShapeInfo().GetElementCount());
    if (id_shape.size() != 2 || id_shape[0] != rows || id_shape[1] != 1) refuse("the token ids must be (rows, 1), one position per row");
    const int64_t width = tokens_.width;
    const uint8_t* token_table = context.GetInput(kTokenTable).GetTensorData<uint8_t>();
    const uint8_t* position_table = context.GetInput(kPositionTable).GetTensorData<uint8_t>();
    float* out = context.GetOutput(0, std::vector<int64_t>{rows, 1, width}).GetTensorMutableData<float>();
    const int64_t* token_ids = ids.GetTensorData<int64_t>();
    const int64_t* position_ids = steps.GetTensorData<int64_t>();
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t token = token_ids[row], position = position_ids[row];
      // The bounds Gather enforces, with its negative indices counted from the end.
      const int64_t token_row = token < 0 ? token + tokens_.rows : token, position_row = position < 0 ? position + positions_.rows : position;
      if (token_row < 0 || token_row >= tokens_.rows) refuse("a token id lies outside the embedding table");
      if (position_row < 0 || position_row >= positions_.rows) refuse("a position lies outside the position table");
      const uint8_t* token_levels = token_table + token_row * width;
      const uint8_t* position_levels = position_table + position_row * width;
      float* y = out + row * width;
      for (int64_t column = 0; column < width; ++column) {
        float token_value = static_cast<float>(static_cast<int32_t>(token_levels[column]) - tokens_.zero_point) * tokens_.scale;
        if (has_embed_scale_) token_value = token_value * embed_scale_;
        const float position_value = static_cast<float>(static_cast<int32_t>(position_levels[column]) - positions_.zero_point) * positions_.scale;
        y[column] = token_value + position_value;
      }
    }
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  Table tokens_, positions_;
  float embed_scale_ = 1.0f;
  bool has_embed_scale_ = false;
};

struct DecoderEmbeddingOp : CpuKernelOp<DecoderEmbeddingOp, DecoderEmbeddingKernel> {
  const char* GetName() const { return "DecoderEmbedding"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    switch (index) {
      case kTokenTable: case kTokenZeroPoint: case kPositionTable: case kPositionZeroPoint: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case kTokenIds: case kPositions: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == kEmbedScale ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* decoder_embedding_op() {
  static DecoderEmbeddingOp op;
  return &op;
}

uint64_t decoder_embedding_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
