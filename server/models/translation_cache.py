"""The translation cache: each sentence's n-best, keyed by model, options and exact text, least recently used out first.

One cache serves every model of a server within one byte budget (nmt-serve --cache-mb). A model
uses it only when the engine's answer to a sentence cannot depend on what else shares its batch:
its start-up self-check ran, passed, and found each reference sentence alone and all of them packed
bit-identical (runtime/self_check.py). Then a cached n-best is the n-best a fresh run would give,
token for token and score for score, and the text built from it is byte-identical.

Everything here runs on the server's event loop; a lock still guards the table, so a caller on
another thread can never see it half-changed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nmt_serve.model.search import Hypothesis, SearchOptions
from nmt_serve.runtime.manifest import MANIFEST_FILE
from nmt_serve.runtime.self_check import SelfCheckResult

logger = logging.getLogger(__name__)

# What an entry holds in memory, measured with tracemalloc on CPython 3.12 (10,000 entries of 50-character sentences
# with 20-token hypotheses: 1,570 bytes each with one hypothesis, 4,470 with four; these constants count 1,590 and 4,500).
ENTRY_OVERHEAD_BYTES = 570  # the key, its options, the string header, the table's slot, the n-best tuple
HYPOTHESIS_OVERHEAD_BYTES = 250  # a Hypothesis, its token tuple's header, its score
TOKEN_BYTES = 36  # a pointer and an int object (ids past 256 are not CPython's shared small ints)


class CacheObserver(Protocol):
    """One model's cache metrics (server/models/model_metrics.py implements it)."""

    def cache_looked_up(self, hit: bool) -> None: ...

    def cache_evicted(self) -> None: ...

    def cache_resized(self, delta_bytes: int) -> None: ...


@dataclass(frozen=True)
class CacheKey:
    model: str  # sha256 of the model dir's manifest.json, which holds the sha256 of every file of the model
    options: SearchOptions  # every option that changes the output, the target prefix's token ids included
    sentence: str  # the exact text the engine translates
    # Tokens the engine reads before the text: a multilingual model's language token, which the text does not show.
    source_prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Entry:
    nbest: tuple[Hypothesis, ...]
    size_bytes: int
    observer: CacheObserver


def entry_bytes(key: CacheKey, nbest: tuple[Hypothesis, ...]) -> int:
    """The bytes an entry counts against the budget: its text, its token ids and a fixed overhead per object."""
    tokens = len(key.options.target_prefix) + len(key.source_prefix) + sum(len(hypothesis.token_ids) for hypothesis in nbest)
    return ENTRY_OVERHEAD_BYTES + len(key.sentence.encode("utf-8")) + HYPOTHESIS_OVERHEAD_BYTES * len(nbest) + TOKEN_BYTES * tokens


def model_identity(model_dir: Path) -> str:
    """The cache's name for a model: the sha256 of its manifest.json (a changed file changes the manifest's hashes)."""
    return hashlib.sha256((Path(model_dir) / MANIFEST_FILE).read_bytes()).hexdigest()


def answers_are_batch_invariant(check: SelfCheckResult | None) -> bool:
    """The rule for caching a model's answers: its self-check ran, passed, and found alone and packed bit-identical."""
    return check is not None and check.passed and check.batch_diff == 0.0


class TranslationCache:
    """Least recently used first out once the entries' bytes (entry_bytes) pass `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a translation cache needs a budget of at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey, observer: CacheObserver) -> list[Hypothesis] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        observer.cache_looked_up(entry is not None)
        return None if entry is None else list(entry.nbest)

    def put(self, key: CacheKey, nbest: list[Hypothesis], observer: CacheObserver) -> None:
        """Stores `nbest`, dropping the least recently used entries to make room; an entry over the whole budget is not kept."""
        stored = tuple(nbest)
        size = entry_bytes(key, stored)
        if size > self.max_bytes:
            return
        evicted: list[_Entry] = []
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self.size_bytes -= replaced.size_bytes
            while self._entries and self.size_bytes + size > self.max_bytes:
                _, oldest = self._entries.popitem(last=False)
                self.size_bytes -= oldest.size_bytes
                evicted.append(oldest)
            self._entries[key] = _Entry(stored, size, observer)
            self.size_bytes += size
        if replaced is not None:
            replaced.observer.cache_resized(-replaced.size_bytes)
        for entry in evicted:
            entry.observer.cache_evicted()
            entry.observer.cache_resized(-entry.size_bytes)
        observer.cache_resized(size)


class ModelCache:
    """One model's door to the shared cache: its identity and its metrics, bound once."""

    def __init__(self, cache: TranslationCache, identity: str, observer: CacheObserver) -> None:
        self.cache, self.identity, self.observer = cache, identity, observer

    def get(self, options: SearchOptions, sentence: str, source_prefix: tuple[int, ...] = ()) -> list[Hypothesis] | None:
        return self.cache.get(CacheKey(self.identity, options, sentence, source_prefix), self.observer)

    def put(self, options: SearchOptions, sentence: str, nbest: list[Hypothesis], source_prefix: tuple[int, ...] = ()) -> None:
        self.cache.put(CacheKey(self.identity, options, sentence, source_prefix), nbest, self.observer)


def model_cache(cache: TranslationCache | None, name: str, model_dir: Path, check: SelfCheckResult | None,
                observer: CacheObserver) -> ModelCache | None:  # fmt: skip
    """The model's ModelCache, or None (logged) when the cache is off or the model's answers may depend on the batch."""
    if cache is None:
        return None
    if not answers_are_batch_invariant(check):
        why = "its self-check did not run" if check is None else (
            "its self-check failed" if not check.passed else "its precision is not checked for batch invariance")
        logger.warning("translation cache off for model %s: %s, so an answer could depend on its batch", name, why)
        return None
    return ModelCache(cache, model_identity(model_dir), observer)
