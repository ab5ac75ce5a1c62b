"""Random Hugging Face NLLB-200 and M2M-100 dirs built locally: transformers' M2M100ForConditionalGeneration, tokenizers trained here.

Both families are the M2M100 architecture; they differ in the tokenizer (NllbTokenizer: SentencePiece BPE
pieces behind fairseq's four specials, codes such as "deu_Latn"; M2M100Tokenizer: a SentencePiece model
plus vocab.json, codes such as "__de__"). Nothing is downloaded: the weights are random and the
SentencePiece models are trained on generated multilingual text. The output is what `nmt-import nllb`
and `nmt-import m2m100` read, so those imports can be tried offline.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.bench.random_marian import train_sentencepiece
from nmt_serve.model.extras import require_extra

FAMILIES = ("nllb", "m2m100")
# Words of the scripts a many-language model meets, so the trained pieces cover each of them.
SCRIPT_WORDS = {
    "latin": "Haus maison año niño Straße über ça çà garçon łódź čaj þorp the house is green naïve".split(),
    "cyrillic": "дом привет мир хорошо ёлка книга Москва щука".split(),
    "arabic": "مرحبا بيت كتاب سلام القاهرة شكرا".split(),
    "cjk": "你好 世界 日本語 東京 한국어 서울 漢字".split(),
    "devanagari": "नमस्ते भारत हिन्दी किताब दुनिया".split(),
    "emoji": ["😀", "🇩🇪", "👍🏽", "❤️", "🎉"],
    # A letter and its combining mark(s), decomposed (NFD), as some keyboards and PDFs send them.
    "combining": ["e\u0301te\u0301", "n\u0303o", "a\u0308pfel", "A\u030angstro\u0308m", "ca\u0327a"],
}
SEPARATORS = (" ", " ", " ", "  ", "   ", "\t", " \u3000 ", "\n")


def multilingual_sentences(count: int, seed: int) -> list[str]:
    """Sentences mixing the scripts above, words joined by single spaces or whitespace runs."""
    rng = random.Random(seed)
    scripts = list(SCRIPT_WORDS)
    texts = []
    for _ in range(count):
        words = [rng.choice(SCRIPT_WORDS[rng.choice(scripts)]) for _ in range(rng.randint(1, 9))]
        text = words[0]
        for word in words[1:]:
            text += rng.choice(SEPARATORS) + word
        texts.append(text + rng.choice([".", "!", "?", "。", "؟", "।", ""]))
    return texts


# The tiny shape the tests use; the NLLB-200 distilled 600M shape is d_model 1024, 12 + 12 layers, FFN 4096, 16 heads.
TINY_SHAPE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)  # fmt: skip
NLLB_VOCAB = 256_206  # NLLB-200's embedding rows (its tokenizer's ids, then unused ones)
NLLB_600M_SHAPE = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16, decoder_attention_heads=16,
                       encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024)  # fmt: skip


def write_nllb_tokenizer(out: Path, texts: Sequence[str], piece_count: int, model_type: str) -> tuple[int, list[int]]:
    """sentencepiece.bpe.model and the files NllbTokenizer.save_pretrained writes; returns the vocabulary size and the codes' ids."""
    from transformers import NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    spm_dir = out / "spm"
    spm_dir.mkdir()
    train_sentencepiece(texts, spm_dir / "sentencepiece.bpe.model", piece_count, model_type)
    # The 202 language codes named, as the hub's NLLB tokenizer.json holds them (converting the model alone leaves them out).
    tokenizer = NllbTokenizer.from_pretrained(str(spm_dir), additional_special_tokens=list(FAIRSEQ_LANGUAGE_CODES))
    tokenizer.save_pretrained(str(out))
    (out / "sentencepiece.bpe.model").write_bytes((spm_dir / "sentencepiece.bpe.model").read_bytes())
    for path in spm_dir.iterdir():
        path.unlink()
    spm_dir.rmdir()
    return len(tokenizer), tokenizer.convert_tokens_to_ids(list(FAIRSEQ_LANGUAGE_CODES))


def write_m2m100_tokenizer(out: Path, texts: Sequence[str], piece_count: int, model_type: str) -> tuple[int, list[int]]:
    """sentencepiece.bpe.model, vocab.json (fairseq's four specials, then the pieces) and tokenizer_config.json; returns as write_nllb_tokenizer."""
    import sentencepiece
    from transformers import M2M100Tokenizer

    train_sentencepiece(texts, out / "sentencepiece.bpe.model", piece_count, model_type)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(out / "sentencepiece.bpe.model"))
    tokens = ["<s>", "<pad>", "</s>", "<unk>"]
    tokens += [processor.id_to_piece(index) for index in range(processor.get_piece_size())
               if not (processor.is_control(index) or processor.is_unknown(index))]  # fmt: skip
    (out / "vocab.json").write_text(json.dumps({token: index for index, token in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8")
    tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"))
    tokenizer.save_pretrained(str(out))
    # The model's ids: vocab.json's, then one per language code, then fairseq's "madeupword" fillers.
    return tokenizer.encoder_size + len(tokenizer.lang_code_to_id) + tokenizer.num_madeup_words, list(tokenizer.lang_code_to_id.values())


def build_multilingual_dir(out: Path, family: str, seed: int = 0, model_type: str = "bpe", piece_count: int = 160,
                           **config_overrides: object) -> Path:  # fmt: skip
    """A random M2M100ForConditionalGeneration (tiny unless `config_overrides` say otherwise) with the family's tokenizer files."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    texts = multilingual_sentences(600, seed)
    writer = write_nllb_tokenizer if family == "nllb" else write_m2m100_tokenizer
    vocab_size, code_ids = writer(out, texts, piece_count, model_type)
    settings: dict[str, object] = dict(vocab_size=vocab_size, **TINY_SHAPE, activation_function="relu", scale_embedding=True, pad_token_id=1,
                                       bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0)  # fmt: skip
    settings.update(config_overrides)
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(M2M100Config(**settings))
    # The spreads below were chosen at the tiny shape's width; scaled by it, a wider model's products keep the
    # same size per layer instead of growing sqrt(width / 32)-fold at each of them (overflowing the logits).
    width_scale = math.sqrt(TINY_SHAPE["d_model"] / int(settings["d_model"]))  # type: ignore[call-overload]
    with torch.no_grad():
        # init_std 0.02 leaves every logit ~0 and the residual stream to the token fed, so greedy repeats it;
        # these spreads give outputs a clear argmax that moves with the input and the target language.
        model.model.shared.weight.normal_(0.0, 1.0 * width_scale)
        model.model.shared.weight[code_ids] *= 0.1  # 202 codes among ~360 ids would otherwise fill the outputs
        for name, parameter in model.named_parameters():
            if "layer_norm" in name:  # away from (1, 0), so a misplaced norm shows
                parameter.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("weight") and ("proj" in name or ".fc" in name):
                parameter.normal_(0.0, 0.35 * width_scale)
    model.save_pretrained(str(out))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-random-multilingual", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("family", choices=FAMILIES, help="tokenizer family to write")
    parser.add_argument("out", type=Path, help="Hugging Face dir to write (must not exist; parent dirs are created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the SentencePiece training text (default: 0)")
    parser.add_argument("--nllb-600m-shape", action="store_true", help="NLLB-200 distilled 600M's shape (d_model 1024, 12 + 12 layers; with nllb, its 256,206 ids) instead of a tiny model")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_extra("nmt-random-multilingual", "import", ("torch", "transformers", "sentencepiece"))
    if args.out.exists():
        sys.stderr.write(f"nmt-random-multilingual: OUT {args.out}: already exists; choose a new dir\n")
        return 1
    shape: dict[str, object] = dict(NLLB_600M_SHAPE) if args.nllb_600m_shape else dict(max_position_embeddings=256)
    if args.nllb_600m_shape and args.family == "nllb":
        shape["vocab_size"] = NLLB_VOCAB  # its output projection is most of a decoder step's work
    build_multilingual_dir(args.out, args.family, seed=args.seed, **shape)  # type: ignore[arg-type]
    print(f"wrote a random {args.family} model to {args.out}; import it with: nmt-import {args.family} {args.out} --out models/NAME --export int8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
