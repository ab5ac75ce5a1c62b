"""NLLB-200 and M2M-100 tokenizers -> `tokenizers` JSON (tokenizer.json, target_tokenizer.json), plus each language code's token id.

NLLB: the dir's NllbTokenizer (its tokenizer.json, or transformers' conversion of sentencepiece.bpe.model)
already is a `tokenizers` pipeline; only its post-processor goes (it adds one fixed language code and
EOS; the server adds the request's code, and the engine EOS). M2M-100: M2M100Tokenizer segments with
sentencepiece.bpe.model and numbers each piece by vocab.json, the language tokens "__xx__" following
vocab.json and fairseq's "madeupword" fillers up to the model's vocabulary; that is rebuilt here as a
Unigram or BPE model over those ids, with importers/sentencepiece_tokenizer.py's normalizer. Either
way serving reads JSON only: no sentencepiece, no transformers.

Language tokens are special: decoding drops them, and a code typed inside a text stays text (the
transformers tokenizers would read it as the token).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from nmt_serve.importers.sentencepiece_tokenizer import (
    BPE,
    PIECE_TYPE,
    UNIGRAM,
    UNUSED_SCORE,
    TokenizerImportError,
    check_model,
    check_vocab,
    make_normalizer,
    metaspace,
    read_model,
    target_backend,
    unmatchable,
)
from nmt_serve.model.tokenizer import Tokenizer

SPM_FILE = "sentencepiece.bpe.model"
# NLLB-200's codes: ISO 639-3, underscore, ISO 15924 script ("deu_Latn").
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def without_post_processor(backend: HFTokenizer) -> HFTokenizer:
    spec = json.loads(backend.to_str())
    spec["post_processor"] = None
    return HFTokenizer.from_str(json.dumps(spec))


def fill_to(backend: HFTokenizer, vocab_size: int) -> HFTokenizer:
    """Special filler tokens up to the model's vocabulary (NLLB-200's embedding has rows past its tokenizer's ids)."""
    size = backend.get_vocab_size()
    backend.add_special_tokens([AddedToken(unmatchable(token_id), normalized=False, special=True) for token_id in range(size, vocab_size)])
    return backend


def convert_nllb_tokenizer(directory: Path, vocab_size: int) -> tuple[Tokenizer, dict[str, int]]:
    """The converted tokenizer and {code: token id} of every NLLB language code it holds."""
    from transformers import NllbTokenizer  # the import extra; serving reads the JSON written from this

    reference = NllbTokenizer.from_pretrained(str(directory))
    backend = fill_to(without_post_processor(reference.backend_tokenizer), vocab_size)
    codes = {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items() if NLLB_CODE.fullmatch(token.content)}
    if not codes:
        raise TokenizerImportError(f"{directory}: the NLLB tokenizer holds no language codes such as 'eng_Latn'")
    return Tokenizer(backend, fill_to(without_post_processor(reference.backend_tokenizer), vocab_size)), dict(sorted(codes.items()))


def m2m100_vocab(vocab: Mapping[str, int], codes: list[str], vocab_size: int) -> dict[str, int]:
    """vocab.json's ids, then "__code__" per language, then "madeupwordNNNN" fillers up to the model's `vocab_size`."""
    full = dict(vocab)
    for code in codes:
        full[f"__{code}__"] = len(full)
    filler = 0
    while len(full) < vocab_size:
        full[f"madeupword{filler:04d}"] = len(full)
        filler += 1
    return full


def bpe_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges from its pieces in id order (a piece's id is its merge rank): each piece's
    splits into two known pieces, by the piece's rank, then the halves' ranks."""
    rank = {piece: index for index, piece in enumerate(pieces)}
    merges = []
    for piece in pieces:
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece)) if piece[:cut] in rank and piece[cut:] in rank]
        merges += sorted(splits, key=lambda pair: (rank[pair[0]], rank[pair[1]]))
    return merges


def m2m100_source_backend(proto: sentencepiece_model_pb2.ModelProto, full: Mapping[str, int], specials: list[str]) -> HFTokenizer:
    """Segmentation by the SentencePiece model's own pieces (all in `full`), numbered by `full`. `specials` keep
    their names at their ids, so the added tokens below map onto them."""
    normal = [piece for piece in proto.pieces if piece.type == PIECE_TYPE.NORMAL]
    unk_id = full["<unk>"]
    if proto.trainer_spec.model_type == BPE:
        # Merges only build SentencePiece's pieces, so the other names in `full` (specials, codes, fillers) are never produced.
        model = models.BPE(dict(full), bpe_merges([piece.piece for piece in normal]), unk_token="<unk>", fuse_unk=True, byte_fallback=False)
    else:
        scores = {piece.piece: piece.score for piece in normal}
        entries = [(unmatchable(token_id), UNUSED_SCORE) for token_id in range(len(full))]
        for token, token_id in full.items():
            if token in scores or token in specials:
                entries[token_id] = (token, scores.get(token, UNUSED_SCORE))
        model = models.Unigram(entries, unk_id=unk_id, byte_fallback=False)
    backend = HFTokenizer(model)
    backend.normalizer = make_normalizer(proto)
    backend.pre_tokenizer = metaspace(proto)
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in specials])
    return backend


def convert_m2m100_tokenizer(directory: Path, vocab_size: int, language_codes: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """`vocab_size`: the model's (config.json); `language_codes`: M2M100Tokenizer's list for the dir's `language_codes` setting."""
    vocab_path, spm_path = directory / "vocab.json", directory / SPM_FILE
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerImportError(f"{vocab_path}: not readable as JSON ({error})") from error
    check_vocab(vocab, vocab_path, {role: token for role, token in zip(("bos", "pad", "eos", "unk"), FAIRSEQ_SPECIALS, strict=True)})
    full = m2m100_vocab(vocab, language_codes, vocab_size)
    if len(full) > vocab_size:
        raise TokenizerImportError(f"{vocab_path}: {len(vocab)} entries and {len(language_codes)} language codes exceed config.json's vocab_size {vocab_size}")
    proto = read_model(spm_path)
    check_model(proto, spm_path, (UNIGRAM, BPE))
    missing = [piece.piece for piece in proto.pieces if piece.type == PIECE_TYPE.NORMAL and piece.piece not in vocab]
    if missing:
        # M2M100Tokenizer numbers such a piece <unk>; one model entry cannot be two ids, so refuse it.
        raise TokenizerImportError(f"{spm_path}: {len(missing)} pieces are not in {vocab_path.name}, e.g. {missing[0][:40]!r}")
    specials = [token for token in full if token in FAIRSEQ_SPECIALS or token.startswith(("__", "madeupword"))]
    tokenizer = Tokenizer(m2m100_source_backend(proto, full, specials), target_backend(full, "<unk>", specials))
    return tokenizer, {code: full[f"__{code}__"] for code in language_codes}
