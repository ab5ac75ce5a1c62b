"""A SentencePiece unigram model plus a Marian vocab.json -> `tokenizers` JSON, so serving needs no sentencepiece.

MarianTokenizer segments text with the source model's pieces and scores, then numbers each piece by
vocab.json (not by the SentencePiece id); it decodes ids through vocab.json's strings. Two files
reproduce that:
  tokenizer.json         Unigram over vocab.json's id order. Ids whose string is a source piece keep
                         its score; every other id (special tokens, target-only pieces) gets a
                         string no pre-tokenized word can contain, so segmentation sees exactly the
                         source model's pieces. Normalizer: the model's precompiled charsmap, runs of
                         spaces collapsed, ends stripped; pre-tokenizer: Metaspace.
  target_tokenizer.json  the same ids spelled as vocab.json spells them, with the special tokens
                         marked special, for decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from nmt_serve.model.tokenizer import Tokenizer

SPACE = "\u2581"  # SentencePiece's visible space
# Never chosen: far below any real piece's log-probability, still finite for the Viterbi sums.
UNUSED_SCORE = -1e9
# sentencepiece_model.proto's piece types (NORMAL, USER_DEFINED, BYTE, ...) and model types, as the library numbers them.
PIECE_TYPE = sentencepiece_model_pb2.ModelProto.SentencePiece
UNIGRAM = sentencepiece_model_pb2.TrainerSpec.UNIGRAM
BPE = sentencepiece_model_pb2.TrainerSpec.BPE


class TokenizerImportError(ValueError):
    """A SentencePiece model or vocabulary this converter cannot reproduce exactly; names the file and the field."""


def read_model(path: Path) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as error:  # protobuf raises DecodeError, or RuntimeWarning-like errors on garbage
        raise TokenizerImportError(f"{path}: not a SentencePiece model: {error}") from error
    if not proto.pieces:
        raise TokenizerImportError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


def check_model(proto: sentencepiece_model_pb2.ModelProto, path: Path, model_types: tuple[int, ...] = (UNIGRAM,)) -> None:
    """Every SentencePiece option this conversion does not reproduce is refused, all named at once."""
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type not in model_types:
        names = " or ".join(f"{sentencepiece_model_pb2.TrainerSpec.ModelType.Name(kind).lower()}, {kind}" for kind in model_types)
        problems.append(f"trainer_spec.model_type {trainer.model_type} (only {names} is supported)")
    if trainer.byte_fallback:
        problems.append("trainer_spec.byte_fallback true")
    if trainer.treat_whitespace_as_suffix:
        problems.append("trainer_spec.treat_whitespace_as_suffix true")
    if not trainer.split_by_whitespace:
        problems.append("trainer_spec.split_by_whitespace false")
    if not normalizer.escape_whitespaces:
        problems.append("normalizer_spec.escape_whitespaces false")
    if normalizer.normalization_rule_tsv:
        problems.append("normalizer_spec.normalization_rule_tsv (custom rules)")
    user_defined = [piece.piece for piece in proto.pieces if piece.type in (PIECE_TYPE.USER_DEFINED, PIECE_TYPE.BYTE)]
    if user_defined:
        problems.append(f"{len(user_defined)} user-defined or byte pieces, e.g. {user_defined[0][:40]!r}")
    if problems:
        raise TokenizerImportError(f"{path}: unsupported SentencePiece settings: " + "; ".join(problems))


def make_normalizer(proto: sentencepiece_model_pb2.ModelProto) -> normalizers.Normalizer:
    spec = proto.normalizer_spec
    steps: list[normalizers.Normalizer] = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip(left=True, right=True)]
    return normalizers.Sequence(steps)


def metaspace(proto: sentencepiece_model_pb2.ModelProto) -> pre_tokenizers.Metaspace:
    scheme = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    return pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=True)


def unmatchable(token_id: int) -> str:
    # Metaspace splits words before each SPACE, so no word has one after its first character.
    return f"<unused {token_id}>{SPACE}{SPACE}"


def check_vocab(vocab: Mapping[str, int], path: Path, specials: Mapping[str, str]) -> int:
    """The vocabulary's size; its ids must be 0..size-1, each once, and hold the special tokens."""
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise TokenizerImportError(f"{path}: ids must be 0..{len(ids) - 1}, each once")
    missing = [f"{role} {token!r}" for role, token in specials.items() if token not in vocab]
    if missing:
        raise TokenizerImportError(f"{path}: missing {', '.join(missing)}")
    return len(ids)


def language_codes(vocab: Mapping[str, int]) -> list[str]:
    """Target-language tokens of multilingual models (">>fra<<"), which MarianTokenizer reads before the text."""
    return [token for token in vocab if token.startswith(">>") and token.endswith("<<")]


def source_backend(proto: sentencepiece_model_pb2.ModelProto, vocab: Mapping[str, int], unk_token: str) -> HFTokenizer:
    scores = {piece.piece: piece.score for piece in proto.pieces if piece.type == PIECE_TYPE.NORMAL}
    codes = set(language_codes(vocab))
    entries = [(unmatchable(token_id), UNUSED_SCORE) for token_id in range(len(vocab))]
    for token, token_id in vocab.items():
        if token in scores:
            entries[token_id] = (token, scores[token])
        elif token in codes:
            entries[token_id] = (token, UNUSED_SCORE)  # spelled out: the added token below maps to this id
    backend = HFTokenizer(models.Unigram(entries, unk_id=vocab[unk_token], byte_fallback=False))
    backend.normalizer = make_normalizer(proto)
    backend.pre_tokenizer = metaspace(proto)
    backend.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    if codes:
        backend.add_tokens([AddedToken(code, normalized=False) for code in sorted(codes)])
    return backend


def target_backend(vocab: Mapping[str, int], unk_token: str, special_tokens: list[str]) -> HFTokenizer:
    entries = [("", 0.0)] * len(vocab)
    for token, token_id in vocab.items():
        entries[token_id] = (token, 0.0)
    backend = HFTokenizer(models.Unigram(entries, unk_id=vocab[unk_token], byte_fallback=False))
    backend.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special_tokens])
    return backend


def convert_marian_tokenizer(source_spm: Path, vocab: Mapping[str, int], vocab_path: Path, specials: Mapping[str, str]) -> Tokenizer:
    """`specials`: role -> token ("unk", "eos", "pad"); all must be in the vocabulary."""
    size = check_vocab(vocab, vocab_path, specials)
    proto = read_model(source_spm)
    check_model(proto, source_spm)
    missing = [piece.piece for piece in proto.pieces if piece.type == PIECE_TYPE.NORMAL and piece.piece not in vocab]
    if missing:
        # MarianTokenizer numbers such a piece <unk>; one Unigram entry cannot be two ids, so refuse it.
        raise TokenizerImportError(f"{source_spm}: {len(missing)} pieces are not in {vocab_path.name}, e.g. {missing[0][:40]!r}")
    tokenizer = Tokenizer(source_backend(proto, vocab, specials["unk"]), target_backend(vocab, specials["unk"], list(specials.values())))
    if tokenizer.vocab_size != size:
        raise TokenizerImportError(f"{vocab_path}: converted tokenizer has {tokenizer.vocab_size} ids, the vocabulary {size}")
    return tokenizer
