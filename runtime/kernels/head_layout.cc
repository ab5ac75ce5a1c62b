// CPU kernels for the layout moves around an int8 encoder layer's self-attention, as the exporter writes them on
// packed rows (export/graphs.py: packed_self_attention). The runtime replaces each run of stock nodes with one of these
// nodes when the library is loaded (runtime/head_layout_fusion.py), in memory only: the graph on disk is unchanged.
//
//   PackedToHeads: a stacked projection's packed rows gathered into the (N, S) grid (Gather on axis 1, Reshape),
//     split into its parts (Split on axis 2: a self-attention's query, key and value, or the cross-attention keys and
//     values of every decoder layer) and each part's heads laid out (Reshape, Transpose): to (N, H, S, Dh), or to
//     (N, H, Dh, S) where the part's `transposed` flag is 1 (a self-attention's keys). 3 + 2 x parts nodes.
//   HeadsToPacked: the weighted values back to rows (Transpose to (N, S, H, Dh), Reshape to (1, N * S, H * Dh)) and the
//     real positions' rows gathered (Gather on axis 1). Three nodes.
//
// Why: these nodes only move data, yet ONNX Runtime's Transpose, Split and Gather took 21% of the int8 encoder's kernel
// time at batch 32 (AMD EPYC with AVX-512 VNNI, one thread), each writing a whole tensor that the next one reads
// again. Here each float is read once and written once, in place of its last destination. The keys' (N, H, Dh, S)
// layout is written eight positions by eight values at a time, transposed in registers: one float at a time, each
// store went to another line, and the int8 encoder call took 1.01x-1.09x as long at batch 8 and 1.04x-1.08x at batch
// 32 (Intel Xeon with AMX, one thread, three comparisons of the two libraries interleaved in one process; the same
// bits). The products, scores and softmax between them stay ONNX Runtime's own:
// the values are copied, never computed, so the bits are the stock nodes'.

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

namespace nmt_kernels {
namespace {

std::atomic<uint64_t> g_calls{0};

[[noreturn]] void refuse(const std::string& what) { nmt_kernels::refuse("head layout", what); }

// Gather's index rule: -dim <= index < dim, a negative one counting from the end.
int64_t checked_index(int64_t index, int64_t dim, const char* what) {
  if (index < -dim || index >= dim) refuse(std::string(what) + " is out of range");
  return index < 0 ? index + dim : index;
}

// A 1-D int64 shape input of `count` values.
std::vector<int64_t> shape_values(const Ort::ConstValue& value, size_t count, const char* what) {
  if (value.GetTensorTypeAndShapeInfo().GetElementCount() != count) refuse(std::string(what) + " must have " + std::to_string(count) + " values");
  const int64_t* data = value.GetTensorData<int64_t>();
  return std::vector<int64_t>(data, data + count);
}

struct ToHeadsTask {
  const float* rows;      // (P, parts x H x Dh)
  const int64_t* grid;    // (N x S): each grid position's packed row
  int64_t positions, heads, head_size;
  std::vector<int64_t> transposed;
  std::vector<float*> parts;
};

// Eight rows of eight floats transposed in registers: rows[r][c] -> out[c * stride + r].
inline void transpose8x8(const float* const rows[8], int64_t column, float* out, int64_t stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + column);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // r[i] holds columns i and i + 4 of rows 0-3, r[i + 4] the same of rows 4-7
    _mm256_storeu_ps(out + i * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// One source's heads of one transposed part, (H, Dh, S): eight positions by eight of a head's values at a time in
// registers, so each store writes eight consecutive positions (one float at a time, every store missed a new line).
void keys_for_source(const ToHeadsTask& task, int64_t n, int64_t part, int64_t width) {
  const int64_t positions = task.positions, size = task.head_size, model = task.heads * size;
  const int64_t blocked = positions / 8 * 8, columns = size / 8 * 8;
  for (int64_t h = 0; h < task.heads; ++h) {
    float* head = task.parts[part] + (n * task.heads + h) * positions * size;
    const int64_t offset = part * model + h * size;
    for (int64_t s = 0; s < blocked; s += 8) {
      const float* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = task.rows + task.grid[n * positions + s + i] * width + offset;
      for (int64_t d = 0; d < columns; d += 8) transpose8x8(rows, d, head + d * positions + s, positions);
      for (int64_t d = columns; d < size; ++d)
        for (int i = 0; i < 8; ++i) head[d * positions + s + i] = rows[i][d];
    }
    for (int64_t s = blocked; s < positions; ++s) {
      const float* from = task.rows + task.grid[n * positions + s] * width + offset;
      for (int64_t d = 0; d < size; ++d) head[d * positions + s] = from[d];
    }
  }
}

void to_heads_for_source(void* raw_task, size_t source) {
  const ToHeadsTask& task = *static_cast<const ToHeadsTask*>(raw_task);
  const int64_t model = task.heads * task.head_size, n = static_cast<int64_t>(source);
  const int64_t parts = static_cast<int64_t>(task.parts.size()), width = parts * model;
  for (int64_t s = 0; s < task.positions; ++s) {
    const float* row = task.rows + task.grid[n * task.positions + s] * width;
    for (int64_t part = 0; part < parts; ++part) {
      if (task.transposed[part]) continue;
      for (int64_t h = 0; h < task.heads; ++h) {
        float* head = task.parts[part] + (n * task.heads + h) * task.positions * task.head_size;
        std::memcpy(head + s * task.head_size, row + part * model + h * task.head_size, sizeof(float) * task.head_size);
      }
    }
  }
  for (int64_t part = 0; part < parts; ++part)
    if (task.transposed[part]) keys_for_source(task, n, part, width);
}

class PackedToHeadsKernel {
 public:
  explicit PackedToHeadsKernel(const OrtKernelInfo* info) {
    const Ort::ConstKernelInfo kernel_info(info);
    transposed_ = kernel_info.GetAttributes<int64_t>("transposed");
    if (transposed_.size() != kernel_info.GetOutputCount()) refuse("transposed must give one flag for each output");
    for (const int64_t flag : transposed_)
      if (flag != 0 && flag != 1) refuse("transposed flags must be 0 or 1");
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue rows = context.GetInput(0), grid = context.GetInput(1);
    const std::vector<int64_t> shape = rows.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 3 || shape[0] != 1) refuse("the projections must be (1, rows, parts x H x Dh)");
    const int64_t parts = static_cast<int64_t>(transposed_.size());
    const std::vector<int64_t> grid_shape = shape_values(context.GetInput(2), 3, "the grid shape");
    const std::vector<int64_t> head_shape = shape_values(context.GetInput(3), 4, "the head shape");
    const int64_t sources = grid_shape[0], positions = grid_shape[1], heads = head_shape[2], head_size = head_shape[3];
    if (sources < 0 || positions < 0 || grid_shape[2] != shape[2]) refuse("the grid shape must be (N, S, the projections' width)");
    if (head_shape[0] != sources || head_shape[1] != positions || heads <= 0 || head_size <= 0 || parts * heads * head_size != shape[2])
      refuse("the head shape must be (N, S, H, Dh) with parts x H x Dh the projections' width");
    if (static_cast<int64_t>(grid.GetTensorTypeAndShapeInfo().GetElementCount()) != sources * positions)
      refuse("the grid must give one packed row for each of the N x S positions");
    const int64_t* grid_rows = grid.GetTensorData<int64_t>();
    std::vector<int64_t> checked(grid_rows, grid_rows + sources * positions);
    for (int64_t& row : checked) row = checked_index(row, shape[1], "a grid position's packed row");
    ToHeadsTask task{rows.GetTensorData<float>(), checked.data(), positions, heads, head_size, transposed_, {}};
    for (int64_t part = 0; part < parts; ++part) {
      const std::vector<int64_t> out = transposed_[part] ? std::vector<int64_t>{sources, heads, head_size, positions}
                                                         : std::vector<int64_t>{sources, heads, positions, head_size};
      task.parts.push_back(context.GetOutput(static_cast<size_t>(part), out).GetTensorMutableData<float>());
    }
    if (sources > 0 && positions > 0) context.ParallelFor(to_heads_for_source, static_cast<size_t>(sources), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::vector<int64_t> transposed_;  // per output: 1 = (N, H, Dh, S), 0 = (N, H, S, Dh)
};

struct ToPackedTask {
  const float* heads_data;  // (N, H, S, Dh)
  const int64_t* real;      // (P): each packed row's grid position, n * S + s
  int64_t heads, positions, head_size;
  float* packed;            // (P, H * Dh)
};

void to_packed_row(void* raw_task, size_t index) {
  const ToPackedTask& task = *static_cast<const ToPackedTask*>(raw_task);
  const int64_t position = task.real[index], n = position / task.positions, s = position % task.positions;
  float* row = task.packed + static_cast<int64_t>(index) * task.heads * task.head_size;
  for (int64_t h = 0; h < task.heads; ++h)
    std::memcpy(row + h * task.head_size, task.heads_data + ((n * task.heads + h) * task.positions + s) * task.head_size,
                sizeof(float) * task.head_size);
}

class HeadsToPackedKernel {
 public:
  explicit HeadsToPackedKernel(const OrtKernelInfo* /*info*/) {}

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue heads = context.GetInput(0), real = context.GetInput(1);
    const std::vector<int64_t> shape = heads.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 4) refuse("the heads must be (N, H, S, Dh)");
    const std::vector<int64_t> real_shape = real.GetTensorTypeAndShapeInfo().GetShape();
    if (real_shape.size() != 1) refuse("the real positions must be one axis");
    const int64_t grid = shape[0] * shape[2], packed = real_shape[0];
    const int64_t* positions = real.GetTensorData<int64_t>();
    std::vector<int64_t> checked(positions, positions + packed);
    for (int64_t& position : checked) position = checked_index(position, grid, "a real position");
    Ort::UnownedValue out = context.GetOutput(0, {1, packed, shape[1] * shape[3]});
    ToPackedTask task{heads.GetTensorData<float>(), checked.data(), shape[1], shape[2], shape[3], out.GetTensorMutableData<float>()};
    if (packed > 0 && shape[1] * shape[3] > 0) context.ParallelFor(to_packed_row, static_cast<size_t>(packed), 0, &task);
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }
};

struct PackedToHeadsOp : CpuKernelOp<PackedToHeadsOp, PackedToHeadsKernel> {
  const char* GetName() const { return "PackedToHeads"; }
  size_t GetInputTypeCount() const { return 4; }  // projections (1, P, 3 x H x Dh), grid rows (N x S), (N, S, W), (N, S, H, Dh)
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }  // each part's heads: one or more outputs, all float
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t /*index*/) const { return INPUT_OUTPUT_VARIADIC; }
  int GetVariadicOutputMinArity() const { return 1; }
  bool GetVariadicOutputHomogeneity() const { return true; }
};

struct HeadsToPackedOp : CpuKernelOp<HeadsToPackedOp, HeadsToPackedKernel> {
  const char* GetName() const { return "HeadsToPacked"; }
  size_t GetInputTypeCount() const { return 2; }  // heads (N, H, S, Dh), real positions (P)
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }  // (1, P, H x Dh)
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* packed_to_heads_op() {
  static PackedToHeadsOp op;
  return &op;
}

const OrtCustomOp* heads_to_packed_op() {
  static HeadsToPackedOp op;
  return &op;
}

uint64_t head_layout_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace nmt_kernels
