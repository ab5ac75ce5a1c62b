"""Languages in the API: codes resolved from BCP 47 or the model's own, validated by name, and one NLLB model serving many pairs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt_serve.bench.random_multilingual import multilingual_sentences
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.languages import LanguageTokens, ModelLanguages, UnknownLanguage, resolve
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, held_engines, wait_for
from tests.test_http import call, http_settings

NLLB_CODES = ["deu_Latn", "eng_Latn", "rus_Cyrl", "zho_Hans", "zho_Hant", "arb_Arab", "hin_Deva"]
# (source, target) as a client may name them: BCP 47 tags and the model's own codes mixed.
# The last pair shares the first's target: the translation cache must tell the two sources apart.
PAIRS = [("de", "ru"), ("rus_Cyrl", "zh-Hans"), ("ar", "hi"), ("hi", "deu_Latn"), ("en", "ru")]


@pytest.mark.parametrize(("requested", "known", "expected"), [
    ("deu_Latn", NLLB_CODES, "deu_Latn"), ("de", NLLB_CODES, "deu_Latn"), ("DEU-latn", NLLB_CODES, "deu_Latn"), ("zh-Hant", NLLB_CODES, "zho_Hant"),
    ("zh-Hant-TW", NLLB_CODES, "zho_Hant"), ("ar", NLLB_CODES, "arb_Arab"), ("ara", NLLB_CODES, "arb_Arab"),
    ("deu_Latn", ["de", "en", "zh"], "de"), ("zh-Hans", ["de", "en", "zh"], "zh"), ("fr", ["deu", "fra"], "fra"),
])  # fmt: skip
def test_resolve_maps_bcp47_and_model_codes_onto_the_models_code(requested: str, known: list[str], expected: str) -> None:
    assert resolve(requested, known) == expected


def test_resolve_refuses_unknown_and_ambiguous_codes() -> None:
    with pytest.raises(UnknownLanguage, match="is not a language of this model"):
        resolve("tlh", NLLB_CODES)
    with pytest.raises(UnknownLanguage, match=r"names several of the model's languages \(zho_Hans, zho_Hant\)"):
        resolve("zh", NLLB_CODES)


def test_model_languages_name_the_field_and_a_capped_supported_list() -> None:
    codes = {f"l{index:03d}_Latn": index for index in range(30)}
    languages = ModelLanguages("l000_Latn", "l001_Latn", LanguageTokens(codes, codes))
    assert languages.prefixes("", "") == ((0,), (1,))
    with pytest.raises(UnknownLanguage) as caught:
        languages.prefixes("", "xx")
    assert str(caught.value).startswith("target_language 'xx' is not a language of this model; supported: l000_Latn, l001_Latn")
    assert "l019_Latn and 10 more (GetModelInfo lists them all)" in str(caught.value) and "l020_Latn" not in str(caught.value)


def test_marian_multilingual_target_language_is_its_token_first_in_the_source() -> None:
    languages = ModelLanguages("en", "mul", LanguageTokens(target={"fra": 7, "spa": 8}, target_place="source"))
    assert languages.prefixes("", "fr") == ((7,), ())
    assert languages.prefixes("en", "") == ((), ())  # no default target token: the text may still carry its own >>xxx<<
    assert languages.target_codes == ["fra", "spa"] and languages.source_codes == ["en"]


def test_single_pair_model_accepts_its_own_pair_only() -> None:
    languages = ModelLanguages("de", "en")
    assert languages.prefixes("deu", "en-GB") == ((), ())
    with pytest.raises(UnknownLanguage, match="target_language 'fr' is not a language of this model; supported: en"):
        languages.prefixes("de", "fr")


def pytorch_translation(checkpoint_dir: Path, text: str, pair: tuple[str, str]) -> str:
    """What the PyTorch model translates `text` to in `pair`, given the same language tokens the server adds."""
    checkpoint = load_checkpoint(checkpoint_dir)
    languages = ModelLanguages("deu_Latn", "rus_Cyrl", LanguageTokens.load(checkpoint_dir / "languages.json"))
    source_prefix, target_prefix = languages.prefixes(*pair)
    config = checkpoint.config
    hypotheses = generate(TorchStep(checkpoint.model), [[*source_prefix, *checkpoint.tokenizer.encode(text)]], SearchOptions(target_prefix=target_prefix),
                          config.bos_id, config.eos_id, config.max_positions)  # fmt: skip
    return checkpoint.tokenizer.decode(hypotheses[0][0].token_ids)


@pytest.fixture(scope="module")
def nllb_server(imported_nllb: Path) -> Iterator[RunningServer]:
    # One engine: requests spread over several engines would never share a step.
    # The translation cache on: it must keep the answers of different source languages apart.
    with RunningServer(http_settings(imported_nllb / "onnx-fp32", engines=1, cache_mb=8)) as server:
        yield server


def test_one_nllb_model_serves_several_pairs_over_grpc_and_http_as_pytorch(nllb_server: RunningServer, imported_nllb: Path) -> None:
    text = " ".join(multilingual_sentences(1, seed=22)[0].split())
    expected = [pytorch_translation(imported_nllb, text, pair) for pair in PAIRS]
    assert expected[0] != expected[-1] and len(set(expected)) > 2  # the language tokens steer the output
    channel, stub = nllb_server.stub()
    options = pb.DecodingOptions(split_sentences=False)
    with channel:
        grpc_texts = [stub.Translate(pb.TranslateRequest(texts=[text], options=options, source_language=source, target_language=target),
                                     timeout=60).translations[0].hypotheses[0].text for source, target in PAIRS]  # fmt: skip
        streamed = list(stub.TranslateStream(pb.TranslateStreamRequest(text=text, options=options, source_language="ar", target_language="hi"), timeout=60))
    http_texts = []
    for source, target in PAIRS:
        status, _, body = call(nllb_server, "POST", "/v1/translate", {"texts": [text], "options": {"split_sentences": False},
                                                                      "source_language": source, "target_language": target})  # fmt: skip
        assert status == 200, body
        http_texts.append(json.loads(body)["translations"][0]["hypotheses"][0]["text"])
    assert grpc_texts == http_texts == expected
    assert "".join(message.text_delta for message in streamed) == streamed[-1].hypotheses[0].text == expected[2]


def test_default_pair_is_the_imports(nllb_server: RunningServer, imported_nllb: Path) -> None:
    text = "дом Haus"
    channel, stub = nllb_server.stub()
    with channel:
        reply = stub.Translate(pb.TranslateRequest(texts=[text], options=pb.DecodingOptions(split_sentences=False)), timeout=60)
    assert reply.translations[0].hypotheses[0].text == pytorch_translation(imported_nllb, text, ("deu_Latn", "rus_Cyrl"))


def test_unknown_language_is_invalid_argument_naming_the_field_and_supported_codes(nllb_server: RunningServer) -> None:
    channel, stub = nllb_server.stub()
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.Translate(pb.TranslateRequest(texts=["Haus"], target_language="tlh"), timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "target_language 'tlh' is not a language of this model; supported: ace_Arab, ace_Latn" in caught.value.details()
    assert "and 182 more (GetModelInfo lists them all)" in caught.value.details()
    status, _, body = call(nllb_server, "POST", "/v1/translate", {"texts": ["Haus"], "source_language": "zh"})
    assert status == 400 and "source_language 'zh' names several of the model's languages (zho_Hans, zho_Hant)" in json.loads(body)["error"]["message"]


def test_model_info_and_list_models_report_languages(nllb_server: RunningServer) -> None:
    channel, stub = nllb_server.stub()
    with channel:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        listed = stub.ListModels(pb.ListModelsRequest(), timeout=30).models[0]
    assert (info.source_language, info.target_language) == ("deu_Latn", "rus_Cyrl")
    assert len(info.source_languages) == len(info.target_languages) == 202 and {"eng_Latn", "zho_Hant"} <= set(info.target_languages)
    assert list(listed.target_languages) == list(info.target_languages)


def test_one_engine_step_holds_rows_of_different_target_languages(nllb_server: RunningServer, imported_nllb: Path) -> None:
    targets = ["eng_Latn", "rus_Cyrl", "zho_Hans"]
    token_ids = LanguageTokens.load(imported_nllb / "languages.json").target
    text = "Haus дом 你好"
    server = nllb_server.server
    engine = server.models.resolve("").scheduler.engines[0]
    fed: list[set[int]] = []  # the tokens every step fed its rows
    advance = engine._advance

    def recording(*args: object) -> None:
        fed.append({int(token) for job in engine.active for token in job.searcher.next_tokens})
        advance(*args)

    engine._advance = recording  # type: ignore[method-assign]
    channel, stub = nllb_server.stub()
    try:
        with channel, held_engines(nllb_server) as gate:
            options = pb.DecodingOptions(split_sentences=False)
            calls = [stub.Translate.future(pb.TranslateRequest(texts=[text], options=options, target_language=target), timeout=60) for target in targets]
            # All three wait in the queue before the engine takes its first step, so they share every step.
            assert wait_for(lambda: server.scheduler.in_flight == 3, 30)
            gate.open()
            texts = [future.result().translations[0].hypotheses[0].text for future in calls]
    finally:
        del engine._advance
    assert {token_ids[target] for target in targets} in [step & set(token_ids.values()) for step in fed]
    assert texts == [pytorch_translation(imported_nllb, text, ("deu_Latn", target)) for target in targets]
