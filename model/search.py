"""Decoding semantics: greedy and beam search as per-request searchers fed one step of log-probs at a time.

Definitions (numpy only, so the torch-free server shares them):

* Generated tokens are the tokens after BOS, target prefix and EOS included. Hypothesis.token_ids
  holds them without EOS (and never BOS); the target prefix is part of it.
* score = sum(processed log-probs of the generated tokens) / length ** length_penalty, where
  length = number of generated tokens including EOS (fairseq / CTranslate2 convention;
  length_penalty 0 gives the raw sum). Greedy reports the same normalised score.
* Max length L = min(max_output_tokens or int(max_len_a * src_len + max_len_b), max_positions),
  at least 1. Producing L tokens feeds positions 0..L-1 (BOS, then L-1 chosen tokens), so L never
  exceeds the model's position table. A row whose L-th token is not EOS finishes with
  FinishReason.LENGTH; no EOS is appended and its length is L.
* Processors act per row on a float64 copy of the step's log-probs, in this order:
  repetition_penalty p: every token already generated in the row (prefix included) has its
  log-prob multiplied by p (log-probs are <= 0, so p > 1 lowers them; CTRL/HF style, no
  renormalisation). no_repeat_ngram_size n: a token that would complete an n-gram already present
  in the row gets -inf. min_output_tokens m: EOS gets -inf while the row has fewer than m tokens.
* target_prefix tokens are forced one per step and score their unprocessed log-prob (processors
  steer choices; a forced token is not a choice). Beam keeps a single row until the prefix is
  consumed, then expands. A prefix that reaches L finishes with LENGTH.
* Beam search (fairseq style): the 2K best (row score + log-prob) candidates are walked best
  first; an EOS candidate ranked within the first K finishes its row's hypothesis (EOS ranked lower
  is ignored, as the beam itself would not keep it), the first K non-EOS candidates become the live
  rows. Stopping rule ("early stopping", as fairseq): the request is done once beam_size
  hypotheses have finished, or no live row is left. The n-best list is the num_hypotheses best
  finished hypotheses by normalised score. At step 0 there is one row, so no duplicate beams.
* Ties are deterministic: equal scores go to the lower token id, then to the lower parent row
  (a stable sort over the token-major flattening); equal final scores keep finishing order.
  Greedy is argmax of (row score + log-prob), lowest token id on ties, so beam 1 == greedy exactly.
"""

from __future__ import annotations

import enum
import functools
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

try:  # built by nmt-build-kernels from runtime/kernels/beam_select.c; without it the same choice runs in numpy
    from nmt_serve.model import _beam_select as native_beam_select
except ImportError:
    native_beam_select = None

MAX_BEAM_SIZE = 16

# Processors edit one row's float64 log-probs (V,) in place, given that row's generated tokens.
Processor = Callable[[np.ndarray, tuple[int, ...]], None]


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens without BOS/EOS, target prefix included
    score: float  # normalised, see the module docstring
    finish_reason: FinishReason


@dataclass(frozen=True)
class SearchOptions:
    beam_size: int = 1  # 1 = greedy
    num_hypotheses: int = 1  # n-best returned, <= beam_size
    length_penalty: float = 1.0  # alpha in sum / length ** alpha
    max_output_tokens: int | None = None  # None -> max_len_a * src_len + max_len_b
    # English runs ~1.1x the length of German in subword tokens; 1.5x + 10 leaves room for
    # outliers (short sources, segmentation differences) without letting a looping output run long.
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_output_tokens: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    target_prefix: tuple[int, ...] = ()

    def validate(self, max_positions: int) -> None:
        """Raise one ValueError listing every invalid field with its limit."""
        problems: list[str] = []
        _check_int(problems, "max_positions", max_positions, 1)
        _check_int(problems, "beam_size", self.beam_size, 1, MAX_BEAM_SIZE)
        _check_int(problems, "num_hypotheses", self.num_hypotheses, 1, self.beam_size)
        # Negative alpha would reward short outputs twice over (sums are <= 0); 10 is far past use.
        _check_float(problems, "length_penalty", self.length_penalty, 0.0, 10.0)
        if self.max_output_tokens is not None:  # above max_positions is clamped, not rejected
            _check_int(problems, "max_output_tokens", self.max_output_tokens, 1)
        _check_float(problems, "max_len_a", self.max_len_a, 0.0, 100.0)
        _check_int(problems, "max_len_b", self.max_len_b, 0)
        # A row needs room for EOS after its minimum tokens.
        _check_int(problems, "min_output_tokens", self.min_output_tokens, 0, max(max_positions - 1, 0))
        # min == max is allowed: it asks for exactly that many tokens (benchmarks force lengths this way).
        if self.max_output_tokens is not None and self.min_output_tokens > self.max_output_tokens:
            problems.append(f"min_output_tokens must be at most max_output_tokens ({self.max_output_tokens}), "
                            f"got {self.min_output_tokens}")
        # p <= 0 would lift penalised tokens to log-prob >= 0, above every real token.
        _check_float(problems, "repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        _check_int(problems, "no_repeat_ngram_size", self.no_repeat_ngram_size, 0, max_positions)
        if len(self.target_prefix) >= max(max_positions, 1):
            problems.append(f"target_prefix must have fewer than {max_positions} tokens, got {len(self.target_prefix)}")
        if any(not _is_int(token) or token < 0 for token in self.target_prefix):
            problems.append(f"target_prefix must hold token ids >= 0, got {self.target_prefix!r}")
        if problems:
            raise ValueError("invalid search options: " + "; ".join(problems))

    def max_length(self, src_len: int, max_positions: int) -> int:
        """Most tokens a hypothesis may generate (EOS included), clamped to the position table."""
        if self.max_output_tokens is not None:
            length = self.max_output_tokens
        else:
            length = int(self.max_len_a * src_len + self.max_len_b)
        return max(1, min(length, max_positions))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_int(problems: list[str], name: str, value: object, lo: int, hi: int | None = None) -> None:
    if _is_int(value) and lo <= value and (hi is None or value <= hi):  # type: ignore[operator]
        return
    limit = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
    problems.append(f"{name} must be {limit}, got {value!r}")


def _check_float(problems: list[str], name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, (int, float, np.floating)) and math.isfinite(value) and lo <= value <= hi:
        return
    problems.append(f"{name} must be a finite number between {lo:g} and {hi:g}, got {value!r}")


# ---------------------------------------------------------------- processors


def penalize_repetition(penalty: float) -> Processor:
    def process(log_probs: np.ndarray, tokens: tuple[int, ...]) -> None:
        if tokens:
            seen = np.fromiter(set(tokens), dtype=np.int64)  # once per token, however often it occurred
            log_probs[seen] *= penalty

    return process


def ban_repeated_ngrams(size: int) -> Processor:
    def process(log_probs: np.ndarray, tokens: tuple[int, ...]) -> None:
        if len(tokens) < size - 1:
            return
        context = tokens[len(tokens) - size + 1:]  # the n-1 tokens the next token would follow
        banned = [tokens[i + size - 1] for i in range(len(tokens) - size + 1) if tokens[i:i + size - 1] == context]
        log_probs[banned] = -np.inf

    return process


def ban_eos_until(min_tokens: int, eos_id: int) -> Processor:
    def process(log_probs: np.ndarray, tokens: tuple[int, ...]) -> None:
        if len(tokens) < min_tokens:
            log_probs[eos_id] = -np.inf

    return process


def make_processors(options: SearchOptions, eos_id: int) -> list[Processor]:
    processors: list[Processor] = []
    if options.repetition_penalty != 1.0:
        processors.append(penalize_repetition(options.repetition_penalty))
    if options.no_repeat_ngram_size > 0:
        processors.append(ban_repeated_ngrams(options.no_repeat_ngram_size))
    if options.min_output_tokens > 0:
        processors.append(ban_eos_until(options.min_output_tokens, eos_id))
    return processors


# ---------------------------------------------------------------- searchers


class ListBackedArray:
    """A searcher's per-row array attribute kept as a Python list (`_` + its name): assigned an array, it stores the
    items; read, it builds the array."""

    def __init__(self, dtype: type[np.generic]) -> None:
        self.dtype = dtype

    def __set_name__(self, owner: type, name: str) -> None:
        self.items_name = "_" + name

    def __get__(self, searcher: object, owner: type | None = None) -> np.ndarray:
        return np.array(getattr(searcher, self.items_name), dtype=self.dtype)

    def __set__(self, searcher: object, values: np.ndarray) -> None:
        setattr(searcher, self.items_name, np.asarray(values, dtype=self.dtype).tolist())


class Searcher:
    """One request's search state: `advance` consumes its rows' log-probs and picks the next rows.

    Subclasses implement `_choose`, returning (parent row, token, raw score) choices. The rows' scores and next tokens
    live in Python lists (`row_scores`, `next_tokens` build arrays from them when read; `next_token_list` is the list
    itself): the engine advances every request at every step, and a numpy call costs several microseconds right after
    a decoder call has flushed the CPU caches.
    """

    def __init__(self, options: SearchOptions, src_len: int, bos_id: int, eos_id: int, max_positions: int) -> None:
        if eos_id in options.target_prefix:
            raise ValueError(f"target_prefix must not contain eos_id {eos_id}")
        self.options = options
        self.bos_id, self.eos_id = bos_id, eos_id
        self.max_length = options.max_length(src_len, max_positions)
        self.processors = make_processors(options, eos_id)
        self.rows: list[tuple[int, ...]] = [()]  # live rows' generated tokens
        self._row_scores: list[float] = [0.0]
        self.finished: list[tuple[tuple[int, ...], float, FinishReason]] = []
        self._next_tokens: list[int] = [self.bos_id]
        self.done = False

    row_scores = ListBackedArray(np.float64)  # (k,) float64 raw sums
    next_tokens = ListBackedArray(np.int64)

    def initial_tokens(self) -> np.ndarray:
        return np.array([self.bos_id], dtype=np.int64)

    @property
    def next_token_list(self) -> list[int]:
        """The tokens the live rows are fed next, in row order: the searcher's own list, read, not changed."""
        return self._next_tokens

    def advance(self, log_probs: np.ndarray) -> list[int] | None:
        """log_probs (k, V) for this request's rows -> local parent rows (k',), or None once done."""
        if self.done:
            raise RuntimeError("advance() called on a finished searcher")
        if log_probs.shape[0] != len(self.rows):
            raise ValueError(f"expected log-probs for {len(self.rows)} rows, got {log_probs.shape[0]}")
        position = len(self.rows[0])
        if position < len(self.options.target_prefix):  # one row while forcing, see module docstring
            token = self.options.target_prefix[position]
            return self._extend([(0, token, self._row_scores[0] + float(log_probs[0, token]))])
        return self._extend(self._choose(log_probs))

    def hypotheses(self) -> list[Hypothesis]:
        """The n-best finished hypotheses, best first."""
        alpha = self.options.length_penalty
        ranked = [Hypothesis(tokens, raw / (len(tokens) + (reason is FinishReason.EOS)) ** alpha, reason)
                  for tokens, raw, reason in self.finished]
        ranked.sort(key=lambda hypothesis: -hypothesis.score)  # stable: ties keep finishing order
        return ranked[: self.options.num_hypotheses]

    def _processed(self, log_probs: np.ndarray) -> np.ndarray:
        """(k, V) float64 row score + processed log-probs."""
        if self.options.repetition_penalty == 1.0:
            # Only bans (-inf) remain, which commute with adding the row score: one pass, float32 + float64
            # adding in float64 exactly as the general path below does.
            totals = log_probs + self.row_scores[:, None]
            if self.processors:
                for row, tokens in enumerate(self.rows):
                    for process in self.processors:
                        process(totals[row], tokens)
            return totals
        totals = log_probs.astype(np.float64)  # a copy: the step's array is left untouched
        for row, tokens in enumerate(self.rows):
            for process in self.processors:
                process(totals[row], tokens)
        totals += self.row_scores[:, None]
        return totals

    def _choose(self, log_probs: np.ndarray) -> list[tuple[int, int, float]]:
        raise NotImplementedError

    def _extend(self, choices: list[tuple[int, int, float]]) -> list[int] | None:
        parents, rows, scores = [], [], []
        for parent, token, score in choices:
            if token == self.eos_id:
                self.finished.append((self.rows[parent], score, FinishReason.EOS))
                continue
            tokens = self.rows[parent] + (token,)
            if len(tokens) >= self.max_length:
                self.finished.append((tokens, score, FinishReason.LENGTH))
                continue
            parents.append(parent)
            rows.append(tokens)
            scores.append(score)
        self.rows, self._row_scores, self._next_tokens = rows, scores, [tokens[-1] for tokens in rows]
        self.done = not rows or len(self.finished) >= self.options.beam_size
        return None if self.done else parents


class GreedySearch(Searcher):
    """One row; the best token each step.

    Its row's score and next token are the one items of its lists (`score`, `next_token`).
    """

    @property
    def score(self) -> float:
        """The live row's raw score (the sum of its log-probs)."""
        return self._row_scores[0]

    @property
    def next_token(self) -> int:
        """The token the live row is fed next."""
        return self._next_tokens[0]

    def _choose(self, log_probs: np.ndarray) -> list[tuple[int, int, float]]:
        totals = self._processed(log_probs)[0]
        token = int(np.argmax(totals))  # first maximum: the lowest token id wins ties
        return [(0, token, float(totals[token]))]

    @property
    def batchable(self) -> bool:
        """This step's choice is a plain argmax (EOS at most banned): advance_greedy can make it for many requests at once."""
        options = self.options
        return options.repetition_penalty == 1.0 and options.no_repeat_ngram_size == 0 and len(self.rows[0]) >= len(options.target_prefix)

    def step_state(self) -> tuple[list[tuple[int, ...]], list[float], list[int], int, int, int]:
        """What a compiled steady greedy step (runtime/kernels/greedy_step.c) reads and extends in place, as `extend_one`
        does while the row continues: the row list, the score list, the next-token list (the same list objects while the
        search runs), then `min_output_tokens`, the most tokens the row may have and EOS."""
        return self.rows, self._row_scores, self._next_tokens, self.options.min_output_tokens, self.max_length, self.eos_id

    def extend_one(self, token: int, score: float) -> list[int] | None:
        """`_extend` for the one row of a greedy search, without the general path's lists (it runs per request per step)."""
        tokens = self.rows[0]
        if token == self.eos_id:
            self.finished.append((tokens, score, FinishReason.EOS))
        else:
            tokens += (token,)
            if len(tokens) >= self.max_length:
                self.finished.append((tokens, score, FinishReason.LENGTH))
            else:
                self.rows[0], self._row_scores[0], self._next_tokens[0] = tokens, score, token
                return FIRST_ROW
        self.rows, self._row_scores, self._next_tokens, self.done = [], [], [], True
        return None


FIRST_ROW = [0]  # a greedy row always continues its own row 0; shared, never written


def advance_greedy(searchers: Sequence[GreedySearch], log_probs: np.ndarray) -> list[list[int] | None]:
    """advance() of many batchable greedy searchers at once; row i of the (n, V) log-probs is searchers[i]'s row.

    One argmax over all rows replaces n per-request calls (the engine's Python cost per step). The
    result is exactly advance()'s: argmax order of float32 values is unchanged by the float64 row
    score every candidate of a row shares, and ties still go to the lowest token id.
    """
    if not searchers:
        return []
    eos_id = searchers[0].eos_id
    banned = [row for row, searcher in enumerate(searchers) if len(searcher.rows[0]) < searcher.options.min_output_tokens]
    # EOS is banned by setting its column to -inf for the argmax and restoring it: the caller's array
    # is left as it was, without copying all (n, V) of it. Basic indexing (a column view, a slice when
    # every row is banned) and nothing at all when no row is: fewer numpy calls per step.
    eos_column = log_probs[:, eos_id]
    saved = eos_column.copy() if banned else None
    if banned:
        eos_column[banned if len(banned) < len(searchers) else slice(None)] = -np.inf
    try:
        tokens = log_probs.argmax(axis=1)
        picked = log_probs[np.arange(len(searchers)), tokens]
    finally:
        if saved is not None:
            eos_column[:] = saved
    results = []
    for searcher, token, log_prob in zip(searchers, tokens.tolist(), picked.tolist(), strict=True):
        if searcher.done or not searcher.batchable or searcher.eos_id != eos_id:
            raise ValueError("advance_greedy needs live, batchable greedy searchers sharing one eos_id")
        results.append(searcher.extend_one(token, searcher.score + log_prob))
    return results


# Candidates per row a greedy request reads from the decoder's TopK: the best, and the next for when EOS is banned.
GREEDY_CANDIDATES = 2


def advance_greedy_candidates(searchers: Sequence[GreedySearch], log_probs: Sequence[float], token_ids: Sequence[int],
                              stride: int) -> list[list[int] | None]:  # fmt: skip
    """advance_greedy from each row's best log-probs only: flat lists holding, for row i, its `stride` (at least
    GREEDY_CANDIDATES) best values and their token ids from item i * stride, best first, equal values lower id first
    (the decoder graph's TopK, `candidates_needed`). The same results: the first is argmax's choice, and while EOS is
    banned (min_output_tokens) an EOS first gives way to the second, the best of the rest with ties to the lower id as
    argmax breaks them. Plain lists: numpy calls cost several microseconds each right after a decoder call. The caller
    passes live, batchable searchers (the engine checks `batchable` as it picks them)."""
    if stride < GREEDY_CANDIDATES:
        raise ValueError(f"advance_greedy_candidates needs at least {GREEDY_CANDIDATES} candidates per row, got {stride}")
    results = []
    first = 0
    for searcher in searchers:
        token, value = token_ids[first], log_probs[first]
        if token == searcher.eos_id and len(searcher.rows[0]) < searcher.options.min_output_tokens:
            token, value = token_ids[first + 1], log_probs[first + 1]
        results.append(searcher.extend_one(token, searcher.score + value))
        first += stride
    return results


class BeamSearch(Searcher):
    """K rows; 2K candidates per step so finished hypotheses do not starve the beam."""

    def _choose(self, log_probs: np.ndarray) -> list[tuple[int, int, float]]:
        totals = self._processed(log_probs)
        rows, tokens = top_candidates(totals, 2 * self.options.beam_size)
        return self._walk(rows.tolist(), tokens.tolist(), totals[rows, tokens].tolist())

    @property
    def candidates_needed(self) -> int:
        """Per row, how many best log-probs `advance_candidates` needs this step; 0 = it needs `advance`.

        The union of each row's 2K best holds the request's 2K best (a row adds the same score to
        all its tokens), and one more per row covers an EOS the min-length ban removes. Processors
        that edit arbitrary tokens (repetition penalty, n-gram bans) and forced prefixes need all V.
        """
        options = self.options
        if options.repetition_penalty != 1.0 or options.no_repeat_ngram_size > 0 or len(self.rows[0]) < len(options.target_prefix):
            return 0
        return 2 * options.beam_size + (len(self.rows[0]) < options.min_output_tokens)

    def advance_candidates(self, log_probs: np.ndarray | memoryview, token_ids: np.ndarray | memoryview) -> list[int] | None:
        """`advance` from each row's best log-probs only: (k, >= candidates_needed) values and their token
        ids, best first, ties to the lower id (ONNX TopK), as arrays or 2-D memoryviews. Returns exactly what
        `advance` would."""
        if self.done:
            raise RuntimeError("advance_candidates() called on a finished searcher")
        needed = self.candidates_needed
        if needed == 0 or log_probs.shape[0] != len(self.rows) or log_probs.shape[1] < needed:
            raise ValueError(f"need {needed} candidates for each of {len(self.rows)} rows, got {log_probs.shape}")
        ban_eos = len(self.rows[0]) < self.options.min_output_tokens
        if native_beam_select is not None:
            return self._extend(native_beam_select.choose(log_probs, token_ids, array("d", self._row_scores), needed, self.eos_id,
                                                          ban_eos, self.options.beam_size, len(self.finished)))  # fmt: skip
        values, tokens = np.asarray(log_probs)[:, :needed], np.asarray(token_ids)[:, :needed]
        totals = values + self.row_scores[:, None]  # float32 + float64, as _processed adds them
        if ban_eos:
            totals[tokens == self.eos_id] = -np.inf
        rows = candidate_row_numbers(len(self.rows), needed)
        flat_tokens, flat_totals = tokens.ravel(), totals.ravel()
        order = np.lexsort((rows, flat_tokens, -flat_totals))[: 2 * self.options.beam_size]  # as top_candidates orders
        return self._extend(self._walk(rows[order].tolist(), flat_tokens[order].tolist(), flat_totals[order].tolist()))

    def step_state(self) -> tuple[list[tuple[int, ...]], list[float], list[int], list[tuple[tuple[int, ...], float, FinishReason]],
                                  int, int, int, int]:
        """What a compiled steady beam step (runtime/kernels/beam_step.c) reads and, where its choices end nothing, extends
        in place: the rows, score and next-token lists (the same list objects until `take_choices` replaces them), the
        finished hypotheses, then the beam size, `min_output_tokens`, the most tokens a row may have and EOS."""
        return (self.rows, self._row_scores, self._next_tokens, self.finished, self.options.beam_size,
                self.options.min_output_tokens, self.max_length, self.eos_id)  # fmt: skip

    def take_choices(self, choices: list[tuple[int, int, float]]) -> list[int] | None:
        """What `advance_candidates` does with its choices (row, token, total), made elsewhere (a compiled steady beam
        step hands back the requests whose choices end a hypothesis): extend the rows; the local parents, or None once
        done."""
        if self.done:
            raise RuntimeError("take_choices() called on a finished searcher")
        return self._extend(choices)

    def _walk(self, rows: list[int], tokens: list[int], scores: list[float]) -> list[tuple[int, int, float]]:
        """The 2K best candidates, best first -> this step's choices (module docstring: fairseq style)."""
        beam_size = self.options.beam_size
        choices: list[tuple[int, int, float]] = []
        num_eos = num_live = 0
        for rank, (row, token, score) in enumerate(zip(rows, tokens, scores, strict=True)):
            if token == self.eos_id:
                if rank < beam_size and len(self.finished) + num_eos < beam_size:
                    choices.append((row, token, score))
                    num_eos += 1
            elif num_live < beam_size:
                choices.append((row, token, score))
                num_live += 1
        return choices


@functools.cache
def candidate_row_numbers(rows: int, per_row: int) -> np.ndarray:
    """[0] * per_row + [1] * per_row + ... + [rows - 1] * per_row, read-only: the row of each flattened candidate (a beam
    request asks the same shape at every step; two numpy calls fewer per request per step)."""
    numbers = np.repeat(np.arange(rows), per_row)
    numbers.flags.writeable = False
    return numbers


def top_candidates(totals: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, tokens) of the `count` best entries of a (k, V) score array, best first; ties go to the lower token id, then the lower row.

    It reads the row-major array as is (no transposed copy); a partition keeps the cost linear in
    k * V, and every value equal to the cut-off is kept before the final sort, so that ties at
    the boundary still resolve by (token, row).
    """
    flat = totals.ravel()
    count = min(count, flat.size)
    if count < flat.size:
        cutoff = np.partition(flat, flat.size - count)[flat.size - count]
        candidates = np.flatnonzero(flat >= cutoff)
    else:
        candidates = np.arange(flat.size)
    rows, tokens = np.divmod(candidates, totals.shape[1])
    order = np.lexsort((rows, tokens, -flat[candidates]))[:count]  # last key first: score, then token, then row
    return rows[order], tokens[order]


def make_searcher(options: SearchOptions, src_len: int, bos_id: int, eos_id: int, max_positions: int) -> Searcher:
    searcher_class = GreedySearch if options.beam_size == 1 else BeamSearch
    return searcher_class(options, src_len, bos_id, eos_id, max_positions)


# ---------------------------------------------------------------- driver


class Step(Protocol):
    """One decoder step over R rows; the implementation owns the KV cache and encoder outputs."""

    vocab_size: int

    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        """Encode these sources (one per request) and drop all rows."""

    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        """source_index (R,) int64: the request of each row; parent_rows (R,) int64: the row of the
        previous call whose cache this row continues, -1 for a new row at position 0; tgt_ids (R,)
        int64: the token fed (BOS first). Returns log_probs (R, V) float32."""


def run_search(step: Step, src_ids: Sequence[Sequence[int]], searchers: Sequence[Searcher]) -> list[list[Hypothesis]]:
    """Advance all searchers together; each step call covers the live rows of every unfinished request."""
    if not searchers:
        return []
    step.begin(src_ids)
    # Each request starts with one new row fed BOS; rows are concatenated in request order.
    active = [(request, 1) for request in range(len(searchers))]  # (request, rows in the last call)
    source_index = np.arange(len(searchers), dtype=np.int64)
    parent_rows = np.full(len(searchers), -1, dtype=np.int64)
    tgt_ids = np.concatenate([searcher.initial_tokens() for searcher in searchers])
    while active:
        log_probs = step(source_index, parent_rows, tgt_ids)  # (R, V)
        if log_probs.shape != (len(tgt_ids), step.vocab_size):
            raise ValueError(f"step returned shape {log_probs.shape}, expected {(len(tgt_ids), step.vocab_size)}")
        next_active, sources, parents, tokens = [], [], [], []
        offset = 0
        for request, num_rows in active:
            searcher = searchers[request]
            local_parents = searcher.advance(log_probs[offset:offset + num_rows])
            if local_parents is not None:
                next_active.append((request, len(local_parents)))
                sources.append(np.full(len(local_parents), request, dtype=np.int64))
                parents.append(np.asarray(local_parents, dtype=np.int64) + offset)  # local -> global row of this call
                tokens.append(searcher.next_tokens)
            offset += num_rows
        active = next_active
        if active:
            source_index, parent_rows, tgt_ids = map(np.concatenate, (sources, parents, tokens))
    return [searcher.hypotheses() for searcher in searchers]


def generate(step: Step, src_ids: Sequence[Sequence[int]], options: SearchOptions, bos_id: int, eos_id: int,
             max_positions: int) -> list[list[Hypothesis]]:
    """n-best hypotheses for each source, best first."""
    options.validate(max_positions)
    searchers = [make_searcher(options, len(src), bos_id, eos_id, max_positions) for src in src_ids]
    return run_search(step, src_ids, searchers)
