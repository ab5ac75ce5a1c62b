"""The "Attention Is All You Need" encoder-decoder, cut where the export cuts it: encode, cross_kv, decode_step."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_serve.model.config import ModelConfig

# Additive attention bias for masked keys. Finite on purpose: -inf (and -1e9) turn into -inf in
# fp16 and a fully masked row becomes NaN; exp(-1e4) is still exactly 0 in fp32.
MASK_VALUE = -1e4

KV = tuple[Tensor, Tensor]  # (key, value), each (B, H, L, Dh)


def sinusoidal_table(max_positions: int, d_model: int, layout: str = "interleaved", offset: int = 0) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...), shape (L, D), for pos = offset .. offset + L - 1.

    "halves" puts the same sines in features [0, D/2) and the cosines in [D/2, D) (Marian).
    Computed in float64: at position 500 a float32 argument is off by ~3e-5, which is what
    log-prob parity with an imported model's own table would otherwise see.
    "fairseq" is fairseq_table's (M2M-100, NLLB-200).
    """
    if layout == "fairseq":
        return fairseq_table(max_positions, d_model, offset)
    position = torch.arange(offset, offset + max_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (L, ceil(D/2))
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    if layout == "halves":
        half = angles.shape[1]
        table[:, :half] = torch.sin(angles)
        table[:, half:] = torch.cos(angles[:, : d_model - half])
    else:
        table[:, 0::2] = torch.sin(angles)
        table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


def fairseq_table(max_positions: int, d_model: int, offset: int) -> Tensor:
    """sin in features [0, D/2), cos in [D/2, 2 * (D/2)), frequencies 10000^(-i / (D/2 - 1)), a zero last
    feature when D is odd: fairseq's SinusoidalPositionalEmbedding, in float32 as it computes it (the
    models were trained on exactly these values)."""
    half = d_model // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = torch.arange(offset, offset + max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (L, D/2)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return torch.cat([table, torch.zeros(max_positions, d_model - 2 * half)], dim=1)


ACTIVATION_FUNCTIONS = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}


def mask_to_bias(mask: Tensor) -> Tensor:
    """(B, L) bool, True = attend -> (B, 1, 1, L) additive bias."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return torch.where(mask, zero, MASK_VALUE)[:, None, None, :]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        # reshape, not view: the packed encoder's query, key and value are slices of one stacked product.
        return x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def project_kv(self, x: Tensor) -> KV:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(self, x: Tensor, key: Tensor, value: Tensor, bias: Tensor) -> Tensor:
        return self.out_proj(self.attend(self.split_heads(self.q_proj(x)), key, value, bias))

    def attend(self, query: Tensor, key: Tensor, value: Tensor, bias: Tensor) -> Tensor:
        """(B, H, T, Dh) query over (B, H, L, Dh) key and value -> (B, T, D), before the output projection."""
        batch, _, length, _ = query.shape
        # Explicit matmul + softmax: SDPA exports to an ONNX op whose CPU kernel rejects broadcast masks.
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.head_dim) + bias  # (B, H, T, L)
        weights = self.dropout(torch.softmax(scores.float(), dim=-1).to(value.dtype))
        return (weights @ value).transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu") -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.activation(self.up(x))))


class Sublayers(nn.Module):
    """Where a layer's LayerNorms sit. Post-norm (the paper): x = LayerNorm(x + Dropout(sublayer(x)));
    pre-norm (config.pre_norm, M2M-100 / NLLB-200): x = x + Dropout(sublayer(LayerNorm(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = config.pre_norm
        self.dropout = nn.Dropout(config.dropout)

    def sublayer_input(self, x: Tensor, norm: nn.LayerNorm) -> Tensor:
        return norm(x) if self.pre_norm else x

    def add_residual(self, x: Tensor, out: Tensor, norm: nn.LayerNorm) -> Tensor:
        return x + self.dropout(out) if self.pre_norm else norm(x + self.dropout(out))


class EncoderLayer(Sublayers):
    """Self-attention and FFN, each a residual sublayer with its LayerNorm (Sublayers says where)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.self_attn = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.ffn = FeedForward(config.d_model, config.d_ff, config.dropout, config.activation)
        self.norm1 = nn.LayerNorm(config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return self.around_attention(x, lambda h: self.self_attn(h, *self.self_attn.project_kv(h), bias))

    def around_attention(self, x: Tensor, attention: Callable[[Tensor], Tensor]) -> Tensor:
        """The layer with its self-attention sublayer given as `attention` (its input -> its output, before the residual):
        forward's own, or the packed encoder's (export/graphs.py), which attends over another layout of the same rows."""
        x = self.add_residual(x, attention(self.sublayer_input(x, self.norm1)), self.norm1)
        return self.add_residual(x, self.ffn(self.sublayer_input(x, self.norm2)), self.norm2)


class DecoderLayer(Sublayers):
    """Masked self-attention over past + new tokens, cross-attention over memory, FFN."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.self_attn = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.cross_attn = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.ffn = FeedForward(config.d_model, config.d_ff, config.dropout, config.activation)
        self.norm1 = nn.LayerNorm(config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.norm3 = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, past: KV, self_bias: Tensor, cross: KV, cross_bias: Tensor) -> tuple[Tensor, KV]:
        h = self.sublayer_input(x, self.norm1)
        new_key, new_value = self.self_attn.project_kv(h)
        key = torch.cat([past[0], new_key], dim=2)  # (B, H, P+T, Dh)
        value = torch.cat([past[1], new_value], dim=2)
        x = self.add_residual(x, self.self_attn(h, key, value, self_bias), self.norm1)
        x = self.add_residual(x, self.cross_attn(self.sublayer_input(x, self.norm2), cross[0], cross[1], cross_bias), self.norm2)
        x = self.add_residual(x, self.ffn(self.sublayer_input(x, self.norm3)), self.norm3)
        return x, (key, value)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.compute_buffers()
        # Marian's final_logits_bias; absent (not a zero tensor) for models without one, so their checkpoints are unchanged.
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.output_bias else None
        self.embed_dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # Pre-norm stacks end in a LayerNorm each; absent (not an identity) otherwise, so post-norm checkpoints are unchanged.
        self.encoder_norm = nn.LayerNorm(config.d_model) if config.pre_norm else None
        self.decoder_norm = nn.LayerNorm(config.d_model) if config.pre_norm else None
        self.reset_parameters()

    @classmethod
    def from_state(cls, config: ModelConfig, state: Mapping[str, Tensor]) -> Transformer:
        """A model holding `state`'s tensors themselves (float32; float16 ones cast): built on the meta device, so
        no random weights are made only to be overwritten, and the weights are in memory once, not twice (a
        600M-parameter model: 2.5 GB less at its peak). Shape mismatches and missing names raise as in load_state_dict."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict({name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}, assign=True)
        model.compute_buffers()
        return model

    def compute_buffers(self) -> None:
        """The buffers derived from the config (not stored in checkpoints): the position table and the banned ids' -inf."""
        config = self.config
        with torch.device("cpu"):  # real tensors even when the model itself is being built on the meta device
            table = sinusoidal_table(config.max_positions, config.d_model, config.position_layout, config.position_offset)
            banned = torch.zeros(config.vocab_size)
            banned[list(config.banned_ids)] = -math.inf
        self.register_buffer("position_table", table, persistent=False)
        self.register_buffer("banned_log_probs", banned, persistent=False)

    def reset_parameters(self) -> None:
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.xavier_uniform_(parameter)
        # The embedding is also the output projection (tied); d^-0.5 keeps logits O(1) at init.
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.config.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[self.config.pad_id].zero_()

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.config.d_model) if self.config.scale_embedding else 1.0

    def embed_tokens(self, ids: Tensor, positions: Tensor) -> Tensor:
        """(B, T) ids at (B, T) positions -> (B, T, D): scaled embedding + sinusoidal position."""
        x = self.embed(ids) * self.embed_scale + self.position_table[positions]
        return self.embed_dropout(x)

    def encode(self, src_ids: Tensor, src_mask: Tensor) -> Tensor:
        """(B, S) ids, (B, S) bool mask (True = real token) -> memory (B, S, D)."""
        positions = torch.arange(src_ids.shape[1], device=src_ids.device).expand_as(src_ids)
        x = self.embed_tokens(src_ids, positions)
        bias = mask_to_bias(src_mask)
        for layer in self.encoder_layers:
            x = layer(x, bias)
        return self.encoder_norm(x) if self.encoder_norm is not None else x

    def cross_kv(self, memory: Tensor) -> list[KV]:
        """Cross-attention key/value of every decoder layer, computed once per sentence."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]

    def empty_past(self, batch: int, device: torch.device | None = None) -> list[KV]:
        shape = (batch, self.config.n_heads, 0, self.config.head_dim)
        return [(torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in self.decoder_layers]

    def decode(
        self,
        tgt_ids: Tensor,
        positions: Tensor,
        past: list[KV],
        past_mask: Tensor,
        cross: list[KV],
        src_mask: Tensor,
    ) -> tuple[Tensor, list[KV]]:
        """Hidden states of T new tokens per row, and the present cache (past + new).

        tgt_ids (B, T); positions (B,) position of each row's first new token, so rows of one
        batch may be at different steps; past K/V (B, H, P, Dh) per layer with past_mask (B, P)
        saying which past slots are real; cross K/V (B, H, S, Dh) per layer; src_mask (B, S).
        """
        new_tokens = tgt_ids.shape[1]
        steps = torch.arange(new_tokens, device=tgt_ids.device)
        x = self.embed_tokens(tgt_ids, positions[:, None] + steps)  # (B, T, D)
        causal = steps[None, :] <= steps[:, None]  # (T, T): new token t sees new tokens <= t
        batch, past_len = past_mask.shape
        keys_mask = torch.cat([past_mask[:, None, :].expand(batch, new_tokens, past_len), causal.expand(batch, -1, -1)], dim=2)
        zero = torch.zeros((), dtype=torch.float32, device=tgt_ids.device)
        self_bias = torch.where(keys_mask, zero, MASK_VALUE)[:, None]  # (B, 1, T, P+T)
        cross_bias = mask_to_bias(src_mask)
        present = []
        for layer, layer_past, layer_cross in zip(self.decoder_layers, past, cross, strict=True):
            x, layer_present = layer(x, layer_past, self_bias, layer_cross, cross_bias)
            present.append(layer_present)
        return (self.decoder_norm(x) if self.decoder_norm is not None else x), present

    def generate_log_probs(self, hidden: Tensor) -> Tensor:
        """(..., D) -> (..., V) log-probabilities through the tied embedding; banned ids at -inf."""
        logits = hidden @ self.embed.weight.T
        if self.output_bias is not None:
            logits = logits + self.output_bias
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs + self.banned_log_probs if self.config.banned_ids else log_probs

    def decode_step(
        self,
        tgt_ids: Tensor,
        positions: Tensor,
        past: list[KV],
        past_mask: Tensor,
        cross: list[KV],
        src_mask: Tensor,
    ) -> tuple[Tensor, list[KV]]:
        """log_probs (B, T, V) of the next token after each new token, and the present cache."""
        hidden, present = self.decode(tgt_ids, positions, past, past_mask, cross, src_mask)
        return self.generate_log_probs(hidden), present

    def forward(self, src_ids: Tensor, src_mask: Tensor, tgt_ids: Tensor) -> Tensor:
        """Teacher forcing: log_probs (B, T, V) for right-padded tgt_ids (B, T) that start with BOS."""
        hidden = self.decode_hidden(src_ids, src_mask, tgt_ids)
        return self.generate_log_probs(hidden)

    def decode_hidden(self, src_ids: Tensor, src_mask: Tensor, tgt_ids: Tensor) -> Tensor:
        """Decoder hidden states (B, T, D) for a whole target prefix with an empty past."""
        memory = self.encode(src_ids, src_mask)
        batch = tgt_ids.shape[0]
        past_mask = torch.zeros(batch, 0, dtype=torch.bool, device=tgt_ids.device)
        positions = torch.zeros(batch, dtype=torch.long, device=tgt_ids.device)
        hidden, _ = self.decode(tgt_ids, positions, self.empty_past(batch, tgt_ids.device), past_mask, self.cross_kv(memory), src_mask)
        return hidden
