"""Weights both graphs of a model dir hold, stored once: in one file beside them that both graphs point into.

The encoder and the decoder each carry the tied token embedding (the decoder also projects onto it) and the
sinusoidal position table. Written into each .onnx file, the default model's fp32 dir holds the 4.1 MB
embedding twice and its int8 dir holds the 2 MB quantized table twice. Here every initializer whose type,
shape and bytes are the same in two or more graphs moves into SHARED_WEIGHTS_FILE as ONNX external data,
each graph keeping a reference (location, offset, length) to the one copy. ONNX Runtime reads external data
relative to the graph's own file, so a session loads the very same values: the arithmetic is unchanged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model, set_external_data, uses_external_data

logger = logging.getLogger(__name__)

SHARED_WEIGHTS_FILE = "shared_weights.bin"
# Below this a tensor is a scale or a shape: a reference costs about as much as the bytes it would save.
MIN_SHARED_BYTES = 1024
# Each tensor starts on a 64-byte boundary (a cache line, the widest vector load); page alignment would pad a
# small model's file by more than it shares.
ALIGNMENT = 64

TensorKey = tuple[int, tuple[int, ...], bytes]


def tensor_key(tensor: onnx.TensorProto) -> TensorKey:
    return tensor.data_type, tuple(tensor.dims), hashlib.sha256(tensor.raw_data).digest()


def share_weights(directory: Path, graph_files: Sequence[str]) -> int:
    """Move every initializer found with the same type, shape and bytes in two or more of `graph_files`
    into `directory/SHARED_WEIGHTS_FILE`; rewrite the graphs to point there. Returns the bytes saved (0, and
    nothing written, when there is nothing to share or a graph already keeps external data of its own).
    A SHARED_WEIGHTS_FILE left by graphs written before is replaced, or removed when nothing is shared."""
    models = {name: onnx.load(str(directory / name), load_external_data=False) for name in graph_files}
    if any(uses_external_data(tensor) for model in models.values() for tensor in model.graph.initializer):
        return 0  # a model past protobuf's 2 GB already has its own data file (or these graphs share one): leave it
    (directory / SHARED_WEIGHTS_FILE).unlink(missing_ok=True)  # no graph points into a file left from before
    # Each tensor's key once (a hash of its bytes), with the graph that holds it.
    keyed = [(name, tensor, tensor_key(tensor)) for name, model in models.items()
             for tensor in model.graph.initializer if len(tensor.raw_data) >= MIN_SHARED_BYTES]  # fmt: skip
    holders: dict[TensorKey, set[str]] = {}
    for name, _, key in keyed:
        holders.setdefault(key, set()).add(name)
    shared = {key for key, names in holders.items() if len(names) > 1}
    if not shared:
        return 0
    offsets: dict[TensorKey, tuple[int, int]] = {}
    saved = 0
    with open(directory / SHARED_WEIGHTS_FILE, "wb") as data:
        for _, tensor, key in keyed:
            if key not in shared:
                continue
            if key not in offsets:
                data.write(b"\0" * (-data.tell() % ALIGNMENT))
                offsets[key] = (data.tell(), len(tensor.raw_data))
                data.write(tensor.raw_data)
            else:
                saved += len(tensor.raw_data)
            offset, length = offsets[key]
            set_external_data(tensor, SHARED_WEIGHTS_FILE, offset, length)  # reads raw_data: before it is cleared
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
    for name, model in models.items():
        onnx.save(model, str(directory / name))
        onnx.checker.check_model(str(directory / name))
    logger.info("%s: %d tensors held by several graphs stored once in %s (%.1f MB saved)", directory, len(shared),
                SHARED_WEIGHTS_FILE, saved / 1e6)  # fmt: skip
    return saved


def inline_shared_weights(model: onnx.ModelProto, directory: Path) -> bool:
    """In place: read the tensors a graph keeps in `directory/SHARED_WEIGHTS_FILE` back into it, for tools that
    rewrite a graph and save it elsewhere (the int8 conversion of an fp32 dir). Returns whether any were read.
    External data in any other file (a model past 2 GB) is left where it is."""
    shares = [tensor for tensor in model.graph.initializer if uses_external_data(tensor)
              and any(entry.key == "location" and entry.value == SHARED_WEIGHTS_FILE for entry in tensor.external_data)]  # fmt: skip
    if not shares:
        return False
    shared_ids = {id(tensor) for tensor in shares}
    if any(uses_external_data(tensor) and id(tensor) not in shared_ids for tensor in model.graph.initializer):
        raise ValueError(f"{directory}: a graph with both {SHARED_WEIGHTS_FILE} and other external data is not supported")
    load_external_data_for_model(model, str(directory))
    return True
