"""Graph I/O names and the encoder wrapper torch.onnx exports (the decoder step is written in export/decoder_graph.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt_serve.model.transformer import Transformer
from nmt_serve.runtime.source_group import narrow_name


def kv_names(prefix: str, layer: int) -> tuple[str, str]:
    """The key and value tensor names of one decoder layer: cross_key_0, past_value_2, ..."""
    return f"{prefix}_key_{layer}", f"{prefix}_value_{layer}"


def encoder_output_names(n_layers: int) -> list[str]:
    return [name for layer in range(n_layers) for name in kv_names("cross", layer)]


def narrow_cross_names(n_layers: int) -> list[str]:
    """The decoder's second set of cross K/V inputs, for the short sources (runtime/source_group.py)."""
    return [narrow_name(name) for name in encoder_output_names(n_layers)]


def past_names(n_layers: int) -> list[str]:
    return [name for layer in range(n_layers) for name in kv_names("past", layer)]


def present_names(n_layers: int) -> list[str]:
    return [name for layer in range(n_layers) for name in kv_names("present", layer)]


ENCODER_INPUTS = ["src_ids", "src_mask"]


class EncoderGraph(nn.Module):
    """src_ids (N, S) int64, src_mask (N, S) bool -> cross K, V of every decoder layer, each (N, H, S, Dh)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src_ids, src_mask)
        return tuple(tensor for pair in self.model.cross_kv(memory) for tensor in pair)


def example_encoder_inputs(model: Transformer, sources: int = 2, src_len: int = 5) -> tuple[Tensor, Tensor]:
    """Sizes >= 2 on every dynamic dim: a size-1 example silently becomes a static dim."""
    src_ids = torch.randint(4, model.config.vocab_size, (sources, src_len))
    src_mask = torch.ones(sources, src_len, dtype=torch.bool)
    src_mask[1, -2:] = False
    return src_ids, src_mask
