"""The ONNX subset the serving path parses without the onnx package (runtime/onnx_proto.py): nothing of a model is
lost through it, and what it reads agrees with the onnx package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from nmt_serve.runtime.onnx_proto import attribute, make_node, parse_model, small_tensor


@pytest.mark.parametrize("name", ["encoder", "decoder"])
def test_a_model_passes_through_unchanged(name: str, int8_dir: Path) -> None:
    """Parsed and written again, the model is the same model to the onnx package (fields the subset does not know
    (types, shapes, metadata) pass through as unknown fields)."""
    data = (int8_dir / f"{name}.onnx").read_bytes()
    again = parse_model(data).SerializeToString()
    assert onnx.load_from_string(again).SerializeToString() == onnx.load_from_string(data).SerializeToString()


def test_constants_and_attributes_read_as_the_onnx_package_reads_them(int8_dir: Path) -> None:
    data = (int8_dir / "decoder.onnx").read_bytes()
    reference, model = onnx.load_from_string(data), parse_model(data)
    compared = 0
    for theirs, ours in zip(reference.graph.initializer, model.graph.initializer, strict=True):
        value = small_tensor(ours)
        if theirs.data_location == onnx.TensorProto.EXTERNAL or value is None:
            continue
        np.testing.assert_array_equal(value, numpy_helper.to_array(theirs))
        assert value.dtype == numpy_helper.to_array(theirs).dtype
        compared += 1
    assert compared > 0
    for theirs, ours in zip(reference.graph.node, model.graph.node, strict=True):
        for found in theirs.attribute:
            if found.type in (onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.INTS):
                value = onnx.helper.get_attribute_value(found)
                assert attribute(ours, found.name) == (list(value) if isinstance(value, list) else value)


def test_a_made_node_is_a_node_to_the_onnx_package() -> None:
    node = make_node("RowQuantize", ["x"], ["levels", "scales"], "fused", "nmt_serve", inverse_levels=0.5, zero_point=128)
    theirs = onnx.NodeProto.FromString(node.SerializeToString())
    assert theirs.op_type == "RowQuantize" and theirs.domain == "nmt_serve" and list(theirs.output) == ["levels", "scales"]
    values = {found.name: onnx.helper.get_attribute_value(found) for found in theirs.attribute}
    assert values == {"inverse_levels": 0.5, "zero_point": 128}
