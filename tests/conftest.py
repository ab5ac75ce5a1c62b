"""Session fixtures: a tiny synthetic parallel corpus and a tiny checkpoint trained on it (no network, no real data)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from nmt_serve.model.corpus import write_tsv

# A toy German->English word mapping; sentences translate word by word, so a tiny model can learn some of it.
LEXICON = {
    "ich": "i", "du": "you", "wir": "we", "sehe": "see", "habe": "have", "mag": "like", "den": "the",
    "einen": "a", "hund": "dog", "bahnhof": "station", "kaffee": "coffee", "zug": "train", "großen": "big",
    "schönen": "beautiful", "heute": "today", "morgen": "tomorrow", "nicht": "not", "gern": "gladly",
}

# Servers the tests start as processes keep off the HTTP API's default port (8000): several run at once.
os.environ.setdefault("NMT_HTTP_PORT", "0")


def synthetic_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = sorted(LEXICON)
    pairs = []
    for _ in range(count):
        german = [rng.choice(words) for _ in range(rng.randint(2, 6))]
        pairs.append((" ".join(german).capitalize() + ".", " ".join(LEXICON[w] for w in german).capitalize() + "."))
    return pairs


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    paths = {}
    for name, count, seed in (("train", 400, 1), ("valid", 20, 2), ("test", 20, 3)):
        paths[name] = root / f"{name}.tsv"
        write_tsv(str(paths[name]), synthetic_pairs(count, seed))
    return paths


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained for a few steps through the real nmt-train entry point."""
    from nmt_serve.model.train import main as train_main

    out = tmp_path_factory.mktemp("checkpoint")
    args = ["--train", str(tiny_corpus["train"]), "--valid", str(tiny_corpus["valid"]), "--out", str(out), "--preset", "tiny",
            "--max-steps", "20", "--eval-every", "10", "--log-every", "5", "--max-tokens", "400", "--warmup-steps", "10",
            "--valid-bleu-size", "10", "--no-bf16"]  # fmt: skip
    assert train_main(args) == 0
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint exported to an fp32 model dir through nmt-export, parity included."""
    from nmt_serve.export.onnx_export import main as export_main

    out = tmp_path_factory.mktemp("onnx-fp32")
    assert export_main([str(tiny_checkpoint), "--out", str(out), "--parity-test", str(tiny_corpus["test"])]) == 0
    return out


@pytest.fixture(scope="session")
def int8_dir(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint exported through nmt-export at int8: the default scheme, per-row scales."""
    from nmt_serve.export.onnx_export import main as export_main

    out = tmp_path_factory.mktemp("onnx-int8-rows")
    assert export_main([str(tiny_checkpoint), "--out", str(out), "--precision", "int8", "--parity-test", str(tiny_corpus["test"])]) == 0
    return out


@pytest.fixture(scope="session")
def int8_cache_dir(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`int8_dir` with its self-attention cache in int8 too, scaled on the validation pairs (export/int8_cache.py)."""
    from nmt_serve.export.onnx_export import main as export_main

    out = tmp_path_factory.mktemp("onnx-int8-cache")
    args = [str(tiny_checkpoint), "--out", str(out), "--precision", "int8", "--parity-test", str(tiny_corpus["test"]),
            "--cache-calibration", str(tiny_corpus["valid"])]  # fmt: skip
    assert export_main(args) == 0
    return out


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face Marian dir (swish, random final_logits_bias, its own SentencePiece models)."""
    pytest.importorskip("transformers", reason="nmt-import needs the import extra (transformers, sentencepiece)")
    pytest.importorskip("sentencepiece", reason="nmt-import needs the import extra (transformers, sentencepiece)")
    from nmt_serve.bench.random_marian import build_marian_dir

    return build_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt-de-en")


@pytest.fixture(scope="session")
def imported_marian(marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`marian_dir` through nmt-import marian, exported to onnx-fp32 and onnx-int8 (parity on 6 generated sentences)."""
    from nmt_serve.bench.random_marian import german_sentences
    from nmt_serve.importers.import_command import main as import_main

    root = tmp_path_factory.mktemp("imported")
    test = root / "test.tsv"
    write_tsv(str(test), [(text, "") for text in german_sentences(6, seed=4)])
    out = root / "opus-mt-de-en"
    assert import_main(["marian", str(marian_dir), "--out", str(out), "--export", "fp32,int8", "--parity-test", str(test), "--parity-limit", "6"]) == 0
    return out


@pytest.fixture(scope="session")
def nllb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face NLLB-200 dir (M2M100 architecture, NllbTokenizer over a SentencePiece BPE model trained here)."""
    pytest.importorskip("transformers", reason="nmt-import needs the import extra (transformers, sentencepiece)")
    pytest.importorskip("sentencepiece", reason="nmt-import needs the import extra (transformers, sentencepiece)")
    from nmt_serve.bench.random_multilingual import build_multilingual_dir

    return build_multilingual_dir(tmp_path_factory.mktemp("nllb") / "nllb-200-tiny", "nllb", seed=1)


@pytest.fixture(scope="session")
def imported_nllb(nllb_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`nllb_dir` through nmt-import nllb (default pair de -> ru), exported to onnx-fp32 and onnx-int8."""
    from nmt_serve.bench.random_multilingual import multilingual_sentences
    from nmt_serve.importers.import_command import main as import_main
    from nmt_serve.model.corpus import write_tsv

    root = tmp_path_factory.mktemp("imported-nllb")
    test = root / "test.tsv"
    write_tsv(str(test), [(" ".join(text.split()), "") for text in multilingual_sentences(6, seed=4)])
    out = root / "nllb-tiny"
    assert import_main(["nllb", str(nllb_dir), "--out", str(out), "--export", "fp32,int8", "--parity-test", str(test), "--parity-limit", "6",
                        "--source-language", "de", "--target-language", "ru"]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="session")
def native_kernels_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The native attention kernels built in this session (runtime/build_kernels.py) from headers already on this
    machine (`make install` fetches them); skipped, with the reason, where there are none or no compiler."""
    from nmt_serve.runtime.build_kernels import BuildError, build_library, find_headers

    try:
        return build_library(find_headers(None), tmp_path_factory.mktemp("kernels") / "libnmt_kernels.so")
    except BuildError as error:
        pytest.skip(f"native kernels not buildable here: {error}")
