"""The graph a session with the native kernels runs: the file's graph with its fusions applied in memory.

Each fusion replaces a block of stock nodes by one node only the native kernels library runs, with the same results
(runtime/row_quantize_fusion.py, quantized_matmul_fusion.py, cross_attention_fusion.py, candidate_top_k_fusion.py,
head_layout_fusion.py, decoder_embedding_fusion.py, decoder_lengths_fusion.py) or, for the encoder's self-attention
(runtime/packed_attention_fusion.py) and a float graph's weight products (runtime/float_matmul_fusion.py), the same up
to the dot products' summation order. The file on disk is not changed, so a model dir keeps stock operators and runs
anywhere ONNX Runtime does; make_session (runtime/ort_step.py) falls back to the file as it is when ONNX Runtime will
not load the fused copy. The graph is read and written through runtime/onnx_proto.py: serving installs no onnx package.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nmt_serve.runtime.candidate_top_k_fusion import fuse_candidate_top_k
from nmt_serve.runtime.cross_attention_fusion import fuse_cross_attention
from nmt_serve.runtime.decoder_embedding_fusion import fuse_decoder_embedding
from nmt_serve.runtime.decoder_lengths_fusion import fuse_decoder_lengths
from nmt_serve.runtime.float_matmul_fusion import fuse_float_matmuls
from nmt_serve.runtime.head_layout_fusion import fuse_head_layouts
from nmt_serve.runtime.onnx_proto import ModelProto, parse_model
from nmt_serve.runtime.packed_attention_fusion import fuse_packed_attention
from nmt_serve.runtime.quantized_matmul_fusion import fuse_quantized_matmuls
from nmt_serve.runtime.row_quantize_fusion import fuse_row_quantization

logger = logging.getLogger(__name__)

CONTRIB_DOMAIN = "com.microsoft"

# In order: the weight products' fusion takes the RowQuantize nodes the first one writes; the head layouts' fusion
# runs only in int8 graphs, whose self-attention blocks the one before it leaves; the float products' fusion runs
# last, after the attention fusions have matched the bias Adds they start from.
FUSIONS = {"per-row activation quantizations": fuse_row_quantization, "int8 weight products": fuse_quantized_matmuls,
           "cross-attention blocks": fuse_cross_attention, "candidate searches": fuse_candidate_top_k,
           "encoder self-attention blocks": fuse_packed_attention, "encoder attention head layouts": fuse_head_layouts,
           "int8 decoder embeddings": fuse_decoder_embedding, "self-attention lengths": fuse_decoder_lengths,
           "float weight products": fuse_float_matmuls}


def fused_model_bytes(path: Path) -> bytes | None:
    """The graph at `path` with every fusion applied, serialized; its weights stay in the external data file beside it
    (the session reads them from the graph's folder). None when no fusion applies and the graph already imports
    com.microsoft, so the caller loads the file as it is. ValueError when the file cannot be read."""
    try:
        model = parse_model(Path(path).read_bytes())
    except Exception as error:  # OSError, or protobuf's DecodeError for a file that is not a model
        raise ValueError(f"{Path(path).name}: cannot read it to fuse its nodes: {error}") from error
    counts = {name: fuse(model) for name, fuse in FUSIONS.items()}
    imported = _import_contrib_domain(model)
    if not any(counts.values()) and not imported:
        return None
    fused = ", ".join(f"{name} {count}" for name, count in counts.items() if count)
    done = f"fused in memory for the native kernels: {fused}" if fused else "com.microsoft imported in memory"
    logger.info("%s: %s", Path(path).name, done)
    return model.SerializeToString()


def _import_contrib_domain(model: ModelProto) -> bool:
    """Import com.microsoft into a graph that does not, and say whether it did. The library registers kernels under
    that domain, and ONNX Runtime then resolves the nodes its own optimizer writes there (FusedMatMul in an fp32
    encoder) only in a graph that imports the domain: without the import such a graph did not load with the library."""
    if any(opset.domain == CONTRIB_DOMAIN for opset in model.opset_import):
        return False
    model.opset_import.add(domain=CONTRIB_DOMAIN, version=1)
    return True
