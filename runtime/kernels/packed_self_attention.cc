// A CPU kernel for the encoder's self-attention on packed rows, as the exporter writes it: the stacked query, key and
// value projection of the real tokens (1, T, 3D) gathered into the (N, S) layout (Gather, Reshape, Split, three
// Reshapes and Transposes), scores (MatMul, Div by sqrt(Dh), Add of the mask's bias), Softmax, the weighted values
// (MatMul), back to rows (Transpose, Reshape) and the real positions' rows gathered again (Gather). The runtime
// replaces the thirteen nodes with this one in a float encoder when the library is loaded
// (runtime/packed_attention_fusion.py, which says why not in an int8 one), in memory only: the graph on disk is
// unchanged.
//
// Why: the gathers, splits and transposes move every projection twice, and the attention products on (N, H, S, Dh)
// blocks of a few rows cost more in dispatch than in arithmetic: the glue and the attention were a third of the int8
// encoder's kernel time at 32 sources of 17 tokens (Intel Xeon, one thread). Here each source's keys are read in
// place, once per head.
//
// The same results up to the summation order of the dot products (as the decoder's attention kernels): for a query
// row, score[s] = (q . k_s) / divisor + bias[s] over the source's S positions, the softmax's weights (a weight whose
// exponent lies below -87 is 0, as e^-87 is below float's smallest normal and the stock exp of the mask's -1e4 is 0),
// then the weighted sum of the values. A source's result depends on its own rows alone, in an order fixed by their
// positions: it does not change with the other sources of the call or with the call's padded width.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("packed self-attention", what); }

enum Input : size_t { kQkv = 0, kLayout = 1, kReal = 2, kBias = 3, kInputs = 4 };

constexpr int kLanes = 8;
constexpr float kLowestExponent = -87.0f;  // exp8 clamps here; below it the weight is 0

struct Call {
  const float* qkv;         // rows x 3D: each packed row's query, key and value
  const int64_t* layout;    // N x S: the packed row at each (source, position)
  const int64_t* real;      // T: each output row's flat (source, position)
  const float* bias;        // N x S: added to every score of a key at that position
  float* out;               // T x D
  int64_t width, model, heads, head_size;
  float divisor;
};

// A query's scores[0, n) -> softmax weights in place: each score / divisor + bias, weights from exp8, zero below the
// lowest exponent and past n (the padding up to a multiple of 8, which the weighted values never read).
void softmax_flushing(float* scores, const float* bias, int64_t n, float divisor) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  const __m256 divide = _mm256_set1_ps(divisor), lowest_score = _mm256_set1_ps(-3.0e38f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 top8 = lowest_score;
  for (int64_t i = 0; i < padded; i += kLanes) {
    const __m256i live_lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane);
    const __m256 live = _mm256_castsi256_ps(live_lanes);
    const __m256 biased = _mm256_maskload_ps(bias + i, live_lanes);  // read up to n only: the last source's bias ends there
    const __m256 x = _mm256_blendv_ps(lowest_score, _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(scores + i), divide), biased), live);
    _mm256_storeu_ps(scores + i, x);
    top8 = _mm256_max_ps(top8, x);
  }
  alignas(32) float tops[kLanes];
  _mm256_store_ps(tops, top8);
  const __m256 shift = _mm256_set1_ps(*std::max_element(tops, tops + kLanes)), lowest = _mm256_set1_ps(kLowestExponent);
  __m256 total8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += kLanes) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(scores + i), shift);
    const __m256 e = _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, lowest, _CMP_GE_OQ));
    _mm256_storeu_ps(scores + i, e);
    total8 = _mm256_add_ps(total8, e);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / sum8(total8));
  for (int64_t i = 0; i < padded; i += kLanes) _mm256_storeu_ps(scores + i, _mm256_mul_ps(_mm256_loadu_ps(scores + i), inverse));
}

// Scores of Rows queries against Groups x 8 keys from `group0`: Rows x Groups independent sums, so the FMAs overlap
// rather than wait on one another (one sum at a time, the kernel ran at a quarter of this speed).
template <int Rows, int Groups>
void score_tile(const float* const* queries, const float* keys, int64_t padded, int64_t size, int64_t group0, float* scores) {
  __m256 sums[Rows][Groups];
  for (auto& row : sums)
    for (auto& sum : row) sum = _mm256_setzero_ps();
  const float* at = keys + group0 * kLanes;
  for (int64_t d = 0; d < size; ++d, at += padded) {
    __m256 key[Groups];
    for (int g = 0; g < Groups; ++g) key[g] = _mm256_loadu_ps(at + g * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const __m256 q = _mm256_set1_ps(queries[r][d]);
      for (int g = 0; g < Groups; ++g) sums[r][g] = _mm256_fmadd_ps(q, key[g], sums[r][g]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < Groups; ++g) _mm256_storeu_ps(scores + r * padded + (group0 + g) * kLanes, sums[r][g]);
}

constexpr int kTileRows = 4, kTileGroups = 3;  // 12 sums + 3 keys + 1 query of the 16 ymm registers
using ScoreTile = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, float*);
const ScoreTile kScoreTiles[kTileRows][kTileGroups] = {{score_tile<1, 1>, score_tile<1, 2>, score_tile<1, 3>},
                                                       {score_tile<2, 1>, score_tile<2, 2>, score_tile<2, 3>},
                                                       {score_tile<3, 1>, score_tile<3, 2>, score_tile<3, 3>},
                                                       {score_tile<4, 1>, score_tile<4, 2>, score_tile<4, 3>}};

// out = sum over s of weights[s] x values[s] (8-wide groups of the head, Groups independent sums); zero weights
// (masked keys) skipped.
template <int Groups>
void weighted_values(const float* weights, int64_t width, const float* values, const int64_t* rows, int64_t stride, float* out) {
  __m256 sums[Groups];
  for (auto& sum : sums) sum = _mm256_setzero_ps();
  for (int64_t s = 0; s < width; ++s) {
    if (weights[s] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(weights[s]);
    const float* value = values + rows[s] * stride;
    for (int g = 0; g < Groups; ++g) sums[g] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + g * kLanes), sums[g]);
  }
  for (int g = 0; g < Groups; ++g) _mm256_storeu_ps(out + g * kLanes, sums[g]);
}

using WeightedValues = void (*)(const float*, int64_t, const float*, const int64_t*, int64_t, float*);

constexpr int64_t kMaxHeadSize = 128;  // 16 sums of 8; the fusion (runtime/packed_attention_fusion.py) checks the same

template <int... Groups>
constexpr std::array<WeightedValues, sizeof...(Groups)> weighted_values_table(std::integer_sequence<int, Groups...>) {
  return {weighted_values<Groups + 1>...};
}

// The weighted sum for a head size: a multiple of 8 up to kMaxHeadSize; null for any other.
WeightedValues weighted_values_for(int64_t head_size) {
  static constexpr auto table = weighted_values_table(std::make_integer_sequence<int, kMaxHeadSize / kLanes>{});
  if (head_size <= 0 || head_size > kMaxHeadSize || head_size % kLanes != 0) return nullptr;
  return table[static_cast<size_t>(head_size / kLanes - 1)];
}

// One source's output rows [first, end): per head, the keys gathered transposed (head_size x S, S padded to 8), the
// scores of four queries at a time, each query's softmax and weighted values (read in place).
void attend_source(const Call& call, WeightedValues weigh, int64_t source, int64_t first, int64_t end) {
  const int64_t width = call.width, stride = 3 * call.model, size = call.head_size;
  const int64_t groups = (width + kLanes - 1) / kLanes, padded = groups * kLanes;
  thread_local std::vector<float> keys, scores;
  keys.assign(static_cast<size_t>(size * padded), 0.0f);
  scores.resize(static_cast<size_t>(kTileRows * padded));
  const int64_t* key_rows = call.layout + source * width;
  const float* bias = call.bias + source * width;
  for (int64_t head = 0; head < call.heads; ++head) {
    const int64_t offset = head * size;
    for (int64_t s = 0; s < width; ++s) {
      const float* key = call.qkv + key_rows[s] * stride + call.model + offset;
      for (int64_t d = 0; d < size; ++d) keys[d * padded + s] = key[d];
    }
    for (int64_t row0 = first; row0 < end; row0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, end - row0));
      const float* queries[kTileRows];
      for (int r = 0; r < rows; ++r) queries[r] = call.qkv + call.layout[call.real[row0 + r]] * stride + offset;
      for (int64_t group = 0; group < groups; group += kTileGroups) {
        const int tile_groups = static_cast<int>(std::min<int64_t>(kTileGroups, groups - group));
        kScoreTiles[rows - 1][tile_groups - 1](queries, keys.data(), padded, size, group, scores.data());
      }
      for (int r = 0; r < rows; ++r) {
        float* row_scores = scores.data() + r * padded;
        softmax_flushing(row_scores, bias, width, call.divisor);
        weigh(row_scores, width, call.qkv + 2 * call.model + offset, key_rows, stride, call.out + (row0 + r) * call.model + offset);
      }
    }
  }
}

// The output rows in runs of one source each (the real positions come in source order, so a source is one run).
struct Runs {
  const Call* call;
  WeightedValues weigh;
  std::vector<int64_t> starts;  // run r: rows [starts[r], starts[r + 1])
};

void attend_run(void* raw, size_t index) {
  const Runs& runs = *static_cast<const Runs*>(raw);
  const int64_t first = runs.starts[index], end = runs.starts[index + 1];
  attend_source(*runs.call, runs.weigh, runs.call->real[first] / runs.call->width, first, end);
}

class PackedSelfAttentionKernel {
 public:
  explicit PackedSelfAttentionKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    head_size_ = kernel_info.GetAttribute<int64_t>("head_size");
    divisor_ = kernel_info.GetAttribute<float>("divisor");
    weigh_ = weighted_values_for(head_size_);
    if (heads_ <= 0) refuse("num_heads must be positive");
    if (weigh_ == nullptr) refuse("head_size must be a multiple of 8 up to 128");
    if (!(divisor_ > 0.0f)) refuse("divisor must be positive");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue qkv = context.GetInput(kQkv), layout = context.GetInput(kLayout), real = context.GetInput(kReal),
                          bias = context.GetInput(kBias);
    const std::vector<int64_t> qkv_shape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> bias_shape = bias.GetTensorTypeAndShapeInfo().GetShape();
    if (qkv_shape.size() != 3 || qkv_shape[0] != 1 || qkv_shape[2] != 3 * heads_ * head_size_)
      refuse("the projections must be (1, T, 3 x heads x head size)");
    if (bias_shape.size() != 4 || bias_shape[1] != 1 || bias_shape[2] != 1) refuse("the bias must be (N, 1, 1, S)");
    const int64_t rows = qkv_shape[1], sources = bias_shape[0], width = bias_shape[3], model = qkv_shape[2] / 3;
    const int64_t outputs = static_cast<int64_t>(real.GetTensorTypeAndShapeInfo().GetElementCount());
    if (static_cast<int64_t>(layout.GetTensorTypeAndShapeInfo().GetElementCount()) != sources * width)
      refuse("the layout must hold one row per (source, position)");
    Call call{qkv.GetTensorData<float>(), layout.GetTensorData<int64_t>(), real.GetTensorData<int64_t>(), bias.GetTensorData<float>(),
              nullptr, width, model, heads_, model / heads_, divisor_};
    // Indices out of range would read past the inputs: refused, as the stock Gathers refuse them.
    for (int64_t i = 0; i < sources * width; ++i)
      if (call.layout[i] < 0 || call.layout[i] >= rows) refuse("a layout index is out of range");
    Runs runs{&call, weigh_, {}};
    for (int64_t row = 0; row < outputs; ++row) {
      if (call.real[row] < 0 || call.real[row] >= sources * width) refuse("a real position is out of range");
      if (row == 0 || call.real[row] / width != call.real[row - 1] / width) runs.starts.push_back(row);
    }
    runs.starts.push_back(outputs);
    call.out = context.GetOutput(0, {1, outputs, model}).GetTensorMutableData<float>();
    if (outputs > 0) context.ParallelFor(attend_run, runs.starts.size() - 1, 0, &runs);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  int64_t heads_ = 0, head_size_ = 0;
  float divisor_ = 1.0f;
  WeightedValues weigh_ = nullptr;
};

struct PackedSelfAttentionOp : CpuKernelOp<PackedSelfAttentionOp, PackedSelfAttentionKernel> {
  const char* GetName() const { return "PackedSelfAttention"; }
  size_t GetInputTypeCount() const { return kInputs; }  // projections, layout, real positions, bias
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == kLayout || index == kReal ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* packed_self_attention_op() {
  static PackedSelfAttentionOp op;
  return &op;
}

uint64_t packed_self_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
