"""A Hugging Face M2M-100 or NLLB-200 directory -> this project's checkpoint: config, weights, tokenizer, languages, import record.

Both families are transformers' M2M100ForConditionalGeneration (pre-norm layers with a final
LayerNorm per stack, fairseq's sinusoidal positions numbered from pad + 1, tied embeddings); they
differ in the tokenizer (importers/multilingual_tokenizer.py). The same fixed pipeline as Marian's:
refuse every unsupported setting by name, map the weights, convert the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt_serve.importers.marian import (
    ACTIVATIONS,
    CONFIG,
    WEIGHT_FILES,
    MarianImportError,
    add_layer_tensors,
    build_config,
    check_flags_and_shape,
    load_mapped_model,
    marian_name,
    read_json,
    size_fields,
    tied_embedding,
)
from nmt_serve.importers.multilingual_tokenizer import SPM_FILE, convert_m2m100_tokenizer, convert_nllb_tokenizer
from nmt_serve.importers.sentencepiece_tokenizer import TokenizerImportError
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.languages import LanguageTokens
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.transformer import Transformer
from nmt_serve.runtime.manifest import sha256_file

KINDS = ("nllb", "m2m100")
TOKENIZER_CONFIG = "tokenizer_config.json"
# model_type values that name an architecture this importer refuses, and why.
REFUSED_MODEL_TYPES = {
    "nllb-moe": "NLLB-200's mixture-of-experts variant (routed expert FFNs, which this project's Transformer does not compute; "
                "import a dense NLLB-200 such as nllb-200-distilled-600M)",
}  # fmt: skip
# Config keys whose non-default value changes the computation, with that value's meaning.
REFUSED_FLAGS = {"tie_word_embeddings": (True, "an output projection not tied to the embedding"),
                 "add_bias_logits": (False, "a bias on the logits")}  # fmt: skip
# Default language pair of a request that names none, when --source-language / --target-language do not set one.
DEFAULT_LANGUAGES = {"nllb": ("eng_Latn", "fra_Latn"), "m2m100": ("en", "fr")}


class MultilingualImportError(MarianImportError):
    """A source dir that cannot be imported exactly; one line per problem, each naming its file and field."""


@dataclass(frozen=True)
class MultilingualSource:
    kind: str
    directory: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    weights_file: Path


def model_config(raw: Mapping[str, Any], problems: list[str]) -> ModelConfig | None:
    """Our ModelConfig for an M2M100 config.json, or None with every unsupported value named in `problems`."""
    before = len(problems)
    model_type = str(raw.get("model_type"))
    if model_type in REFUSED_MODEL_TYPES:
        problems.append(f"{CONFIG}: model_type {model_type!r} is {REFUSED_MODEL_TYPES[model_type]}, which is not supported")
    elif model_type != "m2m_100":
        problems.append(f"{CONFIG}: model_type {model_type[:40]!r} (expected 'm2m_100', as NLLB-200 and M2M-100 checkpoints have)")
    check_flags_and_shape(raw, REFUSED_FLAGS, problems)
    activation = ACTIVATIONS.get(str(raw.get("activation_function")))
    if activation is None:
        problems.append(f"{CONFIG}: activation_function {str(raw.get('activation_function'))[:40]!r} (supported: {', '.join(ACTIVATIONS)})")
    if len(problems) > before:
        return None
    pad = raw.get("pad_token_id", 1)
    return build_config(problems, lambda: ModelConfig(
        **size_fields(raw), max_positions=int(raw.get("max_position_embeddings", 1024)),
        pad_id=int(pad), bos_id=int(raw.get("decoder_start_token_id", 2)), eos_id=int(raw.get("eos_token_id", 2)), unk_id=3,
        activation=activation, position_layout="fairseq", position_offset=int(pad) + 1, scale_embedding=bool(raw.get("scale_embedding", True)),
        # fairseq's generator never emits pad (its log-prob is -inf); transformers' generate() does not ban it.
        output_bias=False, banned_ids=(int(pad),), pre_norm=True,
    ))  # fmt: skip


def read_source(directory: Path, kind: str) -> MultilingualSource:
    """Validate a Hugging Face M2M100 dir of `kind` (nllb or m2m100); raise MultilingualImportError listing every problem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MultilingualImportError(directory, ["not a directory"])
    problems: list[str] = []
    raw = read_json(directory / CONFIG, problems) or {}
    needed = ["vocab.json", SPM_FILE] if kind == "m2m100" else []
    if kind == "nllb" and not (directory / "tokenizer.json").is_file() and not (directory / SPM_FILE).is_file():
        problems.append(f"tokenizer: neither tokenizer.json nor {SPM_FILE} found")
    problems += [f"{name}: missing" for name in needed if not (directory / name).is_file()]
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        problems.append(f"weights: neither {' nor '.join(WEIGHT_FILES)} found")
    config = model_config(raw, problems) if raw else None
    if problems or config is None or weights is None:
        raise MultilingualImportError(directory, problems or [f"{CONFIG}: unreadable"])
    return MultilingualSource(kind, directory, raw, config, weights)


# Our names of the tensors outside the layers -> M2M100's (without "model.").
STACK_NORMS = {"encoder_norm.weight": "encoder.layer_norm.weight", "encoder_norm.bias": "encoder.layer_norm.bias",
               "decoder_norm.weight": "decoder.layer_norm.weight", "decoder_norm.bias": "decoder.layer_norm.bias"}  # fmt: skip


def m2m100_name(ours: str) -> str:
    return STACK_NORMS.get(ours) or marian_name(ours)


def map_weights(source: MultilingualSource, weights: Mapping[str, torch.Tensor], our_names: list[str]) -> dict[str, torch.Tensor]:
    """Our state dict from M2M100's; refuses untied embeddings. Its position table is not stored: ours is fairseq's."""
    weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    problems: list[str] = []
    state = {"embed.weight": tied_embedding(weights, source.directory, source.weights_file.name, problems)}
    add_layer_tensors(state, weights, our_names, m2m100_name, source.weights_file.name, problems)
    if problems:
        raise MultilingualImportError(source.directory, problems)
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def build_model(source: MultilingualSource) -> Transformer:
    return load_mapped_model(source.config, source.directory, source.weights_file, lambda weights, names: map_weights(source, weights, names))


def m2m100_language_codes(directory: Path) -> list[str]:
    """M2M100Tokenizer's codes for the dir's `language_codes` setting ("m2m100": 100 languages, "wmt21": 8)."""
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    settings = read_json(directory / TOKENIZER_CONFIG, []) if (directory / TOKENIZER_CONFIG).is_file() else {}
    name = str((settings or {}).get("language_codes", "m2m100"))
    if name not in FAIRSEQ_LANGUAGE_CODES:
        raise MultilingualImportError(directory, [f"{TOKENIZER_CONFIG}: language_codes {name[:40]!r} (known: {', '.join(FAIRSEQ_LANGUAGE_CODES)})"])
    return list(FAIRSEQ_LANGUAGE_CODES[name])


def build_tokenizer(source: MultilingualSource) -> tuple[Tokenizer, LanguageTokens]:
    """The converted tokenizer, and the languages it tells the model: each code's token first in the source
    and forced first in the target (transformers' forced_bos_token_id)."""
    try:
        if source.kind == "nllb":
            tokenizer, codes = convert_nllb_tokenizer(source.directory, source.config.vocab_size)
        else:
            tokenizer, codes = convert_m2m100_tokenizer(source.directory, source.config.vocab_size, m2m100_language_codes(source.directory))
    except TokenizerImportError as error:
        raise MultilingualImportError(source.directory, [str(error)]) from error
    if tokenizer.vocab_size != source.config.vocab_size:
        problem = f"tokenizer: {tokenizer.vocab_size} ids, config.json's vocab_size {source.config.vocab_size}"
        raise MultilingualImportError(source.directory, [problem])
    return tokenizer, LanguageTokens(source=codes, target=codes, target_place="target")


def import_record(source: MultilingualSource, origin: str, languages: tuple[str, str]) -> dict[str, Any]:
    """What import.json keeps: where the model came from, the hashes of the files read, the default language pair."""
    read = [CONFIG, source.weights_file.name, "generation_config.json", "tokenizer.json", TOKENIZER_CONFIG, "vocab.json", SPM_FILE]
    return {
        "kind": source.kind,
        "source": origin,
        "files": {name: sha256_file(source.directory / name) for name in read if (source.directory / name).is_file()},
        "source_language": languages[0],
        "target_language": languages[1],
        "transformers_config": {key: source.raw_config.get(key) for key in ("_name_or_path", "transformers_version", "activation_function")},
    }
