"""An int8 decoder's self-attention cache in int8: per-channel scales calibrated on sentences, and the graph rewritten to use them.

Why: from 8 rows up, attention over the cache is a third to over half of the int8 decoder call, and it runs
at the speed of the memory behind the cache (docs/benchmarks.md). ONNX Runtime's GroupQueryAttention keeps
its cache in int8 when told (`k_quant_type` / `v_quant_type` PER_CHANNEL with one scale per head and
channel): it writes each new key and value as round(x / scale) clipped to int8 and attends over the
dequantized cache. Alone, over 32 / 128 rows at positions 8 and 24 with the caches cold, that kernel took
0.55x-0.85x the float32 cache's time; a cache slot and every beam reorder move a quarter of the bytes.

The scales are constants of the graph, so a row's cached values depend on its own tokens alone: the
dir stays batch-invariant. Each is the largest |value| that channel took while the PyTorch model
translated the calibration sentences greedily, divided by 127 and widened by CACHE_SCALE_MARGIN; values
past it are clipped to +-127 steps. The fp32 dir keeps a float32 cache (it must equal PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.export.graphs import past_names, present_names
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.transformer import Transformer

CALIBRATION_SENTENCES = 2000  # the first source sentences of the calibration file that are translated
CALIBRATION_BATCH = 64
INT8_LEVELS = 127.0
# On the default model, scales from 2,000 Ding validation sentences leave a few percent of the Ding test's
# cached tokens with some key or value channel past the largest calibrated value; the margin keeps those from
# clipping at a resolution cost of 1.5x; measured in docs/quality.md (int8).
CACHE_SCALE_MARGIN = 1.5
SMALLEST_SCALE = 1e-8  # a channel that was always 0 still gets a positive scale (the kernel divides by it)
SCALE_INPUTS = 12  # GroupQueryAttention's k_scale and v_scale are its inputs 12 and 13


def calibration_sources(path: Path, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of the first CALIBRATION_SENTENCES sources of a TSV (German, or German<TAB>anything: only the
    first column is read)."""
    return tokenizer.encode_batch([pair[0] for pair in read_tsv(str(path))[:CALIBRATION_SENTENCES]])


def calibrate_cache_scales(model: Transformer, sources: Sequence[Sequence[int]], margin: float = CACHE_SCALE_MARGIN) -> np.ndarray:
    """(decoder layers, 2, d_model): per layer, the self-attention key and value scales of every channel, from the
    keys and values the model caches while it translates `sources` (token ids) greedily: what a serving cache
    holds, the model's own tokens (a reference translation would hold tokens it does not write, and an imported
    model's target side has no tokenizer that encodes)."""
    if not sources:
        raise ValueError("cache calibration needs at least one source sentence")
    config = model.config
    largest = np.zeros((config.n_decoder_layers, 2, config.d_model), dtype=np.float32)

    def record(layer: int, kind: int) -> Callable[[torch.nn.Module, object, torch.Tensor], None]:
        """A forward hook on one projection: the largest |value| per channel of the rows it computes (each step
        feeds one token per live row: no padding)."""

        def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
            values = output.detach().abs().reshape(-1, config.d_model)
            largest[layer, kind] = np.maximum(largest[layer, kind], values.amax(dim=0).float().cpu().numpy())

        return hook

    handles = [projection.register_forward_hook(record(index, kind))
               for index, layer in enumerate(model.decoder_layers)
               for kind, projection in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj))]  # fmt: skip
    try:
        step = TorchStep(model)
        for first in range(0, len(sources), CALIBRATION_BATCH):
            batch = [list(ids[: config.max_positions - 1]) for ids in sources[first : first + CALIBRATION_BATCH]]
            generate(step, batch, SearchOptions(beam_size=1), config.bos_id, config.eos_id, config.max_positions)
    finally:
        for handle in handles:
            handle.remove()
    return np.maximum(largest * margin / INT8_LEVELS, SMALLEST_SCALE).astype(np.float32)


def quantize_self_attention_cache(decoder: onnx.ModelProto, scales: np.ndarray, n_heads: int, head_dim: int) -> None:
    """Rewrite an int8 decoder in place: each GroupQueryAttention keeps its cache in int8 with `scales`
    (calibrate_cache_scales), and the past / present K/V the caller binds are int8."""
    layers = scales.shape[0]
    graph = decoder.graph
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    if len(attention) != layers:
        raise ValueError(f"{len(attention)} GroupQueryAttention nodes in the decoder, {layers} layers of scales")
    for node in attention:
        layer = past_names(layers).index(node.input[3]) // 2  # past_key_<layer>
        names = [f"layer{layer}.self_{kind}_cache_scale" for kind in ("key", "value")]
        for name, values in zip(names, scales[layer], strict=True):
            graph.initializer.append(numpy_helper.from_array(values.reshape(1, n_heads, 1, head_dim), name))
        inputs = [*node.input, *[""] * (SCALE_INPUTS - len(node.input)), *names]
        del node.input[:]
        node.input.extend(inputs)
        kept = [attribute for attribute in node.attribute if attribute.name not in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("k_quant_type", "PER_CHANNEL"), helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("kv_cache_bit_width", 8)])  # fmt: skip
    cache_names = {*past_names(layers), *present_names(layers)}
    for value in [*graph.input, *graph.output]:
        if value.name in cache_names:
            value.type.tensor_type.elem_type = TensorProto.INT8


def quantize_cache_file(decoder_path: Path, scales: np.ndarray, n_heads: int, head_dim: int) -> None:
    """`quantize_self_attention_cache` on a decoder file (its weights inline: before share_weights moves any out)."""
    decoder = onnx.load(str(decoder_path))
    quantize_self_attention_cache(decoder, scales, n_heads, head_dim)
    onnx.save(decoder, str(decoder_path))


def past_cache_scales(decoder_path: Path, past: Sequence[str]) -> list[np.ndarray | None]:
    """Per past K/V name, the scale its int8 cache holds values in (None where the cache is float): what parity
    multiplies a row's cached slots by before comparing them with PyTorch's."""
    scales = cache_scales(onnx.load(str(decoder_path), load_external_data=False))
    return [scales.get(name) for name in past]


def cache_scales(decoder: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Past K/V name -> its scale (H, 1, Dh), for a decoder with an int8 cache; {} for a float cache."""
    initializers = {tensor.name: tensor for tensor in decoder.graph.initializer}
    scales = {}
    for node in decoder.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > SCALE_INPUTS + 1:
            for past, scale in zip(node.input[3:5], node.input[SCALE_INPUTS : SCALE_INPUTS + 2], strict=True):
                scales[past] = numpy_helper.to_array(initializers[scale])[0]
    return scales
