"""ModelConfig: the hyper-parameters and special token ids of the Transformer, saved as JSON. Torch-free."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Special ids are fixed by the tokenizer's training order (model/tokenizer.py SPECIAL_TOKENS).
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# Closed tuples: ModelConfig validation and the importers' error messages both read them.
ACTIVATIONS = ("relu", "swish", "gelu")
# "interleaved": sin at even features, cos at odd ones (the paper); "halves": sin in the first half,
# cos in the second (Marian and OPUS-MT models). Same frequencies, different feature order.
# "fairseq": halves whose frequencies run 10000^(-i / (D/2 - 1)), computed in float32 (M2M-100 and NLLB-200).
POSITION_LAYOUTS = ("interleaved", "halves", "fairseq")
# Fields added for imported models. Their defaults are what every model written before them does,
# so a manifest or config.json without them still describes its model exactly.
IMPORT_FIELDS = ("activation", "position_layout", "scale_embedding", "output_bias", "banned_ids", "pre_norm", "position_offset")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    d_ff: int = 1024
    dropout: float = 0.1
    # Longest source or target the sinusoidal table covers; the server clamps to it.
    max_positions: int = 256
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    unk_id: int = UNK_ID
    # What imported models need; the defaults are this project's own models (model/transformer.py).
    activation: str = "relu"  # FFN activation, one of ACTIVATIONS
    position_layout: str = "interleaved"  # one of POSITION_LAYOUTS
    scale_embedding: bool = True  # token embeddings times sqrt(d_model) before the position is added
    output_bias: bool = False  # a learned bias on the logits (Marian's final_logits_bias)
    # Token ids search never picks (log-prob -inf after the softmax): Marian's decoder start token is
    # its pad token, which OPUS-MT generation bans; normalisation still counts them, as there.
    banned_ids: tuple[int, ...] = ()
    # LayerNorm before each sublayer (its output added to the unnormalised input) and one final LayerNorm
    # after each layer stack (M2M-100 and NLLB-200); False is the paper's post-norm, LayerNorm(x + sublayer(x)).
    pre_norm: bool = False
    # Row p of the position table holds sinusoid p + position_offset: fairseq numbers real tokens from
    # pad_id + 1 (M2M-100 and NLLB-200: 2). The graphs' `positions` still count from 0.
    position_offset: int = 0

    def __post_init__(self) -> None:
        # JSON has no tuples: a loaded list becomes the frozen dataclass's tuple.
        object.__setattr__(self, "banned_ids", tuple(int(token) for token in self.banned_ids))
        problems = []
        if self.d_model % self.n_heads:
            problems.append(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for name in ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "max_positions"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.position_offset < 0:
            problems.append(f"position_offset must be >= 0, got {self.position_offset}")
        if self.position_layout not in POSITION_LAYOUTS:
            problems.append(f"position_layout must be one of {', '.join(POSITION_LAYOUTS)}, got {self.position_layout!r}")
        for name in ("pad_id", "bos_id", "eos_id", "unk_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                problems.append(f"{name} must be in [0, vocab_size {self.vocab_size}), got {getattr(self, name)}")
        outside = [token for token in self.banned_ids if not 0 <= token < self.vocab_size]
        if outside:
            problems.append(f"banned_ids must be in [0, vocab_size {self.vocab_size}), got {outside[:5]}")
        if self.eos_id in self.banned_ids:
            problems.append(f"banned_ids must not hold eos_id {self.eos_id}: search could never finish")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {', '.join(unknown)}")
        return cls(**values)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# Training presets (nmt-train --preset). `tiny` is for tests; `small` is the shipped default size.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, max_positions=96),
    "small": ModelConfig(vocab_size=8000, d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=1024),
    "base": ModelConfig(vocab_size=16000, d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048),
}
