// The custom-op library's kernels, each an ONNX Runtime CPU kernel for one com.microsoft operator in the form the
// exporter writes or for one fused operator of the runtime's, and the count of its runs in this process.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace nmt_kernels {

constexpr int64_t kFastHeadDim = 64;  // every model this project exports or imports has 64-wide heads

// A node or input this library's kernels do not run: an error naming the kernel and what is wrong. Thrown while the
// session is made, it makes the runtime make the session without the library (runtime/ort_step.py).
[[noreturn]] inline void refuse(const char* kernel, const std::string& what) {
  ORT_CXX_API_THROW(std::string("nmt-serve ") + kernel + " kernel: " + what + " (it runs only the decoder graphs nmt-serve writes)",
                    ORT_INVALID_ARGUMENT);
}

// A node attribute (float or int64_t), or `fallback` where the node does not set it.
template <typename T>
T optional_attribute(const Ort::ConstKernelInfo& info, const char* name, T fallback) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// The values of a node's constant initializer input `index` (of element type `type`), read when the session makes the
// kernel; an input that is not a constant of that type is refused, naming the kernel and the input.
template <typename T>
std::vector<T> constant_values(const Ort::ConstKernelInfo& info, size_t index, ONNXTensorElementDataType type, const char* kernel,
                               const std::string& name) {
  int is_constant = 0;
  const Ort::ConstValue value = info.GetTensorConstantInput(index, &is_constant);
  if (!is_constant) refuse(kernel, name + " must be a constant initializer");
  const Ort::TensorTypeAndShapeInfo shape = value.GetTensorTypeAndShapeInfo();
  if (shape.GetElementType() != type) refuse(kernel, name + " has the wrong element type");
  const T* data = value.GetTensorData<T>();
  return std::vector<T>(data, data + shape.GetElementCount());
}

// NMT_KERNELS_ISA, which caps the weight products' tiles below what the CPU has so that the tests run every path the
// CPU can (avx2 for both products, avx512-vnni for the int8 one); empty when unset, and the CPU's best runs.
inline std::string kernels_isa_cap() {
  const char* cap = std::getenv("NMT_KERNELS_ISA");
  return cap ? cap : "";
}

// A tensor's shape and element count from one query. Each GetTensorTypeAndShapeInfo makes and frees an info object
// (several allocations), and kernels asked some tensors two or three times a call. One query fewer cut the int8
// product's own work outside its quantization and tiles from 2,040-2,220 to 1,770-1,870 cycles a call (Intel Xeon with
// AMX, batch 1 greedy, rdtsc around the parts of the call, two runs each): 19 such calls a decoder step.
struct ShapeAndCount {
  std::vector<int64_t> dims;
  int64_t count = 0;
};

inline ShapeAndCount shape_and_count(const Ort::ConstValue& value) {
  const Ort::TensorTypeAndShapeInfo info = value.GetTensorTypeAndShapeInfo();
  return {info.GetShape(), static_cast<int64_t>(info.GetElementCount())};
}

// The base of every op here: a CPU kernel made from the node's kernel info. ONNX Runtime's CustomOpBase calls these
// through the op's own type, which finds them here; each op adds its name and its inputs' and outputs' types.
template <typename Op, typename Kernel>
struct CpuKernelOp : Ort::CustomOpBase<Op, Kernel> {
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const { return new Kernel(info); }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
};

// Whether the node feeds its input `index`: an absent optional input has an empty name or lies past the node's inputs.
inline bool has_input(const Ort::ConstKernelInfo& info, size_t index) {
  return index < info.GetInputCount() && !info.GetInputName(index).empty();
}

const OrtCustomOp* cross_attention_op();  // MultiHeadAttention over each source's cross K/V (cross_attention.cc)
uint64_t cross_attention_calls();

// GroupQueryAttention over the self-attention cache (self_attention.cc), one op per cache type
const OrtCustomOp* self_attention_op_int8();
const OrtCustomOp* self_attention_op_float();
uint64_t self_attention_calls();

// The operators only the runtime's in-memory fusions write (runtime/native_fusions.py), in a domain of their own.
constexpr const char* kFusedDomain = "nmt_serve";
const OrtCustomOp* row_quantize_op();  // per-row activation quantization in one node (row_quantize.cc)
uint64_t row_quantize_calls();
const OrtCustomOp* grouped_cross_attention_op();  // a layer's whole cross-attention block in one node (grouped_cross_attention.cc)
uint64_t grouped_cross_attention_calls();
const OrtCustomOp* quantized_matmul_op();  // a whole int8 weight product with its quantization and epilogue (quantized_matmul.cc)
uint64_t quantized_matmul_calls();
const OrtCustomOp* float_matmul_op();  // a whole float weight product with its epilogue (float_matmul.cc)
uint64_t float_matmul_calls();
const OrtCustomOp* candidate_top_k_op();  // the candidate rows' Gather and TopK in one node (candidate_top_k.cc)
uint64_t candidate_top_k_calls();
const OrtCustomOp* packed_self_attention_op();  // the encoder's self-attention block on packed rows in one node (packed_self_attention.cc)
uint64_t packed_self_attention_calls();
const OrtCustomOp* packed_to_heads_op();  // an int8 encoder's packed rows to its attention heads in one node (head_layout.cc)
const OrtCustomOp* heads_to_packed_op();  // and the weighted values' heads back to packed rows
uint64_t head_layout_calls();
const OrtCustomOp* decoder_embedding_op();  // an int8 decoder's token and position embedding in one node (decoder_embedding.cc)
uint64_t decoder_embedding_calls();
const OrtCustomOp* decoder_lengths_op();  // the self-attention's two length inputs from the rows' positions in one node (decoder_lengths.cc)
uint64_t decoder_lengths_calls();

}  // namespace nmt_kernels
