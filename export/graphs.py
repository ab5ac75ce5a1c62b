"""Flat, named-I/O wrappers around the Transformer: the encoder graph and the one decoder-step graph."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.transformer import Transformer


def encoder_output_names(n_layers: int) -> list[str]:
    return [f"cross_{kind}_{layer}" for layer in range(n_layers) for kind in ("key", "value")]


def past_names(n_layers: int) -> list[str]:
    return [f"past_{kind}_{layer}" for layer in range(n_layers) for kind in ("key", "value")]


def present_names(n_layers: int) -> list[str]:
    return [f"present_{kind}_{layer}" for layer in range(n_layers) for kind in ("key", "value")]


ENCODER_INPUTS = ["src_ids", "src_mask"]
DECODER_INPUTS = ["tgt_ids", "positions", "cache_index", "past_mask", "source_index", "src_mask"]


class EncoderGraph(nn.Module):
    """src_ids (N, S) int64, src_mask (N, S) bool -> cross K, V of every decoder layer, each (N, H, S, Dh)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src_ids, src_mask)
        return tuple(tensor for pair in self.model.cross_kv(memory) for tensor in pair)


class DecoderStepGraph(nn.Module):
    """One decoder step for B rows that may be at different positions and belong to different sources.

    Inputs: tgt_ids (B, 1); positions (B,) position of the fed token; cache_index (B,) the row of
    the past cache each row continues (beam reorder and joins happen here, not as host copies);
    past_mask (B, P) which past slots of the reordered cache are real; source_index (B,) the
    source of each row; src_mask (N, S); then past K, V per layer (R, H, P, Dh) and cross K, V per
    layer (N, H, S, Dh). Outputs: log_probs (B, V) fp32, then present K, V per layer (B, H, P+1, Dh).
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tgt_ids: Tensor,
        positions: Tensor,
        cache_index: Tensor,
        past_mask: Tensor,
        source_index: Tensor,
        src_mask: Tensor,
        *caches: Tensor,
    ) -> tuple[Tensor, ...]:
        n_layers = self.model.config.n_decoder_layers
        flat_past, flat_cross = caches[: 2 * n_layers], caches[2 * n_layers :]
        past = [(flat_past[2 * i].index_select(0, cache_index), flat_past[2 * i + 1].index_select(0, cache_index)) for i in range(n_layers)]
        cross = [(flat_cross[2 * i].index_select(0, source_index), flat_cross[2 * i + 1].index_select(0, source_index)) for i in range(n_layers)]
        row_src_mask = src_mask.index_select(0, source_index)
        log_probs, present = self.model.decode_step(tgt_ids, positions, past, past_mask, cross, row_src_mask)
        return (log_probs[:, 0], *(tensor for pair in present for tensor in pair))


def example_encoder_inputs(model: Transformer, sources: int = 2, src_len: int = 5) -> tuple[Tensor, Tensor]:
    """Sizes >= 2 on every dynamic dim: a size-1 example silently becomes a static dim."""
    src_ids = torch.randint(4, model.config.vocab_size, (sources, src_len))
    src_mask = torch.ones(sources, src_len, dtype=torch.bool)
    src_mask[1, -2:] = False
    return src_ids, src_mask


def example_decoder_inputs(model: Transformer, rows: int = 3, past_len: int = 3, cache_rows: int = 2, sources: int = 2, src_len: int = 5) -> tuple[Tensor, ...]:
    config = model.config
    heads, head_dim, n_layers = config.n_heads, config.head_dim, config.n_decoder_layers
    tgt_ids = torch.randint(4, config.vocab_size, (rows, 1))
    positions = torch.arange(rows, dtype=torch.long) + 1
    cache_index = torch.arange(rows, dtype=torch.long) % cache_rows
    past_mask = torch.ones(rows, past_len, dtype=torch.bool)
    past_mask[0, 0] = False
    source_index = torch.arange(rows, dtype=torch.long) % sources
    src_mask = torch.ones(sources, src_len, dtype=torch.bool)
    past = [torch.randn(cache_rows, heads, past_len, head_dim) for _ in range(2 * n_layers)]
    cross = [torch.randn(sources, heads, src_len, head_dim) for _ in range(2 * n_layers)]
    return (tgt_ids, positions, cache_index, past_mask, source_index, src_mask, *past, *cross)
