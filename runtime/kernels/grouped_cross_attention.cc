// A CPU kernel for one decoder layer's whole cross-attention as the exporter writes it: the rows' queries gathered
// into each group of sources (narrow and wide), a MultiHeadAttention per group, the two results concatenated and
// gathered back into row order; ten stock nodes per layer. The runtime replaces each such block with this one node
// when the library is loaded (runtime/cross_attention_fusion.py), in memory only: the graph on disk is unchanged.
//
// Why: at a few rows the block's gathers, reshapes and concat cost more in dispatch than the attention itself. Same
// bits: each (source, head) pair runs attend_source_head (cross_attention.cc), the MultiHeadAttention kernel's own
// code, on the query rows the gathers would have picked.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cross_attention.h"
#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("grouped cross-attention", what); }

// Inputs: the rows' queries (rows..., H * Dh); per group (narrow, then wide) its source_queries (S, Q) int64, key and
// value (S, H, L, Dh) and key padding mask (S, L) int32; row_queries (rows) int64.
enum Input : size_t { kQuery = 0, kNarrow = 1, kWide = 5, kRowQueries = 9, kInputs = 10 };

class GroupedCrossAttentionKernel {
 public:
  explicit GroupedCrossAttentionKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    scale_ = optional_attribute(kernel_info, "scale", 0.0f);
    if (heads_ <= 0) refuse("num_heads must be positive");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue query = context.GetInput(kQuery);
    const ShapeAndCount query_facts = shape_and_count(query);
    if (query_facts.dims.empty()) refuse("the query needs a last axis of num_heads x head width");
    const int64_t model_dim = query_facts.dims.back();
    const int64_t query_rows = model_dim == 0 ? 0 : query_facts.count / model_dim;
    thread_local std::vector<float> slots;  // the groups' (S, Q, H * Dh) outputs, narrow first, as the concat held them
    thread_local std::vector<int> live, live_counts;
    constexpr size_t kGroups[] = {kNarrow, kWide};
    std::vector<int64_t> tables[2];  // each group's source_queries shape, read once
    int64_t slot_count = 0;
    for (size_t g = 0; g < 2; ++g) {
      tables[g] = context.GetInput(kGroups[g]).GetTensorTypeAndShapeInfo().GetShape();
      if (tables[g].size() != 2) refuse("source_queries must be (S, Q)");
      slot_count += tables[g][0] * tables[g][1];
    }
    slots.resize(static_cast<size_t>(slot_count * model_dim));
    int64_t offset = 0;
    for (size_t g = 0; g < 2; ++g) {
      const size_t group = kGroups[g];
      const Ort::ConstValue table = context.GetInput(group), key = context.GetInput(group + 1);
      const Ort::ConstValue value = context.GetInput(group + 2), mask = context.GetInput(group + 3);
      const CrossAttentionShape shape = check_group(tables[g], table, key, value, mask, model_dim, query_rows);
      live_keys(mask.GetTensorData<int32_t>(), shape.sources, shape.keys, live, live_counts);
      const float scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
      CrossAttentionTask task{shape, scale, query.GetTensorData<float>(), key.GetTensorData<float>(), value.GetTensorData<float>(),
                              live.data(), live_counts.data(), slots.data() + offset * model_dim, table.GetTensorData<int64_t>()};
      context.ParallelFor(attend_source_head, static_cast<size_t>(shape.sources * shape.heads), 0, &task);
      offset += shape.sources * shape.queries;
    }
    const Ort::ConstValue row_queries = context.GetInput(kRowQueries);
    const int64_t rows = static_cast<int64_t>(row_queries.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t* slot_of_row = row_queries.GetTensorData<int64_t>();
    Ort::UnownedValue out = context.GetOutput(0, {rows, 1, model_dim});
    float* out_rows = out.GetTensorMutableData<float>();
    for (int64_t row = 0; row < rows; ++row) {
      if (slot_of_row[row] < 0 || slot_of_row[row] >= slot_count) refuse("a row_queries entry lies outside both groups' results");
      std::memcpy(out_rows + row * model_dim, slots.data() + slot_of_row[row] * model_dim, static_cast<size_t>(model_dim) * sizeof(float));
    }
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  CrossAttentionShape check_group(const std::vector<int64_t>& t, const Ort::ConstValue& table, const Ort::ConstValue& key,
                                  const Ort::ConstValue& value, const Ort::ConstValue& mask, int64_t model_dim, int64_t query_rows) const {
    const std::vector<int64_t> k = key.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> m = mask.GetTensorTypeAndShapeInfo().GetShape();
    if (k.size() != 4 || value.GetTensorTypeAndShapeInfo().GetShape() != k) refuse("key and value must be (S, H, L, Dh) alike");
    if (k[0] != t[0] || k[1] != heads_ || k[1] * k[3] != model_dim) refuse("source_queries, key, query and num_heads disagree");
    if (m.size() != 2 || m[0] != k[0] || m[1] != k[2]) refuse("the key padding mask must be (S, L)");
    const int64_t* rows = table.GetTensorData<int64_t>();
    for (int64_t i = 0; i < t[0] * t[1]; ++i)
      if (rows[i] < 0 || rows[i] >= query_rows) refuse("a source_queries entry names no query row");
    return CrossAttentionShape{t[0], t[1], model_dim, k[1], k[2], k[3]};
  }

  int64_t heads_ = 0;
  float scale_ = 0.0f;
};

struct GroupedCrossAttentionOp : CpuKernelOp<GroupedCrossAttentionOp, GroupedCrossAttentionKernel> {
  const char* GetName() const { return "GroupedCrossAttention"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == kRowQueries || index == kNarrow || index == kWide) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (index == kNarrow + 3 || index == kWide + 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }  // (rows, 1, H * Dh)
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* grouped_cross_attention_op() {
  static GroupedCrossAttentionOp op;
  return &op;
}

uint64_t grouped_cross_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
