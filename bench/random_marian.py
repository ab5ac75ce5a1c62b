"""Random Hugging Face Marian dirs built locally: transformers' MarianMTModel, SentencePiece models trained here.

The tests and `nmt-random-marian OUT` use a tiny one; nmt-marian-bench and `nmt-random-marian --opus-mt-shape` one
of opus-mt-de-en's shape (OPUS_MT_SHAPE). Nothing is downloaded: the weights are random, the SentencePiece models are
trained on generated German. The output is what `nmt-import marian` reads, so the import can be tried offline.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

# German-looking words with umlauts and ß, so the trained pieces cover what the tests feed.
WORDS = ("der die das und ist nicht ein eine Haus Straße Bäume Grüße Öl über für mit dem den zu von Guten Morgen Tag heute "
         "schön Bahnhof wo Wetter groß klein Müller Käse Brötchen Zug fährt um Uhr Nr z. B. bzw. Dr.").split()  # fmt: skip


def german_sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) + rng.choice([".", "!", "?", ",", ""]) for _ in range(count)]


def train_sentencepiece(texts: Sequence[str], path: Path, vocab_size: int, model_type: str = "unigram") -> None:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
                                             character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)  # fmt: skip
    path.write_bytes(model.getvalue())


# Helsinki-NLP/opus-mt-de-en's config.json (d_model 512, 6+6 layers, FFN 2048, 8 heads, 58,101 ids, swish).
OPUS_MT_SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                     encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512)  # fmt: skip
OPUS_MT_VOCAB = 58101


def marian_vocab(source: Path, target: Path, size: int = 0) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, the source then target pieces, <pad> last; filler pieces up to `size`."""
    import sentencepiece

    tokens = ["</s>", "<unk>"]
    for path in (source, target):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        for piece_id in range(processor.get_piece_size()):
            piece = processor.id_to_piece(piece_id)
            if not (processor.is_control(piece_id) or processor.is_unknown(piece_id)) and piece not in tokens:
                tokens.append(piece)
    # Fillers stand for the target pieces of a real vocabulary: never produced by the source model.
    tokens += [f"{chr(0x2581)}filler{index}" for index in range(max(0, size - len(tokens) - 1))]
    tokens.append("<pad>")
    return {token: token_id for token_id, token in enumerate(tokens)}


def build_marian_dir(out: Path, activation: str = "swish", seed: int = 0, vocab_size: int = 0, **config_overrides: object) -> Path:
    """A random MarianMTModel (tiny unless `config_overrides` say otherwise) with its tokenizer files, saved as transformers saves it."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    out.mkdir(parents=True, exist_ok=True)
    texts = german_sentences(400, seed)
    train_sentencepiece(texts, out / "source.spm", 120)
    # The target side is other text, so vocab.json holds pieces the source model never produces.
    train_sentencepiece([text.lower() + " the house is green" for text in texts], out / "target.spm", 120)
    vocab = marian_vocab(out / "source.spm", out / "target.spm", vocab_size)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en"}), encoding="utf-8")
    pad = vocab["<pad>"]
    settings: dict[str, object] = dict(vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=48,
                                       activation_function=activation, scale_embedding=True, pad_token_id=pad, decoder_start_token_id=pad,
                                       eos_token_id=0, forced_eos_token_id=0, share_encoder_decoder_embeddings=True)  # fmt: skip
    settings.update(config_overrides)
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**settings))
    with torch.no_grad():  # a random bias, so a converter that dropped it would be caught
        model.final_logits_bias.normal_(0.0, 0.5)
        if vocab_size:  # init_std 0.02 makes every logit ~0 at d_model 512; this spread gives outputs a real argmax
            model.model.shared.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(out))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-random-marian", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("out", type=Path, help="Hugging Face Marian dir to write (must not exist; parent dirs are created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the SentencePiece training text (default: 0)")
    parser.add_argument("--opus-mt-shape", action="store_true",
                        help=f"opus-mt-de-en's shape (d_model 512, 6 + 6 layers, {OPUS_MT_VOCAB:,} ids: 74M parameters) instead of a tiny model")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_extra("nmt-random-marian", "import", ("torch", "transformers", "sentencepiece"))
    if args.out.exists():
        sys.stderr.write(f"nmt-random-marian: OUT {args.out}: already exists; choose a new dir\n")
        return 1
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its shard-writing bar says nothing here
    # The tiny shape with 256 positions, not the tests' 48: texts of the sample nmt-loadtest sends reach 65 tokens.
    shape: dict[str, object] = dict(vocab_size=OPUS_MT_VOCAB, **OPUS_MT_SHAPE) if args.opus_mt_shape else dict(max_position_embeddings=256)
    build_marian_dir(args.out, seed=args.seed, **shape)  # type: ignore[arg-type]
    print(f"wrote a random Marian model ({'opus-mt-de-en' if args.opus_mt_shape else 'tiny'} shape, seed {args.seed}) to {args.out}; "
          f"import it with: nmt-import marian {args.out} --out models/NAME --export int8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
