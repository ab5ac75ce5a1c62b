// The cross-attention's per-(source, head) work, shared by the MultiHeadAttention kernel (cross_attention.cc) and the
// fused grouped cross-attention (grouped_cross_attention.cc), so both give the same bits for the same query.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace nmt_kernels {

struct CrossAttentionShape {
  int64_t sources, queries, model_dim, heads, keys, head_dim;
};

struct CrossAttentionTask {
  CrossAttentionShape shape;
  float scale;
  const float* query;        // (S, Q, H * Dh) slots, or rows that query_rows picks from
  const float* key;          // (S, H, L, Dh)
  const float* value;
  const int* live;           // (S, L): each source's kept key positions first, in order
  const int* live_counts;    // (S): how many keys each source keeps
  float* out;                // (S, Q, H * Dh)
  const int64_t* query_rows; // (S, Q) the query row of each slot; null: slot i is query row i
};

// ParallelFor body over sources x heads: `data` is a CrossAttentionTask.
void attend_source_head(void* data, size_t index);

// Each source's kept key positions, first in `live` (S, L), and their count; a source with none keeps all.
void live_keys(const int32_t* keep, int64_t sources, int64_t keys, std::vector<int>& live, std::vector<int>& live_counts);

}  // namespace nmt_kernels
