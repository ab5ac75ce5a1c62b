"""The decoder-step graph, written node by node from the Transformer's weights with fused ONNX Runtime ops.

Why not torch.onnx here: the exported step was ~150 small nodes (reshapes, transposes, a gather
and a concat of the whole cache per layer), and at serving batch sizes a step is dominated by
per-node cost and those copies (bench/results/engine.md). Written directly, a decoder layer is
one QKV MatMul, `com.microsoft.GroupQueryAttention` (with as many K/V heads as query heads,
that is plain multi-head attention) over a self-attention cache that is updated in place, two
`com.microsoft.MultiHeadAttention` (one per group of sources: the short ones in narrow buffers, the
rest as wide as the longest) over each source's cross K/V with the rows reading that source as its
queries (Gathers map rows to sources and back), three Add + LayerNormalization (post-LN; a pre-LN
model normalises each sublayer's input instead and adds a final LayerNorm) and the FFN: 107 nodes for
the 3-layer default model. Parity against the PyTorch model checks it (export/parity.py).

Contract (docs/architecture.md, the model dir): every row carries its own cache, so rows at different
positions share a call without a past mask or padding.
  tgt_ids    [rows, 1] int64   the token fed
  positions  [rows] int64      its position = how many tokens the row has cached already
  src_mask   [sources, src_len] bool, and cross K/V per layer [sources, H, src_len, Dh]: each
  source once, however many rows read it
  source_queries [sources, queries] int64: the rows reading each source (a source read by fewer
  rows than `queries` repeats one of them; that result is dropped)
  narrow_src_mask [narrow_sources, narrow_len], narrow_source_queries [narrow_sources, queries] and
  narrow cross K/V per layer [narrow_sources, H, narrow_len, Dh]: a second group of sources, the
  same way; the runtime puts the short sources there (runtime/source_group.py), so one long source
  does not widen every row's cross-attention. Each group holds at least one source.
  row_queries [rows] int64: where each row's cross-attention result is in the flattened
  [(narrow_sources + sources) * queries] output, the narrow group's first (place * queries + its
  place among the source's rows)
  past K/V per layer [rows, H, capacity, Dh]: slots [0, position) of a row are its past;
  the step writes slot `position` and reads slots [0, position]. Bind each present K/V to the
  same buffer as its past (IO binding) and the cache grows in place; without binding, ONNX
  Runtime returns a fresh copy of the same shape.
  candidate_rows [n] int64, candidate_count [1] int64: the rows the search wants candidates for (beam and greedy rows),
  and how many per row (n = 0 and count 0 when no row does: then the two nodes cost nothing)
  -> log_probs [rows, V] float32, present K/V per layer [rows, H, capacity, Dh],
  candidate_log_probs [n, count] float32 and candidate_ids [n, count] int64: each candidate row's
  best log-probs, best first, ties to the lower token id (ONNX TopK). The union of the rows' top
  2K holds the request's top 2K, so beam search reads (n, count) instead of (n, V) with numpy:
  the in-graph TopK measured ~3.3 us per row against ~12 us per row for numpy's partition.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from nmt_serve.export.graph_writer import CONTRIB_DOMAIN, GraphWriter, add_and_norm, add_residual, finish_model, layer_norm, to_numpy
from nmt_serve.export.graphs import encoder_output_names, kv_names, narrow_cross_names, past_names, present_names
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.transformer import DecoderLayer, Transformer
from nmt_serve.runtime.source_group import NARROW_PREFIX

SOURCE_INPUTS = ["source_queries", "row_queries"]
NARROW_INPUTS = [f"{NARROW_PREFIX}src_mask", f"{NARROW_PREFIX}source_queries"]
CANDIDATE_INPUTS = ["candidate_rows", "candidate_count"]
CANDIDATE_OUTPUTS = ["candidate_log_probs", "candidate_ids"]


# model/transformer.py's ACTIVATION_FUNCTIONS as ONNX nodes: (graph, input, node name prefix) -> output.
ACTIVATION_WRITERS: dict[str, Callable[[GraphWriter, str, str], str]] = {
    "relu": lambda graph, x, name: graph.op("Relu", [x], f"{name}.relu"),
    # x * sigmoid(x); ONNX Runtime's optimizer fuses the pair
    "swish": lambda graph, x, name: graph.op("Mul", [x, graph.op("Sigmoid", [x], f"{name}.sigmoid")], f"{name}.swish"),
    # the exact (erf) GELU, as torch's F.gelu default
    "gelu": lambda graph, x, name: graph.op("Gelu", [x], f"{name}.gelu", CONTRIB_DOMAIN),
}


def write_activation(graph: GraphWriter, x: str, activation: str, name: str) -> str:
    """The FFN activation as ONNX nodes; an activation without a writer is refused, never exported as another."""
    writer = ACTIVATION_WRITERS.get(activation)
    if writer is None:
        raise ValueError(f"no ONNX form for FFN activation {activation!r}; known: {', '.join(ACTIVATION_WRITERS)}")
    return writer(graph, x, name)


def sublayer_input(graph: GraphWriter, x: str, norm: object, pre_norm: bool, name: str) -> str:
    """What a sublayer reads: LayerNorm(x) in a pre-norm layer, x itself in a post-norm one (model/transformer.py Sublayers)."""
    return layer_norm(graph, x, norm, f"{name}.pre") if pre_norm else x


def write_residual(graph: GraphWriter, out: str, x: str, bias: np.ndarray, norm: object, pre_norm: bool, name: str) -> str:
    """x + out + bias (pre-norm), or LayerNorm of that sum (post-norm)."""
    return add_residual(graph, out, x, bias, name) if pre_norm else add_and_norm(graph, out, x, bias, norm, name)


def write_layer(graph: GraphWriter, layer: DecoderLayer, index: int, x: str, config: ModelConfig) -> str:
    name = f"layer{index}"
    n_heads, pre_norm = config.n_heads, config.pre_norm
    scale = 1.0 / math.sqrt(config.head_dim)
    attn, cross, ffn = layer.self_attn, layer.cross_attn, layer.ffn
    # Self-attention: one MatMul for Q, K and V (packed, as GroupQueryAttention reads them).
    qkv_weight = np.concatenate([to_numpy(proj.weight) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)])
    qkv_bias = np.concatenate([to_numpy(proj.bias) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)])
    qkv = graph.linear(sublayer_input(graph, x, layer.norm1, pre_norm, f"{name}.norm1"), qkv_weight, qkv_bias, f"{name}.qkv")
    (past_key, past_value), (present_key, present_value) = kv_names("past", index), kv_names("present", index)
    attended = graph.op("GroupQueryAttention", [qkv, "", "", past_key, past_value, "seqlens_k", "total_sequence_length"], f"{name}.self_attn",
                        CONTRIB_DOMAIN, (present_key, present_value), num_heads=n_heads, kv_num_heads=n_heads, scale=scale)  # fmt: skip
    out = graph.linear(attended, to_numpy(attn.out_proj.weight), None, f"{name}.self_out")
    x = write_residual(graph, out, x, to_numpy(attn.out_proj.bias), layer.norm1, pre_norm, f"{name}.norm1")
    # Cross-attention per source, not per row: the rows reading one source (a beam's K rows) are
    # that source's queries, so its K/V ([sources, H, S, Dh]) are read once per step, not K times.
    query_input = sublayer_input(graph, x, layer.norm2, pre_norm, f"{name}.norm2")
    query = graph.linear(query_input, to_numpy(cross.q_proj.weight), to_numpy(cross.q_proj.bias), f"{name}.cross_q")
    flat_query = graph.op("Reshape", [query, "flat_rows_shape"], f"{name}.cross_q_flat")
    # Two groups of sources, each its own MultiHeadAttention over its own width: the short sources' buffers are
    # NARROW_SOURCE_WIDTH wide, the others as wide as the longest (runtime/source_group.py). The narrow group's
    # results come first in the flattened output row_queries reads.
    by_group = []
    for prefix, suffix in ((NARROW_PREFIX, "_narrow"), ("", "")):
        queries = graph.op("Gather", [flat_query, f"{prefix}source_queries"], f"{name}.cross_q_by_source{suffix}")
        cross_key, cross_value = kv_names(f"{prefix}cross", index)
        mask = f"{prefix}src_mask_int"
        attended = graph.op("MultiHeadAttention", [queries, cross_key, cross_value, "", mask], f"{name}.cross_attn{suffix}", CONTRIB_DOMAIN,
                            num_heads=n_heads, scale=scale)  # fmt: skip
        by_group.append(graph.op("Reshape", [attended, "flat_rows_shape"], f"{name}.cross_attn_flat{suffix}"))
    both = graph.op("Concat", by_group, f"{name}.cross_attn_both", axis=0)
    by_row = graph.op("Gather", [both, "row_queries"], f"{name}.cross_attn_by_row")
    attended = graph.op("Reshape", [by_row, "rows_shape"], f"{name}.cross_attn_rows")
    out = graph.linear(attended, to_numpy(cross.out_proj.weight), None, f"{name}.cross_out")
    x = write_residual(graph, out, x, to_numpy(cross.out_proj.bias), layer.norm2, pre_norm, f"{name}.norm2")
    ffn_input = sublayer_input(graph, x, layer.norm3, pre_norm, f"{name}.norm3")
    hidden = write_activation(graph, graph.linear(ffn_input, to_numpy(ffn.up.weight), to_numpy(ffn.up.bias), f"{name}.ffn_up"), config.activation, f"{name}.ffn")
    out = graph.linear(hidden, to_numpy(ffn.down.weight), None, f"{name}.ffn_down")
    return write_residual(graph, out, x, to_numpy(ffn.down.bias), layer.norm3, pre_norm, f"{name}.norm3")


def build_decoder_graph(model: Transformer, opset: int) -> onnx.ModelProto:
    config = model.config
    graph = GraphWriter()
    embedding = graph.constant("embedding", to_numpy(model.embed.weight))
    # Embedding scaled by sqrt(d_model) (when the model scales it) plus the sinusoidal position of each row's token.
    tokens = graph.op("Gather", [embedding, "tgt_ids"], "token_embedding")
    if config.scale_embedding:
        tokens = graph.op("Mul", [tokens, graph.constant("embed_scale", np.array(model.embed_scale, np.float32))], "scaled_embedding")
    position = graph.op("Gather", [graph.constant("position_table", model.position_table.numpy()), "positions"], "position_embedding")
    x = graph.op("Add", [tokens, graph.op("Unsqueeze", [position, graph.constant("axis_1", np.array([1], np.int64))], "position_embedding_3d")], "embedded")
    # What the fused attention ops take: int32 per-row lengths, the longest row's total, an int32 key mask.
    graph.op("Cast", ["positions"], "seqlens_k", to=TensorProto.INT32)
    longest = graph.op("ReduceMax", ["positions"], "longest_position", keepdims=0)
    graph.op("Cast", [graph.op("Add", [longest, graph.constant("one", np.array(1, np.int64))], "total_length_int64")], "total_sequence_length", to=TensorProto.INT32)
    for prefix in (NARROW_PREFIX, ""):
        graph.op("Cast", [f"{prefix}src_mask"], f"{prefix}src_mask_int", to=TensorProto.INT32)
    graph.constant("flat_rows_shape", np.array([-1, config.d_model], np.int64))
    graph.constant("rows_shape", np.array([-1, 1, config.d_model], np.int64))
    for index, layer in enumerate(model.decoder_layers):
        x = write_layer(graph, layer, index, x, config)
    if model.decoder_norm is not None:  # a pre-norm stack's final LayerNorm
        x = layer_norm(graph, x, model.decoder_norm, "decoder_norm")
    hidden = graph.op("Squeeze", [x, "axis_1"], "hidden")
    # The output projection is the embedding (tied): a Transpose that ONNX Runtime folds at load keeps one copy in the file.
    logits = graph.op("MatMul", [hidden, graph.op("Transpose", [embedding], "output_projection", perm=[1, 0])], "logits")
    if model.output_bias is not None:
        logits = graph.op("Add", [logits, graph.constant("output_bias", to_numpy(model.output_bias))], "biased_logits")
    if config.banned_ids:
        # After the softmax, as the PyTorch model does: the other ids keep the model's own normalisation.
        normalized = graph.op("LogSoftmax", [logits], "normalized_log_probs", axis=-1)
        graph.op("Add", [normalized, graph.constant("banned_log_probs", model.banned_log_probs.numpy())], "log_probs")
    else:
        graph.op("LogSoftmax", [logits], "log_probs", axis=-1)
    # Beam search candidates: the requested rows' top `candidate_count` log-probs (ties to the lower id).
    wanted = graph.op("Gather", ["log_probs", "candidate_rows"], "candidate_rows_log_probs", axis=0)
    graph.op("TopK", [wanted, "candidate_count"], CANDIDATE_OUTPUTS[0], extra_outputs=(CANDIDATE_OUTPUTS[1],), axis=-1, largest=1, sorted=1)
    return finish_model(graph, "decoder_step", decoder_inputs(model), decoder_outputs(model), opset)


def decoder_inputs(model: Transformer) -> list[onnx.ValueInfoProto]:
    config = model.config
    heads, head_dim, n_layers = config.n_heads, config.head_dim, config.n_decoder_layers
    value = helper.make_tensor_value_info
    inputs = [value("tgt_ids", TensorProto.INT64, ["rows", 1]), value("positions", TensorProto.INT64, ["rows"]),
              value("src_mask", TensorProto.BOOL, ["sources", "src_len"]),
              value(SOURCE_INPUTS[0], TensorProto.INT64, ["sources", "queries"]), value(SOURCE_INPUTS[1], TensorProto.INT64, ["rows"]),
              value(NARROW_INPUTS[0], TensorProto.BOOL, ["narrow_sources", "narrow_len"]),
              value(NARROW_INPUTS[1], TensorProto.INT64, ["narrow_sources", "queries"])]  # fmt: skip
    inputs += [value(name, TensorProto.FLOAT, ["rows", heads, "capacity", head_dim]) for name in past_names(n_layers)]
    inputs += [value(name, TensorProto.FLOAT, ["sources", heads, "src_len", head_dim]) for name in encoder_output_names(n_layers)]
    inputs += [value(name, TensorProto.FLOAT, ["narrow_sources", heads, "narrow_len", head_dim]) for name in narrow_cross_names(n_layers)]
    inputs += [value(CANDIDATE_INPUTS[0], TensorProto.INT64, ["candidates"]), value(CANDIDATE_INPUTS[1], TensorProto.INT64, [1])]
    return inputs


def decoder_outputs(model: Transformer) -> list[onnx.ValueInfoProto]:
    config = model.config
    value = helper.make_tensor_value_info
    outputs = [value("log_probs", TensorProto.FLOAT, ["rows", config.vocab_size])]
    outputs += [value(name, TensorProto.FLOAT, ["rows", config.n_heads, "capacity", config.head_dim]) for name in present_names(config.n_decoder_layers)]
    outputs += [value(CANDIDATE_OUTPUTS[0], TensorProto.FLOAT, ["candidates", "count"]), value(CANDIDATE_OUTPUTS[1], TensorProto.INT64, ["candidates", "count"])]
    return outputs
