// The library's entry points: RegisterCustomOps, which ONNX Runtime calls when a session loads the library, and the
// run counters the runtime reads through ctypes.
//
// Built by runtime/build_kernels.py against ONNX Runtime's C API headers, with no link to ONNX Runtime: the API table
// comes from the session at registration. Compiled for AVX2 + FMA, which every supported x86-64 CPU has.

#include <mutex>
#include <vector>

#include "kernels.h"

extern "C" {

uint64_t nmt_cross_attention_calls() { return nmt_kernels::cross_attention_calls(); }
uint64_t nmt_self_attention_calls() { return nmt_kernels::self_attention_calls(); }
uint64_t nmt_row_quantize_calls() { return nmt_kernels::row_quantize_calls(); }
uint64_t nmt_grouped_cross_attention_calls() { return nmt_kernels::grouped_cross_attention_calls(); }
uint64_t nmt_quantized_matmul_calls() { return nmt_kernels::quantized_matmul_calls(); }
uint64_t nmt_float_matmul_calls() { return nmt_kernels::float_matmul_calls(); }
uint64_t nmt_candidate_top_k_calls() { return nmt_kernels::candidate_top_k_calls(); }
uint64_t nmt_packed_self_attention_calls() { return nmt_kernels::packed_self_attention_calls(); }
uint64_t nmt_head_layout_calls() { return nmt_kernels::head_layout_calls(); }
uint64_t nmt_decoder_embedding_calls() { return nmt_kernels::decoder_embedding_calls(); }
uint64_t nmt_decoder_lengths_calls() { return nmt_kernels::decoder_lengths_calls(); }

// Registers the attention kernels under com.microsoft: ONNX Runtime searches a session's custom registries before its
// own, so they run the graph's nodes of those operators (on disk the graph keeps only stock operators); and the fused
// operators under their own domain, for the nodes the runtime's in-memory fusions write.
OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an ONNX Runtime older than the headers: nothing registered, its own kernels run
  Ort::InitApi(api);
  static std::vector<Ort::CustomOpDomain> domains;  // must outlive every session registered with them
  static std::mutex domains_lock;
  std::lock_guard<std::mutex> hold(domains_lock);
  try {
    Ort::CustomOpDomain domain{"com.microsoft"};
    domain.Add(nmt_kernels::cross_attention_op());
    domain.Add(nmt_kernels::self_attention_op_int8());
    domain.Add(nmt_kernels::self_attention_op_float());
    Ort::CustomOpDomain fused{nmt_kernels::kFusedDomain};
    fused.Add(nmt_kernels::row_quantize_op());
    fused.Add(nmt_kernels::grouped_cross_attention_op());
    fused.Add(nmt_kernels::quantized_matmul_op());
    fused.Add(nmt_kernels::float_matmul_op());
    fused.Add(nmt_kernels::candidate_top_k_op());
    fused.Add(nmt_kernels::packed_self_attention_op());
    fused.Add(nmt_kernels::packed_to_heads_op());
    fused.Add(nmt_kernels::heads_to_packed_op());
    fused.Add(nmt_kernels::decoder_embedding_op());
    fused.Add(nmt_kernels::decoder_lengths_op());
    Ort::UnownedSessionOptions(options).Add(domain);
    Ort::UnownedSessionOptions(options).Add(fused);
    domains.push_back(std::move(domain));
    domains.push_back(std::move(fused));
  } catch (const Ort::Exception& error) {
    return Ort::GetApi().CreateStatus(error.GetOrtErrorCode(), error.what());
  }
  return nullptr;
}

}  // extern "C"
