"""A base-size random checkpoint (d_model 512, 6+6 layers, FFN 2048, vocab 32k) and its fp32/int8 model dirs, for speed only."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from nmt_serve.export.onnx_export import export_model_dir
from nmt_serve.model.checkpoint import save_weights
from nmt_serve.model.config import PRESETS
from nmt_serve.model.tokenizer import SPECIAL_TOKENS, Tokenizer
from nmt_serve.model.transformer import Transformer

BASE_VOCAB = 32000


def build_random_checkpoint(out: Path, seed: int = 0, precisions: Sequence[str] = ("fp32", "int8")) -> tuple[Path, dict[str, Path]]:
    """Random weights: only speed is measured on it, so a word-level stand-in vocabulary is enough."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = dataclasses.replace(PRESETS["base"], vocab_size=BASE_VOCAB, dropout=0.0)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{index}": index for index in range(len(SPECIAL_TOKENS), BASE_VOCAB)})
    Tokenizer(HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))).save(out / "tokenizer.json")
    save_weights(Transformer(config).eval(), out)
    model_dirs = {}
    for precision in precisions:
        model_dirs[precision] = out / f"onnx-{precision}"
        texts = [" ".join(f"t{index}" for index in range(start, start + 12)) for start in range(10, 90, 10)]
        export_model_dir(out, model_dirs[precision], precision, "base-random", "random", texts)
    return out, model_dirs
