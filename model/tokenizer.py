"""Tokenizer: text <-> ids on HF `tokenizers` JSON files; this project's own byte-level BPE, or an imported pair. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from nmt_serve.model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# Training order fixes the ids: PAD_ID=0, BOS_ID=1, EOS_ID=2, UNK_ID=3 (model/config.py).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
TOKENIZER_FILE = "tokenizer.json"
# Imported SentencePiece models (nmt-import) encode with the source side's pieces and decode with a
# second file that spells every id of the shared vocabulary; own models use tokenizer.json both ways.
TARGET_TOKENIZER_FILE = "target_tokenizer.json"


def tokenizer_files(directory: Path) -> list[str]:
    """The tokenizer file names a checkpoint or model dir holds (what export copies and hashes)."""
    return [name for name in (TOKENIZER_FILE, TARGET_TOKENIZER_FILE) if (Path(directory) / name).is_file()]


class Tokenizer:
    """Text <-> ids.

    Own models: byte-level BPE, so every Unicode string round-trips and <unk> never appears. Text
    is NFC-normalised first (composed umlauts are one code point whatever the input), which is
    the only change a round trip can make.
    Imported models (`target_backend`): the source's SentencePiece pieces encode, the target file
    decodes, and decoded text is stripped of surrounding spaces, as MarianTokenizer's is.
    """

    def __init__(self, backend: HFTokenizer, target_backend: HFTokenizer | None = None) -> None:
        self._backend = backend
        self._target = target_backend or backend
        self._strip = target_backend is not None
        # "</s>" typed by a user is text, not an EOS: special tokens are never parsed from input.
        backend.encode_special_tokens = True
        if target_backend is None:
            for token_id, token in enumerate(SPECIAL_TOKENS):
                if backend.token_to_id(token) != token_id:
                    raise ValueError(f"tokenizer must map {token!r} to id {token_id}")
        elif target_backend.get_vocab_size() != backend.get_vocab_size():
            raise ValueError(f"{TARGET_TOKENIZER_FILE} has {target_backend.get_vocab_size()} ids, {TOKENIZER_FILE} {backend.get_vocab_size()}")

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self._backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._backend.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are dropped."""
        text = self._target.decode(list(ids), skip_special_tokens=True)
        return text.strip() if self._strip else text

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        texts = self._target.decode_batch([list(ids) for ids in batch], skip_special_tokens=True)
        return [text.strip() for text in texts] if self._strip else texts

    def token_strings(self) -> list[str]:
        """Every id's token string, in id order (what peers such as CTranslate2 are fed)."""
        return [self._target.id_to_token(token_id) for token_id in range(self.vocab_size)]

    def save(self, path: Path) -> None:
        """Write the tokenizer to `path` (tokenizer.json) and, for an imported pair, target_tokenizer.json beside it."""
        self._backend.save(str(path))
        if self._strip:
            self._target.save(str(Path(path).parent / TARGET_TOKENIZER_FILE))

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """From a tokenizer.json file, or from a dir holding tokenizer.json (and target_tokenizer.json if imported)."""
        path = Path(path)
        if path.is_dir():
            target = path / TARGET_TOKENIZER_FILE
            return cls(read_backend(path / TOKENIZER_FILE), read_backend(target) if target.is_file() else None)
        return cls(read_backend(path))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        """Learn a BPE vocabulary of `vocab_size` ids over German and English texts together."""
        backend = HFTokenizer(models.BPE(unk_token="<unk>"))
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            # All 256 byte symbols up front: any text, emoji included, stays encodable.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)


def read_backend(path: Path) -> HFTokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception whose text names no file
        raise ValueError(f"{path}: not a readable tokenizers JSON file: {error}") from error
