// A CPU kernel for the decoder's self-attention: com.microsoft GroupQueryAttention in the form the exporter writes (one
// new token per row, Q, K and V packed in the query input, the cache bound in place as past and present, each row at
// its own length `seqlens_k`; no rotary embedding, window, softcap or attention bias), over a float cache or an int8
// one with constant per-channel or per-tensor scales.
//
// Why: per (row, head) ONNX Runtime's kernel runs two general GEMM calls (after dequantizing an int8 cache); here each
// cached key and value is read once, an int8 one widened in registers with its scale folded into the query, for one
// dot product and one weighted sum.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// scores[t] = query . keys[t] for t < n, keys rows of 64 (an int8 cache's key scales already folded into query).
template <typename Cache>
void score_keys_64(const float* query, const Cache* keys, int n, float* scores) {
  __m256 q[8];
  for (int i = 0; i < 8; ++i) q[i] = _mm256_loadu_ps(query + 8 * i);
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    const Cache* k = keys + t * kFastHeadDim;
    __m256 a0 = _mm256_mul_ps(q[0], load8(k));
    __m256 a1 = _mm256_mul_ps(q[0], load8(k + kFastHeadDim));
    __m256 a2 = _mm256_mul_ps(q[0], load8(k + 2 * kFastHeadDim));
    __m256 a3 = _mm256_mul_ps(q[0], load8(k + 3 * kFastHeadDim));
    for (int i = 1; i < 8; ++i) {
      a0 = _mm256_fmadd_ps(q[i], load8(k + 8 * i), a0);
      a1 = _mm256_fmadd_ps(q[i], load8(k + kFastHeadDim + 8 * i), a1);
      a2 = _mm256_fmadd_ps(q[i], load8(k + 2 * kFastHeadDim + 8 * i), a2);
      a3 = _mm256_fmadd_ps(q[i], load8(k + 3 * kFastHeadDim + 8 * i), a3);
    }
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(scores + t, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  }
  for (; t < n; ++t) {
    const Cache* k = keys + t * kFastHeadDim;
    __m256 a = _mm256_mul_ps(q[0], load8(k));
    for (int i = 1; i < 8; ++i) a = _mm256_fmadd_ps(q[i], load8(k + 8 * i), a);
    scores[t] = sum8(a);
  }
}

// out = value_scale * sum_t weights[t] * values[t], values rows of 64.
template <typename Cache>
void weigh_values_64(const float* weights, const Cache* values, int n, const float* value_scale, float* out) {
  __m256 o[8];
  for (int i = 0; i < 8; ++i) o[i] = _mm256_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(weights[t]);
    const Cache* v = values + t * kFastHeadDim;
    for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, load8(v + 8 * i), o[i]);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(o[i], _mm256_loadu_ps(value_scale + 8 * i)));
}

template <typename Cache>
void score_keys_any(const float* query, const Cache* keys, int n, int64_t dh, float* scores) {
  for (int t = 0; t < n; ++t) {
    float s = 0.0f;
    for (int64_t d = 0; d < dh; ++d) s += query[d] * static_cast<float>(keys[t * dh + d]);
    scores[t] = s;
  }
}

template <typename Cache>
void weigh_values_any(const float* weights, const Cache* values, int n, int64_t dh, const float* value_scale, float* out) {
  for (int64_t d = 0; d < dh; ++d) {
    float s = 0.0f;
    for (int t = 0; t < n; ++t) s += weights[t] * static_cast<float>(values[t * dh + d]);
    out[d] = s * value_scale[d];
  }
}

// An int8 cache stores round(x / scale) clipped to int8, ties to even; a float cache stores x.
inline void store_row(const float* x, const float* scale, int64_t dh, int8_t* out) {
  for (int64_t d = 0; d < dh; ++d) {
    const float q = std::nearbyint(x[d] / scale[d]);
    out[d] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, q)));
  }
}

inline void store_row(const float* x, const float* /*scale*/, int64_t dh, float* out) { std::copy(x, x + dh, out); }

struct SelfAttentionShape {
  int64_t rows, heads, kv_heads, capacity, head_dim;
};

template <typename Cache>
struct SelfAttentionTask {
  SelfAttentionShape shape;
  float scale;
  const float* qkv;           // (rows, 1, (H + 2 KVH) Dh)
  const int32_t* positions;   // (rows): each row's cached tokens before this one
  const float* key_scale;     // (KVH, Dh): per-tensor scales expanded; ones for a float cache
  const float* value_scale;
  Cache* key_cache;           // (rows, KVH, capacity, Dh), written at each row's position
  Cache* value_cache;
  float* out;                 // (rows, 1, H Dh)
};

// One (row, kv head): store the row's new key and value, then every query head of that kv head attends.
template <typename Cache>
void attend_row_kv_head(void* data, size_t index) {
  const auto& task = *static_cast<const SelfAttentionTask<Cache>*>(data);
  const SelfAttentionShape& shape = task.shape;
  const int64_t row = static_cast<int64_t>(index) / shape.kv_heads, kv_head = static_cast<int64_t>(index) % shape.kv_heads;
  const int64_t dh = shape.head_dim, group = shape.heads / shape.kv_heads;
  const int64_t position = task.positions[row];
  const int n = static_cast<int>(position) + 1;
  const float* packed = task.qkv + row * (shape.heads + 2 * shape.kv_heads) * dh;
  const float* key_scale = task.key_scale + kv_head * dh;
  const float* value_scale = task.value_scale + kv_head * dh;
  const int64_t block = ((row * shape.kv_heads + kv_head) * shape.capacity) * dh;
  Cache* keys = task.key_cache + block;
  Cache* values = task.value_cache + block;
  store_row(packed + (shape.heads + kv_head) * dh, key_scale, dh, keys + position * dh);
  store_row(packed + (shape.heads + shape.kv_heads + kv_head) * dh, value_scale, dh, values + position * dh);
  thread_local std::vector<float> weights, scaled_query;
  weights.resize(static_cast<size_t>(n) + 8);
  scaled_query.resize(static_cast<size_t>(dh));
  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    const float* query = packed + head * dh;
    for (int64_t d = 0; d < dh; ++d) scaled_query[d] = query[d] * key_scale[d] * task.scale;
    float* out = task.out + (row * shape.heads + head) * dh;
    if (dh == kFastHeadDim) {
      score_keys_64(scaled_query.data(), keys, n, weights.data());
      softmax_in_place(weights.data(), n);
      weigh_values_64(weights.data(), values, n, value_scale, out);
    } else {
      score_keys_any(scaled_query.data(), keys, n, dh, weights.data());
      softmax_in_place(weights.data(), n);
      weigh_values_any(weights.data(), values, n, dh, value_scale, out);
    }
  }
}

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("self-attention", what); }

struct CacheScales {
  std::vector<float> key, value;  // (KVH * Dh) each
};

class SelfAttentionKernel {
 public:
  // A node in any other form is refused here, when the session is made, so that the runtime makes it without this
  // library (runtime/ort_step.py) rather than fail a call.
  explicit SelfAttentionKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    if (has_input(kernel_info, 1) || has_input(kernel_info, 2)) refuse("Q, K and V must come packed in input 0");
    for (size_t index = 7; index <= 11; ++index)
      if (has_input(kernel_info, index)) refuse("rotary caches, position ids, an attention bias and head sinks are not supported");
    const ONNXTensorElementDataType cache = kernel_info.GetInputTypeInfo(3).GetTensorTypeAndShapeInfo().GetElementType();
    int8_cache_ = cache == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (!int8_cache_ && cache != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) refuse("the cache must be int8 or float");
    const bool scales = has_input(kernel_info, 12) && has_input(kernel_info, 13);
    if (int8_cache_ && (!scales || optional_attribute<int64_t>(kernel_info, "kv_cache_bit_width", 0) != 8))
      refuse("an int8 cache needs kv_cache_bit_width=8 and its key and value scales (inputs 12, 13)");
    if (!int8_cache_ && (has_input(kernel_info, 12) || has_input(kernel_info, 13))) refuse("a float cache takes no scales");
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    kv_heads_ = kernel_info.GetAttribute<int64_t>("kv_num_heads");
    scale_ = optional_attribute(kernel_info, "scale", 0.0f);
    if (kv_heads_ <= 0 || heads_ % kv_heads_ != 0) refuse("num_heads must be a multiple of kv_num_heads");
    if (optional_attribute<int64_t>(kernel_info, "do_rotary", 0) != 0) refuse("rotary embedding is not supported");
    if (optional_attribute<int64_t>(kernel_info, "local_window_size", -1) != -1) refuse("a local window is not supported");
    if (optional_attribute<int64_t>(kernel_info, "smooth_softmax", 0) == 1) refuse("smooth softmax is not supported");
    if (optional_attribute<int64_t>(kernel_info, "qk_output", 0) != 0) refuse("qk_output is not supported");
    if (optional_attribute(kernel_info, "softcap", 0.0f) != 0.0f) refuse("softcap is not supported");
    prepare_scales(kernel_info);
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    if (int8_cache_) {
      run<int8_t>(context);
    } else {
      run<float>(context);
    }
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  template <typename Cache>
  void run(Ort::KernelContext& context) const {
    const Ort::ConstValue qkv = context.GetInput(0), past_key = context.GetInput(3), past_value = context.GetInput(4);
    const Ort::ConstValue positions = context.GetInput(5);
    const ShapeAndCount cache_facts = shape_and_count(past_key);
    const std::vector<int64_t>& cache_shape = cache_facts.dims;
    const SelfAttentionShape shape = check_shapes(qkv, cache_shape, past_value, positions);
    const int32_t* position = positions.GetTensorData<int32_t>();
    const bool prepared = shape.head_dim == prepared_head_dim_;
    const CacheScales read = prepared ? CacheScales{} : cache_scales(context.GetInput(12), context.GetInput(13), shape);
    const CacheScales& scales = prepared ? prepared_scales_ : read;
    Ort::UnownedValue out = context.GetOutput(0, {shape.rows, 1, heads_ * shape.head_dim});
    Ort::UnownedValue present_key = context.GetOutput(1, cache_shape), present_value = context.GetOutput(2, cache_shape);
    Cache* key_cache = present_key.GetTensorMutableData<Cache>();
    Cache* value_cache = present_value.GetTensorMutableData<Cache>();
    const size_t cache_bytes = static_cast<size_t>(cache_facts.count) * sizeof(Cache);
    // Bound in place the present is the past's memory; otherwise the present starts as a copy of the past.
    if (key_cache != past_key.GetTensorData<Cache>()) std::memcpy(key_cache, past_key.GetTensorData<Cache>(), cache_bytes);
    if (value_cache != past_value.GetTensorData<Cache>()) std::memcpy(value_cache, past_value.GetTensorData<Cache>(), cache_bytes);
    const float scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    SelfAttentionTask<Cache> task{shape, scale, qkv.GetTensorData<float>(), position,
                                  scales.key.data(), scales.value.data(),
                                  key_cache, value_cache, out.GetTensorMutableData<float>()};
    context.ParallelFor(attend_row_kv_head<Cache>, static_cast<size_t>(shape.rows * kv_heads_), 0, &task);
  }

  SelfAttentionShape check_shapes(const Ort::ConstValue& qkv, const std::vector<int64_t>& cache, const Ort::ConstValue& past_value,
                                  const Ort::ConstValue& positions) const {
    const std::vector<int64_t> q = qkv.GetTensorTypeAndShapeInfo().GetShape();
    if (cache.size() != 4 || past_value.GetTensorTypeAndShapeInfo().GetShape() != cache) refuse("past key and value must be (rows, KVH, capacity, Dh)");
    const SelfAttentionShape shape{cache[0], heads_, kv_heads_, cache[2], cache[3]};
    if (q.size() != 3 || q[0] != shape.rows || q[1] != 1 || q[2] != (heads_ + 2 * kv_heads_) * shape.head_dim)
      refuse("the packed query must be (rows, 1, (num_heads + 2 kv_num_heads) head width)");
    if (cache[1] != kv_heads_) refuse("the cache must hold kv_num_heads heads");
    if (positions.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(shape.rows)) refuse("seqlens_k must hold one length per row");
    const int32_t* position = positions.GetTensorData<int32_t>();
    for (int64_t row = 0; row < shape.rows; ++row)
      if (position[row] < 0 || position[row] >= shape.capacity) refuse("a row's length is outside the cache's capacity");
    return shape;
  }

  // The key and value scales once, when the session makes the kernel, where the cache's head width is fixed in the
  // graph and an int8 cache's scales are constant initializers (as the exporter writes them): each call then reads
  // them in place rather than building two vectors and querying two shapes. Otherwise each call reads its own.
  void prepare_scales(const Ort::ConstKernelInfo& info) {
    const std::vector<int64_t> cache = info.GetInputTypeInfo(3).GetTensorTypeAndShapeInfo().GetShape();
    if (cache.size() != 4 || cache[3] <= 0) return;
    int key_constant = 1, value_constant = 1;
    const Ort::ConstValue key = int8_cache_ ? info.GetTensorConstantInput(12, &key_constant) : Ort::ConstValue{nullptr};
    const Ort::ConstValue value = int8_cache_ ? info.GetTensorConstantInput(13, &value_constant) : Ort::ConstValue{nullptr};
    if (!key_constant || !value_constant) return;
    prepared_scales_ = cache_scales(key, value, SelfAttentionShape{0, heads_, kv_heads_, 0, cache[3]});
    prepared_head_dim_ = cache[3];
  }

  // The (KVH * Dh) key and value scales: an int8 cache's from its scale inputs, ones for a float cache.
  CacheScales cache_scales(const Ort::ConstValue& key, const Ort::ConstValue& value, const SelfAttentionShape& shape) const {
    if (!int8_cache_) {
      std::vector<float> ones(static_cast<size_t>(shape.kv_heads * shape.head_dim), 1.0f);
      return CacheScales{ones, ones};
    }
    return CacheScales{channel_scales(key, shape), channel_scales(value, shape)};
  }

  // (KVH * Dh) scales from a per-channel (1, KVH, 1, Dh) or a per-tensor (one value) scale input.
  static std::vector<float> channel_scales(const Ort::ConstValue& scale, const SelfAttentionShape& shape) {
    if (!static_cast<bool>(scale)) refuse("the cache's key and value scales (inputs 12, 13) are required");
    const size_t count = scale.GetTensorTypeAndShapeInfo().GetElementCount(), wanted = static_cast<size_t>(shape.kv_heads * shape.head_dim);
    const float* data = scale.GetTensorData<float>();
    if (count == wanted) return std::vector<float>(data, data + wanted);
    if (count == 1) return std::vector<float>(wanted, data[0]);
    refuse("a cache scale must be per tensor (1) or per channel (kv_num_heads x head width)");
  }

  int64_t heads_ = 0, kv_heads_ = 0;
  float scale_ = 0.0f;
  bool int8_cache_ = false;
  int64_t prepared_head_dim_ = -1;  // the head width the prepared scales are for; -1: none prepared
  CacheScales prepared_scales_;
};

// One op per cache type (ONNX Runtime merges ops of one name into one schema whose cache type is either).
template <ONNXTensorElementDataType CacheType>
struct SelfAttentionOp : CpuKernelOp<SelfAttentionOp<CacheType>, SelfAttentionKernel> {
  const char* GetName() const { return "GroupQueryAttention"; }
  // query, key, value, past key, past value, seqlens_k, total_sequence_length, cos, sin, position ids, attention bias,
  // head sink, key scale, value scale
  size_t GetInputTypeCount() const { return 14; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    switch (index) {
      case 3: case 4: return CacheType;
      case 5: case 6: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 9: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 0 || (index >= 3 && index <= 6) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }  // output, present key, present value
  ONNXTensorElementDataType GetOutputType(size_t index) const { return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : CacheType; }
};

}  // namespace

const OrtCustomOp* self_attention_op_int8() {
  static SelfAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8> op;
  return &op;
}

const OrtCustomOp* self_attention_op_float() {
  static SelfAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> op;
  return &op;
}

uint64_t self_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
