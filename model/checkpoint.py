"""The checkpoint dir: config.json, model.safetensors, tokenizer.json, train.json (docs/architecture.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from nmt_serve.model.config import ModelConfig
from nmt_serve.model.tokenizer import TOKENIZER_FILE, Tokenizer
from nmt_serve.model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAIN_INFO_FILE = "train.json"
# What nmt-import writes beside an imported checkpoint: the source, its file hashes, the language pair.
IMPORT_RECORD_FILE = "import.json"
# This project's own models translate German to English.
DEFAULT_LANGUAGES = ("de", "en")


@dataclass
class Checkpoint:
    model: Transformer
    tokenizer: Tokenizer
    train_info: dict[str, Any]

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def save_weights(model: Transformer, directory: Path, half: bool = False) -> None:
    """`half` stores float16 (the shipped checkpoint: half the size; loading casts back to float32)."""
    # The output projection is the embedding (tied), so each tensor is stored once.
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    if half:
        state = {name: tensor.half() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    save_file(state, str(Path(directory) / WEIGHTS_FILE))
    model.config.save(Path(directory) / CONFIG_FILE)


def save_train_info(info: dict[str, Any], directory: Path) -> None:
    path = Path(directory) / TRAIN_INFO_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_train_info(directory: Path) -> dict[str, Any]:
    path = Path(directory) / TRAIN_INFO_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def checkpoint_languages(directory: Path) -> tuple[str, str]:
    """(source, target) language codes: an import record's, else this project's own pair."""
    path = Path(directory) / IMPORT_RECORD_FILE
    if not path.is_file():
        return DEFAULT_LANGUAGES
    record = json.loads(path.read_text(encoding="utf-8"))
    return record.get("source_language") or DEFAULT_LANGUAGES[0], record.get("target_language") or DEFAULT_LANGUAGES[1]


def load_checkpoint(directory: Path, device: str = "cpu") -> Checkpoint:
    """Model (eval mode), tokenizer and training record of a checkpoint dir; names a missing file."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"checkpoint {directory}: missing {name}")
    config = ModelConfig.load(directory / CONFIG_FILE)
    model = Transformer.from_state(config, load_file(str(directory / WEIGHTS_FILE), device=device))
    model.to(device).eval()
    tokenizer = Tokenizer.load(directory)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"checkpoint {directory}: {TOKENIZER_FILE} has {tokenizer.vocab_size} ids, config.json says {config.vocab_size}")
    return Checkpoint(model, tokenizer, load_train_info(directory))

