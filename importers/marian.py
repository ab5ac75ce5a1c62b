"""A Hugging Face Marian (OPUS-MT) directory -> this project's checkpoint: config, weights, tokenizers, import record.

A fixed pipeline: read the source's config and refuse what our Transformer does not compute (every
problem named at once), map the weights onto model/transformer.py's names, convert the
SentencePiece tokenizers (importers/sentencepiece_tokenizer.py), then write everything to a
temporary dir that replaces --out only at the end.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nmt_serve.importers.sentencepiece_tokenizer import TokenizerImportError, convert_marian_tokenizer, language_codes
from nmt_serve.model.languages import LanguageTokens
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.transformer import Transformer, sinusoidal_table
from nmt_serve.runtime.manifest import sha256_file

logger = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
# Marian's activation names -> ours (model/config.py ACTIVATIONS); "gelu" is the exact erf GELU in both.
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# Config keys of BART-family checkpoints that would change the computation; Marian's values first.
ARCHITECTURE_FLAGS = {
    "normalize_before": (False, "pre-norm layers (our layers are post-norm)"),
    "static_position_embeddings": (True, "learned position embeddings (ours are sinusoidal)"),
    "normalize_embedding": (False, "a LayerNorm on the embeddings"),
    "add_final_layer_norm": (False, "a final LayerNorm after the layer stacks"),
    "add_bias_logits": (False, "a bias inside the output projection"),
    "share_encoder_decoder_embeddings": (True, "separate source and target embeddings"),
    "tie_word_embeddings": (True, "an output projection not tied to the embedding"),
}
# Positions where an embedded table must match ours before its values are trusted to be sinusoidal.
POSITION_TOLERANCE = 1e-4


class MarianImportError(ValueError):
    """A source dir that cannot be imported exactly; one line per problem, each naming its file and field."""

    def __init__(self, source: Path, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"cannot import {source}: " + "; ".join(problems))


@dataclass(frozen=True)
class MarianSource:
    directory: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    vocab: dict[str, int]
    weights_file: Path
    source_language: str
    target_language: str


def read_json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{path.name}: missing")
    except (ValueError, UnicodeDecodeError) as error:
        problems.append(f"{path.name}: not JSON ({error})")
    return None


def check_flags_and_shape(raw: Mapping[str, Any], flags: Mapping[str, tuple[bool, str]], problems: list[str]) -> None:
    """Flags whose other value changes the computation, and encoder/decoder sizes our one value per model cannot hold."""
    for key, (wanted, meaning) in flags.items():
        if key in raw and bool(raw[key]) != wanted:
            problems.append(f"{CONFIG}: {key}={raw[key]!r} means {meaning}, which is not supported")
    for first, second in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if raw.get(first) != raw.get(second):
            problems.append(f"{CONFIG}: {first} {raw.get(first)} differs from {second} {raw.get(second)} (one value is supported)")


def model_config(raw: Mapping[str, Any], vocab: Mapping[str, int], problems: list[str]) -> ModelConfig | None:
    """Our ModelConfig for a Marian config.json, or None with every unsupported value named in `problems`."""
    before = len(problems)
    if raw.get("model_type") != "marian":
        problems.append(f"{CONFIG}: model_type {str(raw.get('model_type'))[:40]!r} (expected 'marian')")
    check_flags_and_shape(raw, ARCHITECTURE_FLAGS, problems)
    if raw.get("decoder_vocab_size") not in (None, raw.get("vocab_size")):
        problems.append(f"{CONFIG}: decoder_vocab_size {raw.get('decoder_vocab_size')} differs from vocab_size {raw.get('vocab_size')}")
    activation = ACTIVATIONS.get(str(raw.get("activation_function")))
    if activation is None:
        problems.append(f"{CONFIG}: activation_function {str(raw.get('activation_function'))[:40]!r} (supported: {', '.join(ACTIVATIONS)})")
    if raw.get("vocab_size") != len(vocab):
        problems.append(f"{CONFIG}: vocab_size {raw.get('vocab_size')} differs from vocab.json's {len(vocab)} entries")
    unk = vocab.get("<unk>")
    if unk is None:
        problems.append("vocab.json: no '<unk>' entry")
    if len(problems) > before:
        return None
    return build_config(problems, lambda: marian_config(raw, activation, int(unk)))


def marian_config(raw: Mapping[str, Any], activation: str, unk: int) -> ModelConfig:
    pad = int(raw["pad_token_id"])
    return ModelConfig(
        **size_fields(raw), max_positions=int(raw["max_position_embeddings"]),
        pad_id=pad, bos_id=int(raw.get("decoder_start_token_id", pad)), eos_id=int(raw["eos_token_id"]), unk_id=unk,
        activation=activation, position_layout="halves", scale_embedding=bool(raw.get("scale_embedding", False)),
        # OPUS-MT's generation config bans the pad token, which is also the decoder start token.
        output_bias=True, banned_ids=(pad,),
    )  # fmt: skip


def size_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig sizes every BART-family config.json gives the same way (dropout off: import is for inference)."""
    return dict(vocab_size=int(raw["vocab_size"]), d_model=int(raw["d_model"]), n_heads=int(raw["encoder_attention_heads"]),
                n_encoder_layers=int(raw["encoder_layers"]), n_decoder_layers=int(raw["decoder_layers"]), d_ff=int(raw["encoder_ffn_dim"]),
                dropout=0.0)  # fmt: skip


def build_config(problems: list[str], make: Callable[[], ModelConfig]) -> ModelConfig | None:
    """`make()`, or None with its missing key or bad value named in `problems`."""
    try:
        return make()
    except KeyError as error:
        problems.append(f"{CONFIG}: {error.args[0]} missing")
    except (TypeError, ValueError) as error:
        problems.append(f"{CONFIG}: {error}")
    return None


def languages(directory: Path, tokenizer_config: Mapping[str, Any]) -> tuple[str, str]:
    """(source, target) codes: tokenizer_config.json's, else an opus-mt-SRC-TGT dir name's, else unknown."""
    source, target = tokenizer_config.get("source_lang"), tokenizer_config.get("target_lang")
    if source and target:
        return str(source), str(target)
    parts = directory.resolve().name.split("-")
    if len(parts) == 4 and parts[:2] == ["opus", "mt"]:
        return parts[2], parts[3]
    return "und", "und"  # BCP 47 "undetermined"; --source-language / --target-language set them


def read_source(directory: Path) -> MarianSource:
    """Validate a Hugging Face Marian dir; raise MarianImportError listing every problem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MarianImportError(directory, ["not a directory"])
    problems: list[str] = []
    raw = read_json(directory / CONFIG, problems) or {}
    vocab = read_json(directory / "vocab.json", problems) or {}
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        problems.append("vocab.json: expected an object of token -> integer id")
        vocab = {}
    problems += [f"{name}: missing" for name in TOKENIZER_FILES[:2] if not (directory / name).is_file()]
    tokenizer_config = read_json(directory / TOKENIZER_CONFIG, []) or {} if (directory / TOKENIZER_CONFIG).is_file() else {}
    if tokenizer_config.get("separate_vocabs"):
        problems.append(f"{TOKENIZER_CONFIG}: separate_vocabs true (a separate target vocabulary is not supported)")
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        problems.append(f"weights: neither {' nor '.join(WEIGHT_FILES)} found")
    config = model_config(raw, vocab, problems) if raw and vocab else None
    if problems or config is None or weights is None:
        raise MarianImportError(directory, problems or [f"{CONFIG}: unreadable"])
    source_language, target_language = languages(directory, tokenizer_config)
    return MarianSource(directory, raw, config, vocab, weights, source_language, target_language)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)  # weights only: a .bin may not run code


# Our module names (model/transformer.py) -> Marian's, applied to the part after "{encoder,decoder}_layers.N.".
LAYER_MODULES = {"norm1.": "self_attn_layer_norm.", "ffn.up.": "fc1.", "ffn.down.": "fc2.", "cross_attn.": "encoder_attn."}
# norm2 is the FFN's norm in an encoder layer and the cross-attention's in a decoder layer; norm3 is the decoder's FFN norm.
SIDE_MODULES = {"encoder": {"norm2.": "final_layer_norm."}, "decoder": {"norm2.": "encoder_attn_layer_norm.", "norm3.": "final_layer_norm."}}


def marian_name(ours: str) -> str:
    """model/transformer.py's name of a layer tensor -> Marian's (without the "model." prefix)."""
    side, index, module = re.fullmatch(r"(encoder|decoder)_layers\.(\d+)\.(.+)", ours).groups()  # type: ignore[union-attr]
    for mapping in (LAYER_MODULES, SIDE_MODULES[side]):
        prefix = next((key for key in mapping if module.startswith(key)), None)
        if prefix is not None:
            module = mapping[prefix] + module[len(prefix):]
            break
    return f"{side}.layers.{index}.{module}"


def tied_embedding(weights: Mapping[str, torch.Tensor], directory: Path, file_name: str, problems: list[str]) -> torch.Tensor:
    """The one token embedding of a BART-family checkpoint (names without "model."); differing copies are a problem."""
    embeddings = [weights[name] for name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
                  if name in weights]  # fmt: skip
    if not embeddings:
        raise MarianImportError(directory, [f"{file_name}: no shared.weight (the token embedding)"])
    if any(not torch.equal(embeddings[0], other) for other in embeddings[1:]):
        problems.append(f"{file_name}: the encoder, decoder and output embeddings differ (only tied embeddings are supported)")
    return embeddings[0]


def add_layer_tensors(state: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor], our_names: list[str], their_name: Callable[[str], str],
                      file_name: str, problems: list[str]) -> None:  # fmt: skip
    """Every tensor of `our_names` not yet in `state`, read from `weights` under `their_name(ours)`; missing ones are a problem."""
    wanted = {name: their_name(name) for name in our_names if name not in state}
    missing = [theirs for theirs in wanted.values() if theirs not in weights]
    state.update({ours: weights[theirs] for ours, theirs in wanted.items() if theirs in weights})
    if missing:
        problems.append(f"{file_name}: {len(missing)} tensors missing, e.g. model.{missing[0]}")


def map_weights(source: MarianSource, weights: Mapping[str, torch.Tensor], our_names: list[str]) -> dict[str, torch.Tensor]:
    """Our state dict from Marian's; refuses untied embeddings and position tables that are not sinusoidal."""
    weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    config, problems, file_name = source.config, [], source.weights_file.name
    embedding = tied_embedding(weights, source.directory, file_name, problems)
    table = sinusoidal_table(config.max_positions, config.d_model, config.position_layout)
    for side in ("encoder", "decoder"):
        stored = weights.get(f"{side}.embed_positions.weight")
        if stored is not None and (stored.shape != table.shape or (stored.float() - table).abs().max() > POSITION_TOLERANCE):
            problems.append(f"{file_name}: {side}.embed_positions.weight is not Marian's sinusoidal table (learned positions?)")
    state = {"embed.weight": embedding, "output_bias": weights.get("final_logits_bias", torch.zeros(1, config.vocab_size)).reshape(-1)}
    add_layer_tensors(state, weights, our_names, marian_name, file_name, problems)
    if problems:
        raise MarianImportError(source.directory, problems)
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def load_mapped_model(config: ModelConfig, directory: Path, weights_file: Path,
                      map_state: Callable[[Mapping[str, torch.Tensor], list[str]], dict[str, torch.Tensor]]) -> Transformer:  # fmt: skip
    """Our Transformer with the weights file's tensors as `map_state` names them; shape mismatches are refused."""
    with torch.device("meta"):  # only the names: the weights are the file's tensors (Transformer.from_state)
        names = list(Transformer(config).state_dict())
    state = map_state(read_weights(weights_file), names)
    try:
        model = Transformer.from_state(config, state)
    except RuntimeError as error:  # shape mismatches: name the first lines torch reports
        raise MarianImportError(directory, [f"{weights_file.name}: {str(error).splitlines()[1].strip()}"]) from error
    return model.eval()


def build_model(source: MarianSource) -> Transformer:
    return load_mapped_model(source.config, source.directory, source.weights_file, lambda weights, names: map_weights(source, weights, names))


def build_tokenizer(source: MarianSource) -> Tokenizer:
    config = source.config
    vocab_by_id = {token_id: token for token, token_id in source.vocab.items()}
    specials = {"unk": vocab_by_id[config.unk_id], "eos": vocab_by_id[config.eos_id], "pad": vocab_by_id[config.pad_id]}
    try:
        return convert_marian_tokenizer(source.directory / "source.spm", source.vocab, source.directory / "vocab.json", specials)
    except TokenizerImportError as error:
        raise MarianImportError(source.directory, [str(error)]) from error


def language_tokens(source: MarianSource) -> LanguageTokens | None:
    """A multilingual model's target languages: each ">>xxx<<" token, read first in the source; None for a single pair."""
    codes = {token[2:-2]: source.vocab[token] for token in language_codes(source.vocab)}
    return LanguageTokens(target=dict(sorted(codes.items())), target_place="source") if codes else None


def import_record(source: MarianSource, origin: str) -> dict[str, Any]:
    """What import.json keeps: where the model came from, the hashes of the files read, the language pair."""
    read = [CONFIG, source.weights_file.name, *TOKENIZER_FILES, TOKENIZER_CONFIG]
    return {
        "kind": "marian",
        "source": origin,
        "files": {name: sha256_file(source.directory / name) for name in read if (source.directory / name).is_file()},
        "source_language": source.source_language,
        "target_language": source.target_language,
        "transformers_config": {key: source.raw_config.get(key) for key in ("_name_or_path", "transformers_version", "activation_function")},
    }
