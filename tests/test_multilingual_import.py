"""nmt-import nllb|m2m100 on tiny random models: tokenizer ids and log-probs as transformers', export parity, clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmt_serve.bench.random_multilingual import build_multilingual_dir, multilingual_sentences
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.languages import LanguageTokens
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import check_model_dir
from tests.import_sources import config_variant, refused_import

pytest.importorskip("transformers", reason="nmt-import needs the import extra")
from nmt_serve.importers import m2m100, marian_parity  # noqa: E402
from nmt_serve.importers.import_command import main as import_main  # noqa: E402
from nmt_serve.importers.marian_parity import compare_with_transformers  # noqa: E402

# fp32 log-probs against transformers' own M2M100ForConditionalGeneration (measured 1.5e-5 to 1.9e-5 on these random weights).
LOG_PROB_BOUND = 1e-4
# Texts every converted tokenizer is held to: the generated multilingual table plus blank and edge texts.
EDGE_TEXTS = ["", " ", "   ", "\t", " leading and trailing ", "unseen: wxyz Ω ☃ 𝔘 qq", "\u00a0é\u0301", "ﬁ ① Ａ ²"]


def sentence_table(count: int, seed: int) -> list[str]:
    return multilingual_sentences(count, seed) + EDGE_TEXTS


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def m2m100_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """M2M-100's tokenizer over either SentencePiece model type (the converter rebuilds both)."""
    return build_multilingual_dir(tmp_path_factory.mktemp("m2m100") / f"m2m100-{request.param}", "m2m100", seed=2, model_type=request.param)


def reference_ids(reference: object, text: str, code: str) -> list[int]:
    reference.src_lang = code  # type: ignore[attr-defined]
    return reference(text)["input_ids"]  # type: ignore[operator]


def assert_same_ids(source_dir: Path, kind: str, reference: object, codes: list[str]) -> None:
    source = m2m100.read_source(source_dir, kind)
    tokenizer, languages = m2m100.build_tokenizer(source)
    texts = sentence_table(400, seed=5)
    for code in codes:
        # Ours: the language token, the text's ids, then EOS (model/padding.py appends it), as the transformers tokenizer builds it.
        mismatches = [text for text in texts if reference_ids(reference, text, code) != [*languages.prefixes(code, None)[0], *tokenizer.encode(text), 2]]
        assert mismatches == [], code


def test_nllb_tokenizer_gives_nllb_tokenizer_ids_with_language_codes(nllb_dir: Path) -> None:
    from transformers import NllbTokenizer

    assert_same_ids(nllb_dir, "nllb", NllbTokenizer.from_pretrained(str(nllb_dir)), ["deu_Latn", "rus_Cyrl", "arb_Arab", "zho_Hans", "hin_Deva"])


def test_m2m100_tokenizer_gives_m2m100_tokenizer_ids_with_language_codes(m2m100_dir: Path) -> None:
    from transformers import M2M100Tokenizer

    assert_same_ids(m2m100_dir, "m2m100", M2M100Tokenizer.from_pretrained(str(m2m100_dir)), ["de", "ru", "ar", "zh", "hi"])


def test_converted_tokenizers_decode_as_transformers_and_drop_language_tokens(nllb_dir: Path, m2m100_dir: Path) -> None:
    from transformers import M2M100Tokenizer, NllbTokenizer

    for kind, directory, reference in (("nllb", nllb_dir, NllbTokenizer.from_pretrained(str(nllb_dir))),
                                       ("m2m100", m2m100_dir, M2M100Tokenizer.from_pretrained(str(m2m100_dir)))):  # fmt: skip
        tokenizer, languages = m2m100.build_tokenizer(m2m100.read_source(directory, kind))
        sequences = [tokenizer.encode(text) for text in sentence_table(60, 7)]
        # Translations are stripped of surrounding spaces (NllbTokenizer keeps a trailing one its normalizer kept; M2M100Tokenizer strips too).
        texts = [tokenizer.decode(ids) for ids in sequences]
        assert texts == [reference.decode(ids, skip_special_tokens=True).strip() for ids in sequences], kind
        # The forced target-language token starts every output; it is not text.
        assert [tokenizer.decode([token, *ids]) for token, ids in zip(list(languages.target.values())[:60], sequences)] == texts[:60], kind


def test_codes_and_specials_typed_in_text_are_text_not_control_tokens(nllb_dir: Path) -> None:
    """A deliberate difference: transformers' tokenizers turn a typed "deu_Latn" or "</s>" into its token; ours never parse control tokens."""
    from transformers import NllbTokenizer

    tokenizer, languages = m2m100.build_tokenizer(m2m100.read_source(nllb_dir, "nllb"))
    assert languages.target["deu_Latn"] in NllbTokenizer.from_pretrained(str(nllb_dir))("deu_Latn </s>")["input_ids"][1:-1]
    assert not {languages.target["deu_Latn"], 2} & set(tokenizer.encode("deu_Latn </s>"))


@pytest.mark.parametrize("pair", [("deu_Latn", "rus_Cyrl"), ("zho_Hans", "arb_Arab")])
def test_nllb_model_matches_transformers_with_forced_target_language(nllb_dir: Path, pair: tuple[str, str]) -> None:
    source = m2m100.read_source(nllb_dir, "nllb")
    model, (tokenizer, languages) = m2m100.build_model(source), m2m100.build_tokenizer(source)
    assert (model.config.pre_norm, model.config.position_layout, model.config.position_offset) == (True, "fairseq", 2)
    report = compare_with_transformers(nllb_dir, model, tokenizer, sentence_table(16, 9), 24, prefixes=languages.prefixes(*pair))
    assert report["max_abs_log_prob_diff"] <= LOG_PROB_BOUND
    assert report["greedy_identical"] == report["greedy_total"] == 16 + len(EDGE_TEXTS), report["first_difference"]


def test_m2m100_model_matches_transformers_with_forced_target_language(m2m100_dir: Path) -> None:
    source = m2m100.read_source(m2m100_dir, "m2m100")
    model, (tokenizer, languages) = m2m100.build_model(source), m2m100.build_tokenizer(source)
    report = compare_with_transformers(m2m100_dir, model, tokenizer, sentence_table(16, 10), 24, prefixes=languages.prefixes("de", "uk"))
    assert report["max_abs_log_prob_diff"] <= LOG_PROB_BOUND
    assert report["greedy_identical"] == report["greedy_total"], report["first_difference"]


def test_nllb_import_writes_checkpoint_languages_and_record(imported_nllb: Path, nllb_dir: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", "languages.json", "import.json"} <= {p.name for p in imported_nllb.iterdir()}
    record = json.loads((imported_nllb / "import.json").read_text(encoding="utf-8"))
    assert (record["kind"], record["source"]) == ("nllb", str(nllb_dir))
    assert (record["source_language"], record["target_language"]) == ("deu_Latn", "rus_Cyrl")  # BCP 47 flags resolved to the model's codes
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])
    parity = record["parity_with_transformers"]
    assert parity["max_abs_log_prob_diff"] <= LOG_PROB_BOUND and parity["greedy_identical"] == parity["greedy_total"] == 6
    languages = LanguageTokens.load(imported_nllb / "languages.json")
    assert len(languages.target) == 202 and languages.target_place == "target"
    assert load_checkpoint(imported_nllb).tokenizer.vocab_size == load_checkpoint(imported_nllb).config.vocab_size


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_nllb_exported_dirs_verify_pass_parity_and_self_check(imported_nllb: Path, precision: str) -> None:
    model_dir = imported_nllb / f"onnx-{precision}"
    manifest = load_model_dir(model_dir)
    assert "languages.json" in manifest.files and manifest.config.pre_norm
    if precision == "fp32":  # the engine's greedy and beam 4 equal PyTorch's exactly
        assert manifest.parity["tensors"]["max_abs_log_prob_diff"] <= 1e-4
        assert manifest.parity["search"]["greedy"]["identical_ratio"] == manifest.parity["search"]["beam4"]["identical_ratio"] == 1.0
    step = OrtStep(model_dir)
    result = check_model_dir(model_dir, step.encode, step.cache, step.config)
    assert result is not None and result.passed


def run_import(kind: str, source: Path, out: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    return refused_import([kind, str(source), *flags], out, capsys)


def test_unsupported_sources_are_refused_by_name(nllb_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def variant(name: str, **config_changes: object) -> Path:
        return config_variant(nllb_dir, tmp_path / name, **config_changes)

    out = tmp_path / "out"
    assert "model_type 'nllb-moe' is NLLB-200's mixture-of-experts variant" in run_import("nllb", variant("moe", model_type="nllb-moe"), out, capsys)
    assert "model_type 'marian' (expected 'm2m_100'" in run_import("nllb", variant("marian", model_type="marian"), out, capsys)
    assert "tie_word_embeddings=False means an output projection not tied" in run_import("nllb", variant("untied", tie_word_embeddings=False), out, capsys)
    assert "activation_function 'gelu_new'" in run_import("nllb", variant("act", activation_function="gelu_new"), out, capsys)
    assert "encoder_ffn_dim 64 differs from decoder_ffn_dim 32" in run_import("nllb", variant("ffn", decoder_ffn_dim=32), out, capsys)
    assert "vocab.json: missing" in run_import("m2m100", nllb_dir, out, capsys)
    message = run_import("nllb", nllb_dir, out, capsys, "--target-language", "tlh")
    assert "--target-language 'tlh' is not a language of this model" in message
    assert "names several of the model's languages (zho_Hans, zho_Hant)" in run_import("nllb", nllb_dir, out, capsys, "--target-language", "zh")


def test_teacher_forced_comparison_in_row_chunks_equals_the_whole_batch(nllb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log-prob comparison is made in chunks of rows when the vocabulary is large; one row per chunk gives the batch's figure."""
    source = m2m100.read_source(nllb_dir, "nllb")
    model, (tokenizer, languages) = m2m100.build_model(source), m2m100.build_tokenizer(source)
    arguments = (nllb_dir, model, tokenizer, sentence_table(8, 3), 12)
    whole = compare_with_transformers(*arguments, prefixes=languages.prefixes("deu_Latn", "fra_Latn"))
    monkeypatch.setattr(marian_parity, "LOG_PROB_ELEMENTS", 1)
    by_row = compare_with_transformers(*arguments, prefixes=languages.prefixes("deu_Latn", "fra_Latn"))
    # One row at a time changes the matrix shapes, so a CPU's GEMM kernels may round the last bits differently:
    # the figures agree to well under the bound they are held to (LOG_PROB_BOUND), on any x86 kernel.
    assert by_row["max_abs_log_prob_diff"] == pytest.approx(whole["max_abs_log_prob_diff"], abs=LOG_PROB_BOUND / 10)
    assert by_row["max_abs_log_prob_diff"] <= LOG_PROB_BOUND
    assert by_row["greedy_identical"] == whole["greedy_identical"]
