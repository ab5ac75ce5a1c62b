"""The in-memory fusion of the encoder's self-attention blocks (runtime/packed_attention_fusion.py) and the native
kernel that runs the fused node (runtime/kernels/packed_self_attention.cc): the block's definition within float
rounding, each source's result independent of the rest of the call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nmt_serve.model.transformer import MASK_VALUE
from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.native_kernels import NativeKernels
from nmt_serve.runtime.onnx_proto import parse_model
from nmt_serve.runtime.packed_attention_fusion import FUSED_OP, fuse_packed_attention
from tests.decoder_calls import model_dir_for, with_and_without

CPU = ["CPUExecutionProvider"]


@pytest.mark.parametrize("graph", ["tiny_model_dir", "imported Marian fp32", "imported NLLB fp32"])
def test_every_encoder_self_attention_block_of_a_float_graph_becomes_one_node(graph: str, request: pytest.FixtureRequest) -> None:
    """The tiny model's fp32 encoder and the imported Marian (post-norm) and NLLB (pre-norm) fp32 encoders."""
    imported = {"imported Marian fp32": "imported_marian", "imported NLLB fp32": "imported_nllb"}
    model_dir = request.getfixturevalue(imported[graph]) / "onnx-fp32" if graph in imported else request.getfixturevalue(graph)
    model = parse_model((model_dir / "encoder.onnx").read_bytes())
    layers = sum(node.op_type == "Softmax" for node in model.graph.node)
    assert layers > 0 and fuse_packed_attention(model) == layers
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count(FUSED_OP) == layers and "Softmax" not in kinds
    assert fuse_packed_attention(model) == 0


@pytest.mark.parametrize("model", ["int8", "imported Marian int8", "imported NLLB int8"])
def test_an_int8_encoder_keeps_its_self_attention_blocks(model: str, request: pytest.FixtureRequest) -> None:
    """In an int8 graph the kernel's other summation order would move quantization levels: its blocks stay."""
    graph = parse_model((model_dir_for(model, request, {"int8": "int8_dir"}) / "encoder.onnx").read_bytes())
    assert sum(node.op_type == "Softmax" for node in graph.graph.node) > 0
    assert fuse_packed_attention(graph) == 0


def test_a_block_in_another_form_is_left_as_it_is(tiny_model_dir: Path) -> None:
    """Keys transposed to another order are not the exporter's block: nothing of that layer is fused."""
    graph = parse_model((tiny_model_dir / "encoder.onnx").read_bytes())
    layers = sum(node.op_type == "Softmax" for node in graph.graph.node)
    key_transpose = next(node for node in graph.graph.node if node.op_type == "Transpose" and list(node.attribute[0].ints) == [0, 2, 3, 1])
    key_transpose.attribute[0].ints[:] = [0, 2, 1, 3]
    assert fuse_packed_attention(graph) == layers - 1


def attention_session(library: Path, heads: int, head_size: int, divisor: float) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "T", 3 * heads * head_size]),
              helper.make_tensor_value_info("layout", TensorProto.INT64, ["NS"]),
              helper.make_tensor_value_info("real", TensorProto.INT64, ["T"]),
              helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["N", 1, 1, "S"])]  # fmt: skip
    node = helper.make_node(FUSED_OP, ["qkv", "layout", "real", "bias"], ["out"], domain=FUSED_DOMAIN, num_heads=heads, head_size=head_size,
                            divisor=divisor)  # fmt: skip
    graph = helper.make_graph([node], "attention", inputs, [helper.make_empty_tensor_value_info("out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=CPU)


def packed_inputs(lengths: list[int], width: int, model: int, rng: np.random.Generator, bias: np.ndarray | None = None) -> dict:
    """The exporter's packed form of sources of `lengths` padded to `width`: T = sum(lengths) rows of projections, each
    (source, position)'s row (a padded one repeats its source's last real row), the real positions and the mask's bias."""
    mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
    flat = mask.reshape(-1)
    layout = np.maximum(np.cumsum(flat) - 1, 0).astype(np.int64)
    if bias is None:
        bias = np.where(mask, np.float32(0), np.float32(MASK_VALUE)).astype(np.float32)
    qkv = rng.standard_normal((1, int(flat.sum()), 3 * model)).astype(np.float32)
    return {"qkv": qkv, "layout": layout, "real": np.flatnonzero(flat).astype(np.int64), "bias": bias[:, None, None, :]}


def definition(feeds: dict, heads: int, head_size: int, divisor: float) -> np.ndarray:
    """The stock nodes' computation in float64: gather into (N, S), attention per head with the bias, gather the real rows."""
    qkv, layout, real, bias = (feeds[name] for name in ("qkv", "layout", "real", "bias"))
    sources, width = bias.shape[0], bias.shape[3]
    grid = qkv[0].astype(np.float64)[layout].reshape(sources, width, 3, heads, head_size)
    query, key, value = (grid[:, :, part].transpose(0, 2, 1, 3) for part in range(3))
    scores = query @ key.transpose(0, 1, 3, 2) / divisor + bias.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    attended = (weights @ value).transpose(0, 2, 1, 3).reshape(1, sources * width, heads * head_size)
    return attended[:, real]


@pytest.mark.parametrize("heads,head_size", [(4, 64), (2, 16), (1, 8), (2, 128)])
@pytest.mark.parametrize("lengths,width", [([17], 17), ([1, 5, 17, 40], 40), ([9, 3], 12)])
def test_packed_self_attention_kernel_matches_the_definition(native_kernels_library: Path, heads: int, head_size: int,
                                                             lengths: list[int], width: int) -> None:  # fmt: skip
    """Sources of one token, of widths with a tail past a multiple of 8 and padded positions, against the block's
    computation in float64: float rounding apart (the dot products' order differs from the stock MatMuls')."""
    rng = np.random.default_rng(sum(lengths) + head_size)
    feeds = packed_inputs(lengths, width, heads * head_size, rng)
    divisor = float(np.sqrt(head_size))
    got = attention_session(native_kernels_library, heads, head_size, divisor).run(None, feeds)[0]
    assert got.shape == (1, sum(lengths), heads * head_size)
    np.testing.assert_allclose(got, definition(feeds, heads, head_size, divisor), rtol=1e-5, atol=1e-5)


def test_the_bias_is_added_to_every_score(native_kernels_library: Path) -> None:
    """Any additive bias, not only the mask's two values: small ones move the weights, -1e4 zeroes them."""
    rng = np.random.default_rng(3)
    bias = rng.uniform(-2, 2, (2, 10)).astype(np.float32)
    bias[1, 7:] = MASK_VALUE
    feeds = packed_inputs([10, 7], 10, 32, rng, bias)
    got = attention_session(native_kernels_library, 2, 16, 4.0).run(None, feeds)[0]
    np.testing.assert_allclose(got, definition(feeds, 2, 16, 4.0), rtol=1e-5, atol=1e-5)


def test_a_sources_result_does_not_change_with_the_rest_of_the_call(native_kernels_library: Path) -> None:
    """The same source alone at its own width and among longer and shorter ones at a wider padding: the same bits."""
    rng = np.random.default_rng(11)
    session = attention_session(native_kernels_library, 4, 64, 8.0)
    together = packed_inputs([30, 13, 22], 48, 256, rng)
    mine = slice(30, 43)  # the second source's rows
    alone = packed_inputs([13], 13, 256, rng)
    alone["qkv"] = together["qkv"][:, mine].copy()
    np.testing.assert_array_equal(session.run(None, alone)[0][0], session.run(None, together)[0][0, mine])


def test_a_head_size_the_kernel_has_no_sums_for_is_refused(native_kernels_library: Path) -> None:
    """Refused when the session is made, so the runtime makes it without the fusion (runtime/ort_step.py)."""
    with pytest.raises(Exception, match="head_size must be a multiple of 8 up to 128"):
        attention_session(native_kernels_library, 2, 12, 2.0)


def test_a_fused_fp32_encoder_agrees_with_the_stock_blocks(native_kernels_library: Path, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The fp32 encoder with the blocks fused against the same encoder without them, within float rounding, and the
    fused kernel ran."""
    fused, stock = with_and_without(tiny_model_dir, native_kernels_library, "encoder self-attention blocks", monkeypatch)
    kernels = NativeKernels(native_kernels_library)
    before = kernels.calls()["packed_self_attention"]
    rng = np.random.default_rng(2)
    lengths = [3, 11, 7]
    ids = np.zeros((3, 11), dtype=np.int64)
    mask = np.arange(11)[None, :] < np.array(lengths)[:, None]
    ids[mask] = rng.integers(4, fused.config.vocab_size, int(mask.sum()))
    got, expected = fused.encode(ids, mask), stock.encode(ids, mask)
    assert kernels.calls()["packed_self_attention"] > before
    for got_part, expected_part in zip(got, expected, strict=True):
        real = np.broadcast_to(mask[:, None, :, None], got_part.shape)
        np.testing.assert_allclose(got_part[real], expected_part[real], rtol=1e-5, atol=1e-5)
