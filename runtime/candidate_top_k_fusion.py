"""The runtime's in-memory fusion of the decoder's candidate search, Gather then TopK, into one node.

The exporter writes the search's candidates as Gather(log_probs, candidate_rows) on axis 0 then TopK(largest,
sorted) on the last axis (export/decoder_graph.py). With the library loaded the pair becomes one
`nmt_serve.CandidateTopK` node (runtime/kernels/candidate_top_k.cc) that reads each candidate row in place and
writes the same values and token ids: the row's own values, best first, equal values lower index first as
ONNX Runtime's TopK orders them. runtime/native_fusions.py applies it to the copy in memory only; a pair in any
other form is left as it is.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import GraphIndex, fuse_blocks
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute

FUSED_OP = "CandidateTopK"
LAST_AXES = (-1, 1)  # of the (rows, vocabulary) log-probs


def _pair(graph: GraphIndex, top_k: NodeProto) -> tuple[list[str], list[NodeProto], dict] | None:
    """The fused node's inputs (log-probs, candidate rows, k) and the pair's nodes, when `top_k` and the Gather feeding
    it alone are the exporter's candidate search; else None."""
    if top_k.op_type != "TopK" or len(top_k.input) != 2 or len(top_k.output) != 2:
        return None
    if attribute(top_k, "largest", 1) != 1 or attribute(top_k, "sorted", 1) != 1 or attribute(top_k, "axis", -1) not in LAST_AXES:
        return None
    gather = graph.made_by(top_k.input[0], "Gather")
    if gather is None or attribute(gather, "axis", 0) != 0 or not graph.only_reader(gather.output[0], top_k):
        return None
    return [gather.input[0], gather.input[1], top_k.input[1]], [gather, top_k], {}


def fuse_candidate_top_k(model: ModelProto) -> int:
    """Replace every candidate-search Gather -> TopK pair of `model` by one CandidateTopK node, in place; how many."""
    return fuse_blocks(model, FUSED_OP, _pair)
