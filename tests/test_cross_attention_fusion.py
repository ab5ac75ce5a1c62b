"""The in-memory fusion of each decoder layer's cross-attention block (runtime/cross_attention_fusion.py) and the native
kernel that runs the fused node (runtime/kernels/grouped_cross_attention.cc): the native MultiHeadAttention kernel's
bits, for rows of both source groups, beams sharing a source and a call with one group empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nmt_serve.runtime.cross_attention_fusion import FUSED_OP, fuse_cross_attention
from nmt_serve.runtime.native_kernels import NativeKernels
from nmt_serve.runtime.onnx_proto import parse_model
from tests.decoder_calls import CALLS, model_dir_for, run_calls, set_attribute, with_and_without

BLOCK_ONLY = {"Concat", "MultiHeadAttention"}  # node types the decoder has only in its cross-attention blocks


def decoder_graph(model_dir: Path):  # -> the ModelProto of runtime/onnx_proto.py
    return parse_model((model_dir / "decoder.onnx").read_bytes())


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_each_layers_cross_attention_block_becomes_one_node(precision: str, tiny_model_dir: Path, int8_dir: Path) -> None:
    model = decoder_graph(tiny_model_dir if precision == "fp32" else int8_dir)
    layers = sum(node.op_type == "GroupQueryAttention" for node in model.graph.node)
    assert fuse_cross_attention(model) == layers > 0
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count(FUSED_OP) == layers and not BLOCK_ONLY & set(kinds)
    assert fuse_cross_attention(model) == 0


def test_a_block_in_another_form_is_left_as_it_is(tiny_model_dir: Path) -> None:
    """A causal attention (unidirectional=1) is not the exporter's cross-attention: that layer's block stays."""
    model = decoder_graph(tiny_model_dir)
    set_attribute(next(node for node in model.graph.node if node.op_type == "MultiHeadAttention"), "unidirectional", 1)
    layers = sum(node.op_type == "GroupQueryAttention" for node in model.graph.node)
    assert fuse_cross_attention(model) == layers - 1
    assert sum(node.op_type == "MultiHeadAttention" for node in model.graph.node) == 2


@pytest.mark.parametrize("model", ["fp32", "int8 with an int8 cache", "imported Marian int8", "imported NLLB int8"])
def test_fused_decoder_gives_the_native_attention_kernels_bits(model: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoder with its cross-attention blocks fused against the same decoder whose MultiHeadAttention nodes run on
    the native kernel: identical log-probs in every call, and the fused node is what ran."""
    model_dir = model_dir_for(model, request, {"fp32": "tiny_model_dir", "int8 with an int8 cache": "int8_cache_dir"})
    fused, unfused = with_and_without(model_dir, native_kernels_library, "cross-attention blocks", monkeypatch)
    counters = NativeKernels(native_kernels_library)
    before = counters.calls()
    fused_results = run_calls(fused)
    middle = counters.calls()
    unfused_results = run_calls(unfused)
    after = counters.calls()
    layers = sum(node.op_type == "GroupQueryAttention" for node in decoder_graph(model_dir).graph.node)
    assert middle["grouped_cross_attention"] - before["grouped_cross_attention"] == layers * len(CALLS)
    assert middle["cross_attention"] == before["cross_attention"] and after["cross_attention"] > middle["cross_attention"]
    for fused_call, unfused_call in zip(fused_results, unfused_results, strict=True):
        np.testing.assert_array_equal(fused_call, unfused_call)
