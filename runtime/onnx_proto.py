"""The part of the ONNX model format the runtime's in-memory fusions read and write, without the onnx package.

Serving installs neither torch nor onnx (docs/architecture.md, import rules), so the fusions (runtime/native_fusions.py)
parse a model with message classes built here from a descriptor of the few ONNX messages and fields they touch (the
field numbers are ONNX's, onnx/onnx.proto). Protobuf keeps every field it does not know as unknown fields and writes
them back unchanged, so a model parsed and serialized here loses nothing: types, shapes, metadata and the fields of
later ONNX versions pass through as bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "nmt_serve.onnx_subset"
FIELD = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = FIELD.LABEL_OPTIONAL, FIELD.LABEL_REPEATED
# message -> its fields: (name, number, type, repeated, message type for TYPE_MESSAGE, packed)
MESSAGES: dict[str, list[tuple[str, int, int, bool, str, bool]]] = {
    "OperatorSetIdProto": [("domain", 1, FIELD.TYPE_STRING, False, "", False), ("version", 2, FIELD.TYPE_INT64, False, "", False)],
    "StringStringEntryProto": [("key", 1, FIELD.TYPE_STRING, False, "", False), ("value", 2, FIELD.TYPE_STRING, False, "", False)],
    "TensorProto": [
        ("dims", 1, FIELD.TYPE_INT64, True, "", False), ("data_type", 2, FIELD.TYPE_INT32, False, "", False),
        ("float_data", 4, FIELD.TYPE_FLOAT, True, "", True), ("int32_data", 5, FIELD.TYPE_INT32, True, "", True),
        ("int64_data", 7, FIELD.TYPE_INT64, True, "", True), ("name", 8, FIELD.TYPE_STRING, False, "", False),
        ("raw_data", 9, FIELD.TYPE_BYTES, False, "", False),
        ("external_data", 13, FIELD.TYPE_MESSAGE, True, "StringStringEntryProto", False),
        ("data_location", 14, FIELD.TYPE_INT32, False, "", False),
    ],
    "AttributeProto": [
        ("name", 1, FIELD.TYPE_STRING, False, "", False), ("f", 2, FIELD.TYPE_FLOAT, False, "", False),
        ("i", 3, FIELD.TYPE_INT64, False, "", False), ("s", 4, FIELD.TYPE_BYTES, False, "", False),
        ("floats", 7, FIELD.TYPE_FLOAT, True, "", False), ("ints", 8, FIELD.TYPE_INT64, True, "", False),
        ("type", 20, FIELD.TYPE_INT32, False, "", False),
    ],
    "ValueInfoProto": [("name", 1, FIELD.TYPE_STRING, False, "", False)],
    "NodeProto": [
        ("input", 1, FIELD.TYPE_STRING, True, "", False), ("output", 2, FIELD.TYPE_STRING, True, "", False),
        ("name", 3, FIELD.TYPE_STRING, False, "", False), ("op_type", 4, FIELD.TYPE_STRING, False, "", False),
        ("attribute", 5, FIELD.TYPE_MESSAGE, True, "AttributeProto", False), ("domain", 7, FIELD.TYPE_STRING, False, "", False),
    ],
    "GraphProto": [
        ("node", 1, FIELD.TYPE_MESSAGE, True, "NodeProto", False), ("initializer", 5, FIELD.TYPE_MESSAGE, True, "TensorProto", False),
        ("input", 11, FIELD.TYPE_MESSAGE, True, "ValueInfoProto", False), ("output", 12, FIELD.TYPE_MESSAGE, True, "ValueInfoProto", False),
    ],
    "ModelProto": [("graph", 7, FIELD.TYPE_MESSAGE, False, "GraphProto", False),
                   ("opset_import", 8, FIELD.TYPE_MESSAGE, True, "OperatorSetIdProto", False)],  # fmt: skip
}
# AttributeProto.type values and TensorProto.data_type values (ONNX's enums) that the fusions use.
ATTRIBUTE_FLOAT, ATTRIBUTE_INT, ATTRIBUTE_STRING, ATTRIBUTE_FLOATS, ATTRIBUTE_INTS = 1, 2, 3, 6, 7
TENSOR_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 11: np.float64}
EXTERNAL = 1  # TensorProto.data_location


def _message_classes() -> dict[str, type]:
    file = descriptor_pb2.FileDescriptorProto(name="nmt_serve_onnx_subset.proto", package=PACKAGE, syntax="proto2")
    for message_name, fields in MESSAGES.items():
        message = file.message_type.add(name=message_name)
        for name, number, kind, repeated, type_name, packed in fields:
            field = message.field.add(name=name, number=number, type=kind, label=REPEATED if repeated else OPTIONAL)
            if type_name:
                field.type_name = f".{PACKAGE}.{type_name}"
            if packed:
                field.options.packed = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in MESSAGES}


_CLASSES = _message_classes()
ModelProto = _CLASSES["ModelProto"]
NodeProto = _CLASSES["NodeProto"]


def parse_model(data: bytes):  # -> ModelProto
    model = ModelProto()
    model.ParseFromString(data)
    return model


def make_node(op_type: str, inputs: Iterable[str], outputs: Iterable[str], name: str, domain: str,
              **attributes: float | int | list[int]):  # -> NodeProto  # fmt: skip
    """A node with float, int and int-list attributes (the only kinds the fused nodes take)."""
    node = NodeProto(op_type=op_type, name=name, domain=domain)
    node.input.extend(inputs)
    node.output.extend(outputs)
    for key, value in sorted(attributes.items()):
        add_attribute(node, key, value)
    return node


def add_attribute(node, key: str, value: float | int | list[int]) -> None:
    if isinstance(value, list):
        node.attribute.add(name=key, type=ATTRIBUTE_INTS).ints.extend(int(item) for item in value)
    elif isinstance(value, bool | int | np.integer):
        node.attribute.add(name=key, i=int(value), type=ATTRIBUTE_INT)
    else:
        node.attribute.add(name=key, f=float(value), type=ATTRIBUTE_FLOAT)


def attribute(node, name: str, default: object = None) -> object:
    """A node's attribute value (float, int, bytes, or a list of floats or ints), or `default` where it has none."""
    for found in node.attribute:
        if found.name == name:
            return {ATTRIBUTE_FLOAT: found.f, ATTRIBUTE_INT: found.i, ATTRIBUTE_STRING: found.s,
                    ATTRIBUTE_FLOATS: list(found.floats), ATTRIBUTE_INTS: list(found.ints)}.get(found.type, default)  # fmt: skip
    return default


def small_tensor(tensor) -> np.ndarray | None:
    """A constant held in the model itself (not external data) as an array; None for a type the fusions never read."""
    dtype = TENSOR_TYPES.get(tensor.data_type)
    if dtype is None or tensor.data_location == EXTERNAL:
        return None
    shape = tuple(tensor.dims)
    if tensor.raw_data:
        return np.frombuffer(tensor.raw_data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)
    typed = {np.float32: tensor.float_data, np.int64: tensor.int64_data}.get(dtype, tensor.int32_data)
    return np.array(list(typed), dtype=dtype).reshape(shape)
