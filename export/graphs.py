"""Graph I/O names and the encoder wrapper torch.onnx exports (the decoder step is written in export/decoder_graph.py)."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from nmt_serve.model.transformer import MultiHeadAttention, Transformer, mask_to_bias
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
    """src_ids (N, S) int64, src_mask (N, S) bool -> cross K, V of every decoder layer, each (N, H, S, Dh).

    Packed: the embeddings, every weight product, layer norm and feed-forward run on the real tokens alone
    (T rows, the mask's True positions, as one (1, T, D) sequence); only attention sees the (N, S) layout,
    its projections gathered into it. A call's products then cost its tokens, not N x S. The products that
    read one input are one product of stacked weights, so a layer gathers once for its query, key and value,
    and the decoder's cross keys and values are one product and one gather for all its layers.

    A real position's outputs are those of the padded form: padded keys were masked to exact zero weights
    there, and the stacked products give each output column the same sum. A padded position of the outputs
    repeats its source's last real token (the decoder masks it)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.self_projections = nn.ModuleList(
            stacked_linear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]) for layer in model.encoder_layers
        )
        self.cross_projection = stacked_linear([projection for layer in model.decoder_layers
                                                for projection in (layer.cross_attn.k_proj, layer.cross_attn.v_proj)])  # fmt: skip

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        sources, width = src_ids.shape
        flat_mask = src_mask.reshape(-1)
        real = torch.nonzero(flat_mask).squeeze(1)  # (T,) flat positions of the real tokens
        # Each (N, S) position's row among the T: its own for a real token, the last real one before it for padding
        # (whose keys attention masks and whose queries' results are dropped), so unpacking is one Gather.
        layout = (torch.cumsum(flat_mask.long(), 0) - 1).clamp(min=0)
        columns = torch.arange(width, device=src_ids.device).expand(sources, width).reshape(-1)
        # (1, T, D): three-dimensional rows keep every product a MatMul (ONNX Runtime's optimizer would fuse a
        # two-dimensional MatMul and its bias into a Gemm, which the int8 conversion's shape inference rejects).
        # index_select, not indexing: it exports as one Gather (indexing as GatherND with its index reshaped).
        positions = columns.index_select(0, real).unsqueeze(0)  # a token's position is its column
        x = model.embed_tokens(src_ids.reshape(1, -1).index_select(1, real), positions)
        bias = mask_to_bias(src_mask)
        for layer, projection in zip(model.encoder_layers, self.self_projections, strict=True):
            x = layer.around_attention(x, partial(packed_self_attention, layer.self_attn, projection, real, layout, bias, sources, width))
        if model.encoder_norm is not None:
            x = model.encoder_norm(x)
        cross = unpack(self.cross_projection(x), layout, sources, width).chunk(2 * len(model.decoder_layers), dim=-1)
        attentions = [layer.cross_attn for layer in model.decoder_layers for _ in range(2)]  # each layer's key, then value
        return tuple(attention.split_heads(part) for attention, part in zip(attentions, cross, strict=True))


def stacked_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear computing `linears` (which read the same input) side by side along its outputs."""
    stacked = nn.Linear(linears[0].in_features, sum(linear.out_features for linear in linears))
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([linear.weight for linear in linears]))
        stacked.bias.copy_(torch.cat([linear.bias for linear in linears]))
    return stacked.to(linears[0].weight.dtype)


def packed_self_attention(attention: MultiHeadAttention, projection: nn.Linear, real: Tensor, layout: Tensor, bias: Tensor,
                          sources: int, width: int, h: Tensor) -> Tensor:  # fmt: skip
    """The self-attention sublayer on (1, T, D) packed rows: its stacked query, key and value projection gathered into
    the (N, S) = (sources, width) layout that `bias` masks, attention there, and the real positions' results packed again."""
    query, key, value = (attention.split_heads(part) for part in unpack(projection(h), layout, sources, width).chunk(3, dim=-1))
    attended = attention.attend(query, key, value, bias).reshape(1, sources * width, -1).index_select(1, real)
    return attention.out_proj(attended)


def unpack(rows: Tensor, layout: Tensor, sources: int, width: int) -> Tensor:
    """(1, T, D) rows of the real tokens -> (N, S, D), each position the row `layout` gives it."""
    return rows.index_select(1, layout).view(sources, width, rows.shape[-1])


def example_encoder_inputs(model: Transformer, sources: int = 2, src_len: int = 5) -> tuple[Tensor, Tensor]:
    """Sizes >= 2 on every dynamic dim: a size-1 example silently becomes a static dim."""
    src_ids = torch.randint(4, model.config.vocab_size, (sources, src_len))
    src_mask = torch.ones(sources, src_len, dtype=torch.bool)
    src_mask[1, -2:] = False
    return src_ids, src_mask
