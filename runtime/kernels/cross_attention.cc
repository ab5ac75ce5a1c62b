// A CPU kernel for the decoder's cross-attention: com.microsoft MultiHeadAttention in the one form the exporter
// writes (query (S, Q, D), key and value (S, H, L, Dh) already split into heads, no bias, a key padding mask
// (S, L) of int32). Loaded as a custom-op library into the decoder's session only; ONNX Runtime searches custom
// kernel registries before its own, so this kernel runs the graph's MultiHeadAttention nodes unchanged on disk.
//
// Why: ONNX Runtime's kernel multiplies each (source, head) pair through a general GEMM call and attends over the
// whole padded width; at 32 sources x 2 queries x 32 keys that is ~1 us per pair for ~8k multiply-adds. Here each
// pair is a dot product and a weighted sum over the source's live keys only, in AVX2 registers.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cross_attention.h"
#include "kernels.h"
#include "vector_math.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};  // Compute calls: the runtime reads them to confirm this kernel is the one that runs

// scores[t] = scale * (query . keys[live[t]]) for 64-wide heads; four keys at a time, so each query load serves four
// independent accumulators and one horizontal reduction yields four scores.
void score_keys_64(const float* query, const float* keys, const int* live, int n, float scale, float* scores) {
  __m256 q[8];
  for (int i = 0; i < 8; ++i) q[i] = _mm256_loadu_ps(query + 8 * i);
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    const float* k0 = keys + live[t] * kFastHeadDim;
    const float* k1 = keys + live[t + 1] * kFastHeadDim;
    const float* k2 = keys + live[t + 2] * kFastHeadDim;
    const float* k3 = keys + live[t + 3] * kFastHeadDim;
    __m256 a0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k0));
    __m256 a1 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k2));
    __m256 a3 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k3));
    for (int i = 1; i < 8; ++i) {
      a0 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k0 + 8 * i), a0);
      a1 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k1 + 8 * i), a1);
      a2 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k2 + 8 * i), a2);
      a3 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k3 + 8 * i), a3);
    }
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // (k0..k3 low, k0..k3 high)
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
    _mm_storeu_ps(scores + t, _mm_mul_ps(four, _mm_set1_ps(scale)));
  }
  for (; t < n; ++t) {
    const float* k = keys + live[t] * kFastHeadDim;
    __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
    for (int i = 1; i < 8; ++i) a = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k + 8 * i), a);
    scores[t] = sum8(a) * scale;
  }
}

// out = sum_t weights[t] * values[live[t]] for 64-wide heads, the output row held in eight registers.
void weigh_values_64(const float* weights, const float* values, const int* live, int n, float* out) {
  __m256 o[8];
  for (int i = 0; i < 8; ++i) o[i] = _mm256_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(weights[t]);
    const float* v = values + live[t] * kFastHeadDim;
    for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), o[i]);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
}

// Any other head width: the same sums, one element at a time.
void score_keys_any(const float* query, const float* keys, const int* live, int n, int64_t dh, float scale, float* scores) {
  for (int t = 0; t < n; ++t) {
    const float* k = keys + live[t] * dh;
    float s = 0.0f;
    for (int64_t d = 0; d < dh; ++d) s += query[d] * k[d];
    scores[t] = s * scale;
  }
}

void weigh_values_any(const float* weights, const float* values, const int* live, int n, int64_t dh, float* out) {
  std::fill(out, out + dh, 0.0f);
  for (int t = 0; t < n; ++t) {
    const float* v = values + live[t] * dh;
    for (int64_t d = 0; d < dh; ++d) out[d] += weights[t] * v[d];
  }
}

void prefetch_rows(const float* rows, const int* live, int n, int64_t dh) {
  for (int t = 0; t < n; ++t) prefetch_bytes(rows + live[t] * dh, static_cast<size_t>(dh) * sizeof(float));
}

}  // namespace

// One (source, head) pair: every query slot of that source against its live keys. A query bitwise equal to the
// source's first one (the engine repeats a source's first row to fill its query slots, and a beam's rows start alike)
// gets a copy of that query's output: the same inputs give the same output, and a greedy source costs one query, not two.
void attend_source_head(void* data, size_t index) {
  const auto& task = *static_cast<const CrossAttentionTask*>(data);
  const CrossAttentionShape& shape = task.shape;
  const int64_t source = static_cast<int64_t>(index) / shape.heads, head = static_cast<int64_t>(index) % shape.heads;
  const int* live = task.live + source * shape.keys;
  const int n = task.live_counts[source];
  const int64_t block = ((source * shape.heads + head) * shape.keys) * shape.head_dim;  // (S, H, L, Dh)
  // The whole block at once, the values arriving while the keys are scored (in the step, 213 against 429 us of
  // cross-attention at 32 rows: nmt-step-ablation --native-kernels auto).
  prefetch_rows(task.key + block, live, n, shape.head_dim);
  prefetch_rows(task.value + block, live, n, shape.head_dim);
  thread_local std::vector<float> weights;
  weights.resize(static_cast<size_t>(shape.keys) + 8);
  const auto query_at = [&](int64_t slot) {  // (rows, H * Dh): the slot's own row, or the row its table names
    const int64_t row = task.query_rows != nullptr ? task.query_rows[slot] : slot;
    return task.query + row * shape.model_dim + head * shape.head_dim;
  };
  const float* first = query_at(source * shape.queries);
  float* first_out = task.out + source * shape.queries * shape.model_dim + head * shape.head_dim;
  const size_t head_bytes = static_cast<size_t>(shape.head_dim) * sizeof(float);
  for (int64_t q = 0; q < shape.queries; ++q) {
    const float* query = query_at(source * shape.queries + q);
    float* out = task.out + (source * shape.queries + q) * shape.model_dim + head * shape.head_dim;  // (S, Q, H * Dh)
    if (q > 0 && std::memcmp(query, first, head_bytes) == 0) {
      std::memcpy(out, first_out, head_bytes);
    } else if (shape.head_dim == kFastHeadDim) {
      score_keys_64(query, task.key + block, live, n, task.scale, weights.data());
      softmax_in_place(weights.data(), n);
      weigh_values_64(weights.data(), task.value + block, live, n, out);
    } else {
      score_keys_any(query, task.key + block, live, n, shape.head_dim, task.scale, weights.data());
      softmax_in_place(weights.data(), n);
      weigh_values_any(weights.data(), task.value + block, live, n, shape.head_dim, out);
    }
  }
}

void live_keys(const int32_t* keep, int64_t sources, int64_t keys, std::vector<int>& live, std::vector<int>& live_counts) {
  live.assign(static_cast<size_t>(sources * keys), 0);
  live_counts.assign(static_cast<size_t>(sources), 0);
  for (int64_t s = 0; s < sources; ++s) {
    for (int64_t j = 0; j < keys; ++j)
      if (keep[s * keys + j] != 0) live[s * keys + live_counts[s]++] = static_cast<int>(j);
    // Every key masked: ONNX Runtime's kernel adds the same large negative number to every score, which leaves
    // the softmax over all keys; so does this one.
    if (live_counts[s] == 0)
      for (int64_t j = 0; j < keys; ++j) live[s * keys + live_counts[s]++] = static_cast<int>(j);
  }
}

namespace {

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("cross-attention", what); }

class CrossAttentionKernel {
 public:
  // A node in any other form is refused here, when the session is made, so that the runtime makes it without this
  // library (runtime/ort_step.py) rather than fail a call.
  explicit CrossAttentionKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    if (has_input(kernel_info, 3)) refuse("a bias input is not supported");
    if (!has_input(kernel_info, 4)) refuse("the key padding mask (input 4) is required");
    if (kernel_info.GetInputCount() > 5) refuse("inputs past the key padding mask are not supported");
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    scale_ = optional_attribute(kernel_info, "scale", 0.0f);  // absent: 1 / sqrt(head width), as ONNX Runtime's kernel
    if (optional_attribute<int64_t>(kernel_info, "unidirectional", 0) != 0) refuse("unidirectional=1 is not supported");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue query = context.GetInput(0), key = context.GetInput(1), value = context.GetInput(2);
    const Ort::ConstValue bias = context.GetInput(3), mask = context.GetInput(4);
    const std::vector<int64_t> query_shape = query.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> key_shape = key.GetTensorTypeAndShapeInfo().GetShape();
    const CrossAttentionShape shape = check_shapes(query_shape, key_shape, value, bias, mask);
    Ort::UnownedValue out = context.GetOutput(0, query_shape);
    const int32_t* keep = mask.GetTensorData<int32_t>();
    std::vector<int> live, live_counts;
    live_keys(keep, shape.sources, shape.keys, live, live_counts);
    const float scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    CrossAttentionTask task{shape, scale, query.GetTensorData<float>(), key.GetTensorData<float>(),
                            value.GetTensorData<float>(), live.data(), live_counts.data(),
                            out.GetTensorMutableData<float>(), nullptr};
    context.ParallelFor(attend_source_head, static_cast<size_t>(shape.sources * shape.heads), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  CrossAttentionShape check_shapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k, const Ort::ConstValue& value,
                                   const Ort::ConstValue& bias, const Ort::ConstValue& mask) const {
    if (q.size() != 3 || k.size() != 4) refuse("query must be (S, Q, D) and key (S, H, L, Dh)");
    if (static_cast<bool>(bias) || !static_cast<bool>(mask)) refuse("a bias input, or no key padding mask");
    const std::vector<int64_t> v = value.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> m = mask.GetTensorTypeAndShapeInfo().GetShape();
    if (v != k) refuse("value must have key's shape");
    if (k[0] != q[0] || k[1] != heads_ || k[1] * k[3] != q[2]) refuse("query, key and num_heads disagree");
    if (m.size() != 2 || m[0] != k[0] || m[1] != k[2]) refuse("the key padding mask must be (S, L)");
    return CrossAttentionShape{q[0], q[1], q[2], k[1], k[2], k[3]};
  }

  int64_t heads_ = 0;
  float scale_ = 0.0f;
};

struct CrossAttentionOp : CpuKernelOp<CrossAttentionOp, CrossAttentionKernel> {
  const char* GetName() const { return "MultiHeadAttention"; }
  size_t GetInputTypeCount() const { return 5; }  // query, key, value, bias (absent), key padding mask
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* cross_attention_op() {
  static CrossAttentionOp op;
  return &op;
}

uint64_t cross_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
