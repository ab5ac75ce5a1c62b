// A CPU kernel for the decoder's candidate search as the exporter writes it: Gather(log_probs, candidate_rows) then
// TopK(largest, sorted) over the vocabulary. The runtime replaces the pair with this one node when the library is
// loaded (runtime/candidate_top_k_fusion.py), in memory only: the graph on disk is unchanged.
//
// Why: ONNX Runtime's TopK selects with nth_element over an index array of the whole row and the Gather copies every
// candidate row first; at beam 4 the two took 16% of the int8 decoder's kernel time at 128 rows (Intel Xeon, one
// thread). Here each row is read once, 8 values to a compare against the k-th best so far, and the few values that
// pass go into a sorted list of k.
//
// Same outputs: the values are the row's own (copied, not computed), in descending order, and equal values keep the
// lower index first, as ONNX Runtime's TopK orders them.

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("candidate top-k", what); }

// The best `k` of a row so far, best first; a value enters only if strictly greater than the one it displaces, so of
// equal values the earlier index (the row is read in order) stays ahead.
struct Best {
  float* values;
  int64_t* ids;
  int64_t k, filled = 0;

  void offer(float value, int64_t id) {
    if (filled == k && !(value > values[k - 1])) return;
    int64_t at = filled < k ? filled++ : k - 1;
    for (; at > 0 && value > values[at - 1]; --at) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
    }
    values[at] = value;
    ids[at] = id;
  }
};

void top_k_row(const float* row, int64_t width, Best best) {
  int64_t i = 0;
  for (; i < width && best.filled < best.k; ++i) best.offer(row[i], i);
  for (; i + 8 <= width; i += 8) {
    const __m256 threshold = _mm256_set1_ps(best.values[best.k - 1]);
    int passed = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), threshold, _CMP_GT_OQ));
    for (; passed != 0; passed &= passed - 1) {
      const int lane = __builtin_ctz(static_cast<unsigned>(passed));
      best.offer(row[i + lane], i + lane);  // offer re-checks against the threshold the lanes before it raised
    }
  }
  for (; i < width; ++i) best.offer(row[i], i);
}

struct TopKTask {
  const float* data;
  const int64_t* rows;
  int64_t data_rows, width, k;
  float* values;
  int64_t* ids;
};

void run_row(void* raw_task, size_t index) {
  const TopKTask& task = *static_cast<const TopKTask*>(raw_task);
  const int64_t row = task.rows[index] < 0 ? task.rows[index] + task.data_rows : task.rows[index];
  top_k_row(task.data + row * task.width, task.width, Best{task.values + index * task.k, task.ids + index * task.k, task.k});
}

class CandidateTopKKernel {
 public:
  explicit CandidateTopKKernel(const OrtKernelInfo* /*info*/) {}

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue data = context.GetInput(0), rows = context.GetInput(1), count = context.GetInput(2);
    const std::vector<int64_t> shape = data.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2) refuse("the log-probs must be (rows, vocabulary)");
    if (count.GetTensorTypeAndShapeInfo().GetElementCount() != 1) refuse("k must be one value");
    const int64_t k = count.GetTensorData<int64_t>()[0];
    if (k < 0 || k > shape[1]) refuse("k must be between 0 and the vocabulary size");
    const int64_t picked = static_cast<int64_t>(rows.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t* row_ids = rows.GetTensorData<int64_t>();
    for (int64_t i = 0; i < picked; ++i)
      if (row_ids[i] < -shape[0] || row_ids[i] >= shape[0]) refuse("a candidate row is out of range");
    Ort::UnownedValue values = context.GetOutput(0, {picked, k});
    Ort::UnownedValue ids = context.GetOutput(1, {picked, k});
    TopKTask task{data.GetTensorData<float>(), row_ids, shape[0], shape[1], k, values.GetTensorMutableData<float>(),
                  ids.GetTensorMutableData<int64_t>()};
    if (k > 0 && picked > 0) context.ParallelFor(run_row, static_cast<size_t>(picked), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }
};

struct CandidateTopKOp : CpuKernelOp<CandidateTopKOp, CandidateTopKKernel> {
  const char* GetName() const { return "CandidateTopK"; }
  size_t GetInputTypeCount() const { return 3; }  // log-probs (rows, V), candidate rows (n), k (1)
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 2; }  // values (n, k), their token ids (n, k)
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
};

}  // namespace

const OrtCustomOp* candidate_top_k_op() {
  static CandidateTopKOp op;
  return &op;
}

uint64_t candidate_top_k_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
