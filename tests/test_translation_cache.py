"""The translation cache: LRU within its byte budget, its metrics, the rule for which models use it, and answers from it
byte-identical to fresh ones under concurrent mixed traffic (fp32 and int8, unary and streaming)."""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

import pytest

from nmt_serve.model.search import FinishReason, Hypothesis, SearchOptions
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.runtime.self_check import SelfCheckResult
from nmt_serve.server.models.metrics import Metrics
from nmt_serve.server.models.translation_cache import CacheKey, TranslationCache, answers_are_batch_invariant, entry_bytes
from tests.serving import RunningServer, scrape, server_settings, total

GREEDY = SearchOptions()
TEXTS = ["Ich sehe den Hund.", "Wir haben heute Kaffee. Du magst den Zug nicht.", "Ich habe einen großen Hund heute.",
         "Guten Morgen.", "Der Zug ist nicht schön. Ich sehe den Bahnhof. Wir mögen den Kaffee."]  # fmt: skip


class Counted:
    """The cache's observer calls, counted."""

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.bytes = 0

    def cache_looked_up(self, hit: bool) -> None:
        self.hits += hit
        self.misses += not hit

    def cache_evicted(self) -> None:
        self.evictions += 1

    def cache_resized(self, delta_bytes: int) -> None:
        self.bytes += delta_bytes


def nbest(*tokens: int) -> list[Hypothesis]:
    return [Hypothesis(tuple(tokens), -0.25, FinishReason.EOS)]


def key(sentence: str, options: SearchOptions = GREEDY, model: str = "m") -> CacheKey:
    return CacheKey(model, options, sentence)


def test_cache_drops_the_least_recently_used_entry_once_past_its_budget() -> None:
    size = entry_bytes(key("a"), tuple(nbest(1, 2)))
    cache, observer = TranslationCache(3 * size), Counted()
    for sentence in "abc":
        cache.put(key(sentence), nbest(1, 2), observer)
    assert cache.get(key("a"), observer) == nbest(1, 2)  # "a" is now the most recently used
    cache.put(key("d"), nbest(1, 2), observer)
    assert cache.get(key("b"), observer) is None
    assert [cache.get(key(sentence), observer) is not None for sentence in "acd"] == [True, True, True]
    assert (observer.hits, observer.misses, observer.evictions) == (4, 1, 1)
    assert observer.bytes == cache.size_bytes == 3 * size


def test_cache_keeps_no_entry_larger_than_its_budget() -> None:
    cache, observer = TranslationCache(100), Counted()
    cache.put(key("a"), nbest(1), observer)
    assert len(cache) == 0 and cache.size_bytes == observer.bytes == 0


def test_cache_counts_a_replaced_entry_once() -> None:
    cache, observer = TranslationCache(1 << 20), Counted()
    cache.put(key("a"), nbest(1), observer)
    cache.put(key("a"), nbest(1, 2, 3), observer)
    assert cache.size_bytes == observer.bytes == entry_bytes(key("a"), tuple(nbest(1, 2, 3)))
    assert cache.get(key("a"), observer) == nbest(1, 2, 3)


@pytest.mark.parametrize("other", [key("a", model="n"), key("a", SearchOptions(beam_size=2)), key("a", SearchOptions(max_output_tokens=5)),
                                   key("a", SearchOptions(target_prefix=(7,))), key("a ")])  # fmt: skip
def test_cache_key_tells_apart_models_options_and_exact_text(other: CacheKey) -> None:
    cache, observer = TranslationCache(1 << 20), Counted()
    cache.put(key("a"), nbest(1), observer)
    assert cache.get(other, observer) is None


def test_cache_rejects_a_budget_below_one_byte() -> None:
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        TranslationCache(0)


def test_cache_metrics_are_exported_per_model() -> None:
    metrics = Metrics()
    view = metrics.for_model("de-en")
    size = entry_bytes(key("a"), tuple(nbest(1)))
    cache = TranslationCache(size)
    cache.put(key("a"), nbest(1), view)
    cache.get(key("a"), view)
    cache.put(key("b"), nbest(1), view)
    cache.get(key("a"), view)
    text = metrics.exposition()
    for line in ('nmt_cache_hits_total{model="de-en"} 1.0', 'nmt_cache_misses_total{model="de-en"} 1.0',
                 'nmt_cache_evictions_total{model="de-en"} 1.0', f'nmt_cache_bytes{{model="de-en"}} {float(size)}'):  # fmt: skip
        assert line in text


def check(passed: bool = True, batch_diff: float | None = 0.0) -> SelfCheckResult:
    return SelfCheckResult("self_check.json", 8, 100, 0.0 if passed else 1.0, 1e-3, "cpu", "cpu", batch_diff)


@pytest.mark.parametrize(("result", "cached"), [(None, False), (check(), True), (check(passed=False), False),
                                                (check(batch_diff=None), False), (check(batch_diff=1e-7), False)])  # fmt: skip
def test_cache_covers_only_models_whose_self_check_found_them_batch_invariant(result: SelfCheckResult | None, cached: bool) -> None:
    assert answers_are_batch_invariant(result) is cached


def answers(stub, texts: list[str], beam: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    reply = stub.Translate(pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(beam_size=beam, num_hypotheses=min(beam, 2))),
                           timeout=60)  # fmt: skip
    return [translation.SerializeToString() for translation in reply.translations]


def streamed(stub, text: str) -> tuple[str, bytes]:  # type: ignore[no-untyped-def]
    messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=text), timeout=60))
    return "".join(message.text_delta for message in messages), pb.Translation(hypotheses=messages[-1].hypotheses).SerializeToString()


def fresh_answers(model_dir: Path) -> dict[tuple[str, int], bytes]:
    """Each text alone on a server without a cache: what a fresh run gives."""
    with RunningServer(server_settings(model_dir)) as server:
        channel, stub = server.stub()
        with channel:
            return {(text, beam): answers(stub, [text], beam)[0] for text in TEXTS for beam in (1, 3)}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_cached_answers_equal_fresh_ones_under_concurrent_mixed_traffic(precision: str, tiny_model_dir: Path, int8_dir: Path) -> None:
    """Eight clients send overlapping batches of texts (sentences shared between texts), greedy and beam, unary and
    streaming, on two engines with the cache on: every answer's bytes equal the text's fresh answer, and the cache served some."""
    model_dir = int8_dir if precision == "int8" else tiny_model_dir
    expected = fresh_answers(model_dir)
    with RunningServer(server_settings(model_dir, engines=2, cache_mb=1)) as server:
        channel, stub = server.stub()
        with channel:
            calls = [(TEXTS[start:] + TEXTS[:start], beam) for start in range(len(TEXTS)) for beam in (1, 3)] * 3
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                replies = pool.map(lambda call: answers(stub, *call), calls)
                streams = pool.map(lambda text: streamed(stub, text), TEXTS * 3)
                for (texts, beam), reply in zip(calls, replies, strict=True):
                    assert reply == [expected[(text, beam)] for text in texts]
                for text, (deltas, final) in zip(TEXTS * 3, streams, strict=True):
                    assert final == expected[(text, 1)]
                    assert deltas == pb.Translation.FromString(final).hypotheses[0].text
        samples = scrape(server.server.metrics_port)
    assert total(samples, "nmt_cache_hits_total") > 0 and total(samples, "nmt_cache_misses_total") > 0
    assert total(samples, "nmt_cache_bytes") > 0


def test_stream_takes_a_cached_sentence_from_the_cache_and_runs_the_other(tiny_model_dir: Path) -> None:
    first, second = "Ich sehe den Hund.", "Wir haben heute Kaffee."
    with RunningServer(server_settings(tiny_model_dir, cache_mb=1)) as server:
        channel, stub = server.stub()
        with channel:
            answers(stub, [first], 1)
            deltas, final = streamed(stub, f"{first} {second}")
        samples = scrape(server.server.metrics_port)
    assert deltas == pb.Translation.FromString(final).hypotheses[0].text
    assert (total(samples, "nmt_cache_hits_total"), total(samples, "nmt_cache_misses_total")) == (1, 2)


def test_server_keeps_the_cache_off_for_a_model_whose_self_check_did_not_run(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), RunningServer(server_settings(tiny_model_dir, cache_mb=1, self_check="off")) as server:
        channel, stub = server.stub()
        with channel:
            assert answers(stub, ["Guten Morgen."], 1) == answers(stub, ["Guten Morgen."], 1)
        samples = scrape(server.server.metrics_port)
    assert total(samples, "nmt_cache_hits_total") == total(samples, "nmt_cache_misses_total") == 0
    assert "translation cache off for model" in caplog.text and "self-check did not run" in caplog.text

