"""Checkpoint dir -> CTranslate2 model dir holding the same weights, so benchmarks compare engines, not models."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from ctranslate2.converters.converter import Converter
from ctranslate2.specs import attention_spec, common_spec, transformer_spec
from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES
from tokenizers import Tokenizer as HFTokenizer

from nmt_serve.model.checkpoint import TOKENIZER_FILE, load_checkpoint
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.transformer import DecoderLayer, EncoderLayer, FeedForward, MultiHeadAttention, Transformer

logger = logging.getLogger(__name__)

# CTranslate2's own name for padding (its Vocabulary::pad_token); our "<pad>" is renamed to it, as
# CTranslate2's fairseq converter does. <s>, </s>, <unk> already are its bos/eos/unk defaults.
CT2_PAD_TOKEN = "<blank>"
# Every weight type CTranslate2 can save (None keeps the checkpoint's float32); feeds CLI and validation.
QUANTIZATIONS: tuple[str, ...] = ACCEPTED_MODEL_TYPES
# torch.nn.LayerNorm's default, which every LayerNorm of model/transformer.py uses.
LAYER_NORM_EPSILON = 1e-5


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().float().numpy().copy()


def set_linear(spec: common_spec.LinearSpec, weight: torch.Tensor, bias: torch.Tensor) -> None:
    spec.weight = to_numpy(weight)  # (out, in), CTranslate2's layout as well as torch's
    spec.bias = to_numpy(bias)


def set_fused_linear(spec: common_spec.LinearSpec, layers: Sequence[torch.nn.Linear]) -> None:
    """Stack Linear layers along the output dim: CTranslate2 splits them back in this order."""
    set_linear(spec, torch.cat([layer.weight for layer in layers]), torch.cat([layer.bias for layer in layers]))


def set_layer_norm(spec: common_spec.LayerNormSpec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma = to_numpy(norm.weight)
    spec.beta = to_numpy(norm.bias)


def set_attention(
    spec: attention_spec.MultiHeadAttentionSpec, attention: MultiHeadAttention, norm: torch.nn.LayerNorm, self_attention: bool
) -> None:
    """linear[0] is fused q|k|v for self-attention; cross-attention has q, then fused k|v on memory."""
    if self_attention:
        set_fused_linear(spec.linear[0], [attention.q_proj, attention.k_proj, attention.v_proj])
    else:
        set_linear(spec.linear[0], attention.q_proj.weight, attention.q_proj.bias)
        set_fused_linear(spec.linear[1], [attention.k_proj, attention.v_proj])
    set_linear(spec.linear[-1], attention.out_proj.weight, attention.out_proj.bias)
    # With pre_norm=False a sublayer's layer_norm runs after its residual: our post-LN norm.
    set_layer_norm(spec.layer_norm, norm)


def set_ffn(spec: transformer_spec.FeedForwardSpec, ffn: FeedForward, norm: torch.nn.LayerNorm) -> None:
    set_linear(spec.linear_0, ffn.up.weight, ffn.up.bias)
    set_linear(spec.linear_1, ffn.down.weight, ffn.down.bias)
    set_layer_norm(spec.layer_norm, norm)


def set_encoder_layer(spec: transformer_spec.TransformerEncoderLayerSpec, layer: EncoderLayer) -> None:
    set_attention(spec.self_attention, layer.self_attn, layer.norm1, self_attention=True)
    set_ffn(spec.ffn, layer.ffn, layer.norm2)


def set_decoder_layer(spec: transformer_spec.TransformerDecoderLayerSpec, layer: DecoderLayer) -> None:
    set_attention(spec.self_attention, layer.self_attn, layer.norm1, self_attention=True)
    set_attention(spec.attention, layer.cross_attn, layer.norm2, self_attention=False)
    set_ffn(spec.ffn, layer.ffn, layer.norm3)


def build_spec(model: Transformer) -> transformer_spec.TransformerSpec:
    """A TransformerSpec with every weight of `model` set (vocabularies and config left to the caller)."""
    config = model.config
    # The spec below is this project's own architecture; imported ones go through CTranslate2's own converters.
    unsupported = {"pre_norm": config.pre_norm, "activation": config.activation != "relu", "position_offset": config.position_offset,
                   "output_bias": config.output_bias, "banned_ids": config.banned_ids}  # fmt: skip
    named = [f"{name}={getattr(config, name)!r}" for name, differs in unsupported.items() if differs]
    if named:
        raise ValueError(f"cannot convert {', '.join(named)}: this converter writes post-norm relu models without output bias or banned ids")
    spec = transformer_spec.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers),
        config.n_heads,
        pre_norm=False,  # post-LN: LayerNorm(x + sublayer(x)), and so no final stack LayerNorm either
        activation=common_spec.Activation.RELU,
    )
    embedding = to_numpy(model.embed.weight)  # (V, D), shared by both sides and the output projection
    # Set explicitly: our table interleaves sin (even dims) and cos (odd dims), where CTranslate2's
    # built-in sinusoid concatenates them. Row i is position i, the first token being position 0.
    positions = to_numpy(model.position_table)  # (max_positions, D)
    for side in (spec.encoder, spec.decoder):
        side.scale_embeddings = True  # embedding * sqrt(d_model), before the positions are added
        side.position_encodings.encodings = positions
    spec.encoder.embeddings[0].weight = embedding
    spec.decoder.embeddings.weight = embedding
    # Tied output projection without bias (LinearSpec.bias is optional); the saver stores it once.
    spec.decoder.projection.weight = embedding
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder_layers, strict=True):
        set_encoder_layer(layer_spec, layer)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True):
        set_decoder_layer(layer_spec, layer)
    return spec


def vocabulary_tokens(tokenizer_path: Path, config: ModelConfig) -> list[str]:
    """Token strings in id order, so CTranslate2's token <-> id mapping is ours."""
    backend = HFTokenizer.from_file(str(tokenizer_path))
    tokens = [backend.id_to_token(token_id) for token_id in range(config.vocab_size)]
    missing = [token_id for token_id, token in enumerate(tokens) if token is None]
    if missing:
        raise ValueError(f"{tokenizer_path}: no token for ids {missing[:10]}")
    tokens[config.pad_id] = CT2_PAD_TOKEN
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{tokenizer_path}: duplicate token strings (after renaming <pad> to {CT2_PAD_TOKEN})")
    return tokens


class CheckpointConverter(Converter):
    """CTranslate2's fixed pipeline (load, validate, optimise/quantise, save) over our checkpoint dir."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)

    def _load(self) -> transformer_spec.TransformerSpec:
        checkpoint = load_checkpoint(self.checkpoint_dir)
        config = checkpoint.config
        with torch.no_grad():
            spec = build_spec(checkpoint.model)
        tokens = vocabulary_tokens(self.checkpoint_dir / TOKENIZER_FILE, config)
        spec.register_source_vocabulary(tokens)
        spec.register_target_vocabulary(tokens)  # identical lists: saved once as shared_vocabulary.json
        spec.config.unk_token = tokens[config.unk_id]
        spec.config.bos_token = tokens[config.bos_id]
        spec.config.eos_token = tokens[config.eos_id]
        spec.config.decoder_start_token = tokens[config.bos_id]  # decoding starts from BOS, as ours
        spec.config.add_source_bos = False
        spec.config.add_source_eos = True  # sources are fed as plain tokens; EOS is appended, as pad_sources does
        spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
        return spec


def convert_checkpoint(checkpoint_dir: Path, out_dir: Path, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model dir (model.bin, config.json, shared_vocabulary.json); replaces out_dir."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    CheckpointConverter(checkpoint_dir).convert(str(out_dir), quantization=quantization, force=True)
    logger.info("wrote CTranslate2 %s model to %s", quantization or "float32", out_dir)
    return Path(out_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert a checkpoint dir to a CTranslate2 model dir (same weights).")
    parser.add_argument("checkpoint", type=Path, help="checkpoint dir (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--out", type=Path, required=True, help="CTranslate2 model dir to write (replaced if present)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="weight type (default: float32 as stored)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    convert_checkpoint(args.checkpoint, args.out, args.quantization)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
