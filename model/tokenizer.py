"""Tokenizer: one byte-level BPE vocabulary shared by German and English, on HF `tokenizers`. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from nmt_serve.model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# Training order fixes the ids: PAD_ID=0, BOS_ID=1, EOS_ID=2, UNK_ID=3 (model/config.py).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


class Tokenizer:
    """Text <-> ids. Byte-level BPE, so every Unicode string round-trips and <unk> never appears.

    Text is NFC-normalised first (composed umlauts are one code point whatever the input),
    which is the only change a round trip can make.
    """

    def __init__(self, backend: HFTokenizer) -> None:
        self._backend = backend
        # "</s>" typed by a user is text, not an EOS: special tokens are never parsed from input.
        backend.encode_special_tokens = True
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if backend.token_to_id(token) != token_id:
                raise ValueError(f"tokenizer must map {token!r} to id {token_id}")

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
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return self._backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=True)

    def token_strings(self) -> list[str]:
        """Every id's token string, in id order (what peers such as CTranslate2 are fed)."""
        return [self._backend.id_to_token(token_id) for token_id in range(self.vocab_size)]

    def save(self, path: Path) -> None:
        self._backend.save(str(path))

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception whose text names no file
            raise ValueError(f"{path}: not a readable tokenizers JSON file: {error}") from error
        return cls(backend)

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
