"""Decoding semantics of model/search.py, checked against fake steps that read hand-written log-prob tables."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest

from nmt_serve.model.search import (
    GREEDY_CANDIDATES,
    BeamSearch,
    FinishReason,
    GreedySearch,
    Hypothesis,
    SearchOptions,
    advance_greedy,
    advance_greedy_candidates,
    generate,
    make_searcher,
    run_search,
    top_candidates,
)

BOS, EOS = 0, 1
V = 8  # BOS, EOS and content tokens 2..7
MAX_POSITIONS = 64

History = tuple[int, ...]
Table = Mapping[History, Mapping[int, float]]


def probs(listed: Mapping[int, float]) -> np.ndarray:
    """Listed token probabilities; the rest of the mass spread evenly over the other non-BOS tokens."""
    row = np.zeros(V)
    for token, p in listed.items():
        row[token] = p
    others = [token for token in range(1, V) if token not in listed]
    if others:
        row[others] = (1.0 - sum(listed.values())) / len(others)
    return row


def lp(p: float) -> float:
    """A probability as the float32 log-prob the fake step returns."""
    return float(np.float32(math.log(p)))


DEFAULT = {EOS: 0.1}  # histories missing from a table: unlikely to end, 0.15 on each content token


class TableStep:
    """Log-probs from a per-source table keyed by the row's history; histories follow parent_rows."""

    vocab_size = V

    def __init__(self, tables: Mapping[History, Table]) -> None:
        self.tables = tables
        self.rows_per_call: list[int] = []
        self.sources_per_call: list[list[History]] = []

    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        self.src = [tuple(src) for src in src_ids]
        self.histories: list[History] = []

    def log_probs(self, src: History, history: History) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.log(probs(self.tables[src].get(history, DEFAULT)))

    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        histories = []
        for parent, token in zip(parent_rows.tolist(), tgt_ids.tolist()):
            if parent < 0:
                assert token == BOS, "a new row must be fed BOS"
                histories.append(())
            else:
                histories.append(self.histories[parent] + (token,))
        self.histories = histories
        self.rows_per_call.append(len(histories))
        self.sources_per_call.append([self.src[index] for index in source_index.tolist()])
        rows = [self.log_probs(self.src[index], history) for index, history in zip(source_index.tolist(), histories)]
        return np.array(rows, dtype=np.float32).reshape(len(rows), V)


class RandomStep(TableStep):
    """Log-probs drawn from a generator seeded by (source, history): any table, reproducibly."""

    def __init__(self, seed: int, eos_bias: float = 0.0) -> None:
        super().__init__({})
        self.seed, self.eos_bias = seed, eos_bias

    def log_probs(self, src: History, history: History) -> np.ndarray:
        logits = np.random.default_rng([self.seed, *src, 99, *history]).normal(size=V) * 2
        logits[BOS] = -np.inf
        logits[EOS] += self.eos_bias
        # Quantise so equal log-probs (ties) actually occur.
        logits = np.round(logits, 1)
        return logits - np.log(np.exp(logits).sum())


def decode(table: Table, options: SearchOptions, src: History = (5,)) -> tuple[list[Hypothesis], TableStep]:
    step = TableStep({src: table})
    return generate(step, [src], options, BOS, EOS, MAX_POSITIONS)[0], step


# Short [2] vs long [3, 4, 5]: the short one has the higher raw sum, the long one the higher mean.
LENGTH_TABLE: Table = {
    (): {2: 0.6, 3: 0.3},
    (2,): {EOS: 0.6},
    (3,): {4: 0.9},
    (3, 4): {5: 0.9},
    (3, 4, 5): {EOS: 0.9},
}
SHORT_SUM = lp(0.6) + lp(0.6)
LONG_SUM = lp(0.3) + 3 * lp(0.9)

REPEAT_TABLE: Table = {
    (): {2: 0.9},
    (2,): {3: 0.9},
    (2, 3): {2: 0.9},
    (2, 3, 2): {3: 0.9, 4: 0.06},
    (2, 3, 2, 3): {EOS: 0.9},
    (2, 3, 2, 4): {EOS: 0.9},
}


def test_greedy_eos_at_step_zero_gives_empty_hypothesis() -> None:
    hypotheses, _ = decode({(): {EOS: 0.6}}, SearchOptions())
    assert hypotheses == [Hypothesis((), pytest.approx(lp(0.6)), FinishReason.EOS)]


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_search_eos_at_step_zero_gives_empty_hypothesis(beam_size: int) -> None:
    hypotheses, _ = decode({(): {EOS: 0.6}}, SearchOptions(beam_size=beam_size))
    assert hypotheses[0].token_ids == ()
    assert hypotheses[0].score == pytest.approx(lp(0.6))


def test_options_max_length_is_a_times_src_len_plus_b_clamped_to_positions() -> None:
    assert SearchOptions(max_len_a=1.5, max_len_b=10).max_length(4, 1024) == 16
    assert SearchOptions(max_len_a=1.5, max_len_b=10).max_length(3, 1024) == 14  # int(14.5)
    assert SearchOptions(max_len_a=1.5, max_len_b=10).max_length(100, 32) == 32
    assert SearchOptions(max_output_tokens=5).max_length(100, 1024) == 5
    assert SearchOptions(max_output_tokens=500).max_length(1, 32) == 32
    assert SearchOptions(max_len_a=0.0, max_len_b=0).max_length(0, 32) == 1


@pytest.mark.parametrize("beam_size", [1, 2])
@pytest.mark.parametrize(("src", "max_positions", "expected_length"), [((5, 5, 5), 64, 5), ((5, 5, 5), 3, 3)])
def test_search_stops_at_max_length_with_length_reason(
        beam_size: int, src: History, max_positions: int, expected_length: int) -> None:
    never_ends = {(): {EOS: 0.0, 2: 0.9}, (2,): {EOS: 0.0, 2: 0.9}, (2, 2): {EOS: 0.0, 2: 0.9},
                  (2, 2, 2): {EOS: 0.0, 2: 0.9}, (2, 2, 2, 2): {EOS: 0.0, 2: 0.9}}
    options = SearchOptions(beam_size=beam_size, max_len_a=1.0, max_len_b=2, length_penalty=0.0)
    step = TableStep({src: never_ends})
    [[best, *_]] = generate(step, [src], options, BOS, EOS, max_positions)
    assert best.token_ids == (2,) * expected_length
    assert best.finish_reason is FinishReason.LENGTH
    assert best.score == pytest.approx(expected_length * lp(0.9))  # no EOS appended or scored
    assert len(step.rows_per_call) == expected_length  # BOS + L-1 fed tokens: positions < max_positions


@pytest.mark.parametrize(("length_penalty", "expected"), [
    (0.0, Hypothesis((2,), pytest.approx(SHORT_SUM), FinishReason.EOS)),
    (1.0, Hypothesis((3, 4, 5), pytest.approx(LONG_SUM / 4), FinishReason.EOS)),
])
def test_beam_length_penalty_picks_short_or_long(length_penalty: float, expected: Hypothesis) -> None:
    hypotheses, step = decode(LENGTH_TABLE, SearchOptions(beam_size=2, length_penalty=length_penalty))
    assert hypotheses == [expected]
    assert step.rows_per_call == [1, 2, 2, 2]  # one row at step 0: no duplicate beams


def test_beam_returns_n_best_in_score_order() -> None:
    hypotheses, _ = decode(LENGTH_TABLE, SearchOptions(beam_size=2, num_hypotheses=2, length_penalty=1.0))
    assert hypotheses == [
        Hypothesis((3, 4, 5), pytest.approx(LONG_SUM / 4), FinishReason.EOS),
        Hypothesis((2,), pytest.approx(SHORT_SUM / 2), FinishReason.EOS),
    ]


def test_greedy_without_ngram_ban_repeats() -> None:
    hypotheses, _ = decode(REPEAT_TABLE, SearchOptions())
    assert hypotheses[0].token_ids == (2, 3, 2, 3)


def test_greedy_no_repeat_ngram_bans_completing_a_seen_bigram() -> None:
    hypotheses, _ = decode(REPEAT_TABLE, SearchOptions(no_repeat_ngram_size=2))
    assert hypotheses == [Hypothesis((2, 3, 2, 4), pytest.approx((4 * lp(0.9) + lp(0.06)) / 5), FinishReason.EOS)]


def test_greedy_repetition_penalty_multiplies_seen_log_probs() -> None:
    table = {(): {2: 0.5, 3: 0.4}, (2,): {2: 0.5, 4: 0.3}, (2, 2): {EOS: 0.9}, (2, 4): {EOS: 0.9}}
    assert decode(table, SearchOptions())[0][0].token_ids == (2, 2)
    hypotheses, _ = decode(table, SearchOptions(repetition_penalty=2.0))  # 2 * log 0.5 = log 0.25 < log 0.3
    assert hypotheses == [Hypothesis((2, 4), pytest.approx((lp(0.5) + lp(0.3) + lp(0.9)) / 3), FinishReason.EOS)]


def test_greedy_min_output_tokens_bans_eos_until_reached() -> None:
    table = {(): {EOS: 0.5, 2: 0.3}, (2,): {EOS: 0.6, 3: 0.3}, (2, 3): {EOS: 0.9}}
    assert decode(table, SearchOptions())[0][0].token_ids == ()
    hypotheses, _ = decode(table, SearchOptions(min_output_tokens=2))
    assert hypotheses == [Hypothesis((2, 3), pytest.approx((2 * lp(0.3) + lp(0.9)) / 3), FinishReason.EOS)]


PREFIX_TABLE: Table = {
    (): {2: 0.9, 4: 0.05},
    (4,): {5: 0.1},
    (4, 5): {6: 0.7, EOS: 0.2},
    (4, 5, 6): {EOS: 0.8},
}
PREFIX_SUM = lp(0.05) + lp(0.1)


def test_greedy_target_prefix_is_forced_and_scored() -> None:
    hypotheses, _ = decode(PREFIX_TABLE, SearchOptions(target_prefix=(4, 5)))
    assert hypotheses == [Hypothesis((4, 5, 6), pytest.approx((PREFIX_SUM + lp(0.7) + lp(0.8)) / 4), FinishReason.EOS)]


def test_beam_target_prefix_keeps_one_row_then_expands() -> None:
    options = SearchOptions(beam_size=2, num_hypotheses=2, target_prefix=(4, 5))
    hypotheses, step = decode(PREFIX_TABLE, options)
    assert hypotheses == [
        Hypothesis((4, 5, 6), pytest.approx((PREFIX_SUM + lp(0.7) + lp(0.8)) / 4), FinishReason.EOS),
        Hypothesis((4, 5), pytest.approx((PREFIX_SUM + lp(0.2)) / 3), FinishReason.EOS),
    ]
    assert step.rows_per_call == [1, 1, 1, 2]


def test_search_target_prefix_reaching_max_length_finishes_with_length() -> None:
    hypotheses, _ = decode(PREFIX_TABLE, SearchOptions(beam_size=2, target_prefix=(4, 5), max_output_tokens=2))
    assert hypotheses == [Hypothesis((4, 5), pytest.approx(PREFIX_SUM / 2), FinishReason.LENGTH)]


def test_greedy_tie_goes_to_lower_token_id() -> None:
    hypotheses, _ = decode({(): {3: 0.4, 2: 0.4}, (2,): {EOS: 1.0}, (3,): {EOS: 1.0}}, SearchOptions())
    assert hypotheses[0].token_ids == (2,)


def test_beam_tie_goes_to_lower_token_then_lower_parent_row() -> None:
    # Rows [2] and [3] score the same, and so do all four of their continuations.
    table = {(): {2: 0.4, 3: 0.4}, (2,): {4: 0.5, 5: 0.5}, (3,): {4: 0.5, 5: 0.5},
             (2, 4): {EOS: 1.0}, (3, 4): {EOS: 1.0}, (2, 5): {EOS: 1.0}, (3, 5): {EOS: 1.0}}
    options = SearchOptions(beam_size=2, num_hypotheses=2)
    first, _ = decode(table, options)
    again, _ = decode(table, options)
    expected_score = pytest.approx((lp(0.4) + lp(0.5) + lp(1.0)) / 3)
    assert first == again == [Hypothesis((2, 4), expected_score, FinishReason.EOS),
                              Hypothesis((3, 4), expected_score, FinishReason.EOS)]


def test_top_candidates_keeps_ties_at_the_cutoff_in_token_then_row_order() -> None:
    totals = np.array([[0.5, 0.9, 0.5], [0.5, -np.inf, 0.9]])  # k=2 rows, V=3 tokens
    rows, tokens = top_candidates(totals, 3)
    assert list(zip(rows.tolist(), tokens.tolist())) == [(0, 1), (1, 2), (0, 0)]  # 0.9 (token 1) before 0.9 (token 2); 0.5s by token, then row
    rows, tokens = top_candidates(totals, 10)
    assert list(zip(rows.tolist(), tokens.tolist())) == [(0, 1), (1, 2), (0, 0), (1, 0), (0, 2), (1, 1)]



BEAM_ONE_OPTIONS = [
    SearchOptions(),
    SearchOptions(length_penalty=0.0, max_output_tokens=6),
    SearchOptions(repetition_penalty=1.7, no_repeat_ngram_size=2),
    SearchOptions(min_output_tokens=4, no_repeat_ngram_size=1),
    SearchOptions(target_prefix=(3, 3), repetition_penalty=0.8, min_output_tokens=3),
]


@pytest.mark.parametrize("options", BEAM_ONE_OPTIONS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_size_one_equals_greedy(options: SearchOptions, seed: int) -> None:
    srcs = [(2,), (3, 4, 5), (6, 7, 2, 3, 4, 5, 6)]
    results = []
    for searcher_class in (GreedySearch, BeamSearch):
        searchers = [searcher_class(options, len(src), BOS, EOS, MAX_POSITIONS) for src in srcs]
        results.append(run_search(RandomStep(seed, eos_bias=0.5), srcs, searchers))
    assert results[0] == results[1]


@pytest.mark.parametrize("table", [LENGTH_TABLE, REPEAT_TABLE, PREFIX_TABLE])
def test_beam_size_one_equals_greedy_on_tables(table: Table) -> None:
    options = SearchOptions(no_repeat_ngram_size=2)
    greedy = run_search(TableStep({(5,): table}), [(5,)], [GreedySearch(options, 1, BOS, EOS, MAX_POSITIONS)])
    beam = run_search(TableStep({(5,): table}), [(5,)], [BeamSearch(options, 1, BOS, EOS, MAX_POSITIONS)])
    assert greedy == beam


@pytest.mark.parametrize("beam_size", [1, 3])
def test_generate_batched_requests_match_each_request_alone(beam_size: int) -> None:
    srcs = [(2,), (3, 4, 5, 6), (7, 2, 3, 4, 5, 6, 7, 2)]  # max lengths 2, 5, 9
    options = SearchOptions(beam_size=beam_size, num_hypotheses=beam_size, max_len_a=1.0, max_len_b=1)
    step = RandomStep(seed=2, eos_bias=-1.0)
    batched = generate(step, srcs, options, BOS, EOS, MAX_POSITIONS)
    alone = [generate(RandomStep(seed=2, eos_bias=-1.0), [src], options, BOS, EOS, MAX_POSITIONS)[0] for src in srcs]
    assert batched == alone
    # This seed makes the longest source end on EOS before the middle one hits its max length,
    # so rows leave the batch out of request order.
    last_call = [max(i for i, sources in enumerate(step.sources_per_call) if src in sources) for src in srcs]
    assert last_call == [1, 4, 3]
    assert batched[2][0].finish_reason is FinishReason.EOS


def test_generate_without_sources_returns_empty() -> None:
    assert generate(RandomStep(seed=0), [], SearchOptions(), BOS, EOS, MAX_POSITIONS) == []


@pytest.mark.parametrize(("fields", "match"), [
    ({"beam_size": 0}, r"beam_size must be between 1 and 16, got 0"),
    ({"beam_size": 10**6}, r"beam_size must be between 1 and 16, got 1000000"),
    ({"beam_size": 2, "num_hypotheses": 3}, r"num_hypotheses must be between 1 and 2, got 3"),
    ({"max_output_tokens": -1}, r"max_output_tokens must be at least 1, got -1"),
    ({"min_output_tokens": -1}, r"min_output_tokens must be between 0 and 63, got -1"),
    ({"max_output_tokens": 3, "min_output_tokens": 4}, r"min_output_tokens must be at most max_output_tokens"),
    ({"max_len_a": -0.5}, r"max_len_a must be a finite number between 0 and 100, got -0.5"),
    ({"max_len_b": -1}, r"max_len_b must be at least 0, got -1"),
    ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size must be between 0 and 64, got -1"),
    ({"length_penalty": math.nan}, r"length_penalty must be a finite number between 0 and 10, got nan"),
    ({"length_penalty": math.inf}, r"length_penalty must be a finite number between 0 and 10, got inf"),
    ({"repetition_penalty": math.nan}, r"repetition_penalty must be a finite number .*, got nan"),
    ({"repetition_penalty": -math.inf}, r"repetition_penalty must be a finite number .*, got -inf"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number between 0.01 and 10, got 0.0"),
    ({"target_prefix": (2,) * 64}, r"target_prefix must have fewer than 64 tokens, got 64"),
    ({"target_prefix": (2, -1)}, r"target_prefix must hold token ids >= 0"),
])
def test_options_validate_rejects(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SearchOptions(**fields).validate(MAX_POSITIONS)


def test_options_validate_collects_all_problems() -> None:
    with pytest.raises(ValueError, match=r"beam_size must .*; length_penalty must .*; max_len_b must"):
        SearchOptions(beam_size=0, length_penalty=math.nan, max_len_b=-1).validate(MAX_POSITIONS)


def test_options_validate_accepts_defaults_and_clamps_long_max_output() -> None:
    SearchOptions().validate(MAX_POSITIONS)
    SearchOptions(beam_size=16, num_hypotheses=16, max_output_tokens=10**6).validate(MAX_POSITIONS)


def test_generate_rejects_invalid_options_before_stepping() -> None:
    step = RandomStep(seed=0)
    with pytest.raises(ValueError, match="beam_size"):
        generate(step, [(2,)], SearchOptions(beam_size=0), BOS, EOS, MAX_POSITIONS)
    assert step.rows_per_call == []


def test_searcher_rejects_eos_in_target_prefix() -> None:
    with pytest.raises(ValueError, match="target_prefix must not contain eos_id 1"):
        GreedySearch(SearchOptions(target_prefix=(2, EOS)), 3, BOS, EOS, MAX_POSITIONS)


def advance_by_argmax(searchers: list[GreedySearch], log_probs: np.ndarray) -> list[np.ndarray | None]:
    return advance_greedy(searchers, log_probs)


def advance_by_candidates(extra: int) -> Callable[[list[GreedySearch], np.ndarray], list[np.ndarray | None]]:
    """From each row's best GREEDY_CANDIDATES log-probs in ONNX TopK's order and `extra` more (the engine hands over
    more when beam requests share the call)."""

    def advance(searchers: list[GreedySearch], log_probs: np.ndarray) -> list[np.ndarray | None]:
        values, ids = onnx_top_k(log_probs, GREEDY_CANDIDATES + extra)
        return advance_greedy_candidates(searchers, values.ravel().tolist(), ids.ravel().tolist(), GREEDY_CANDIDATES + extra)

    return advance


@pytest.mark.parametrize("advance_together", [advance_by_argmax, advance_by_candidates(0), advance_by_candidates(3)],
                         ids=["argmax", "candidates", "more-candidates"])  # fmt: skip
def test_greedy_requests_advanced_together_equal_each_advance_alone(advance_together: Callable) -> None:
    """Greedy requests advanced together, by one argmax over their rows or from their rows' best log-probs only, make
    advance()'s choices from all V: EOS banned by min_output_tokens and ranked first gives way to the next, exact
    ties go to the lower id, EOS and max length finish, and the scores are the same floats."""
    rng = np.random.default_rng(11)
    options = [SearchOptions(max_output_tokens=9, min_output_tokens=4), SearchOptions(max_output_tokens=3),
               SearchOptions(max_output_tokens=12), SearchOptions(max_output_tokens=12, min_output_tokens=12)]  # fmt: skip
    alone = [make_searcher(o, 5, BOS, EOS, 64) for o in options]
    together = copy.deepcopy(alone)
    banned_eos_first = 0
    for _ in range(14):
        live = [i for i, searcher in enumerate(alone) if not searcher.done]
        if not live:
            break
        log_probs = np.log(rng.dirichlet(np.ones(16), size=len(options))).astype(np.float32)
        log_probs[:, EOS] += 1.5  # EOS often best, so the min-length ban and finishing both happen
        log_probs[:, 5] = log_probs[:, 6] = log_probs.max(axis=1)  # exact ties: the lower id must win
        log_probs[:, EOS] = np.where(rng.random(len(options)) < 0.5, log_probs[:, 5], log_probs[:, EOS])  # EOS tied for best too
        banned_eos_first += sum(len(alone[i].rows[0]) < options[i].min_output_tokens and log_probs[i].argmax() == EOS for i in live)
        expected = [alone[i].advance(log_probs[i : i + 1]) for i in live]
        got = advance_together([together[i] for i in live], log_probs[live])
        assert [None if e is None else list(e) for e in expected] == [None if g is None else list(g) for g in got]
        assert [alone[i].rows for i in live] == [together[i].rows for i in live]
        assert [alone[i].row_scores.tolist() for i in live] == [together[i].row_scores.tolist() for i in live]
        assert [alone[i].next_tokens.tolist() for i in live] == [together[i].next_tokens.tolist() for i in live]
    assert banned_eos_first > 0  # the ban changed a choice
    assert all(s.done for s in alone) and [s.hypotheses() for s in alone] == [s.hypotheses() for s in together]


def test_advance_greedy_refuses_searchers_it_cannot_batch() -> None:
    penalised = make_searcher(SearchOptions(repetition_penalty=1.5), 5, BOS, EOS, 64)
    with pytest.raises(ValueError, match="batchable"):
        advance_greedy([penalised], np.zeros((1, 16), dtype=np.float32))


@pytest.mark.parametrize("seed", range(20))
def test_top_candidates_equals_a_full_sort(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, vocab = int(rng.integers(1, 6)), int(rng.integers(2, 40))
    totals = np.round(rng.normal(size=(k, vocab)), 1)  # coarse values: many ties, also at the cut-off
    totals[rng.random((k, vocab)) < 0.1] = -np.inf
    count = int(rng.integers(1, 2 * k * vocab))
    expected = sorted(((row, token) for row in range(k) for token in range(vocab)), key=lambda rt: (-totals[rt], rt[1], rt[0]))[:count]
    rows, tokens = top_candidates(totals, count)
    assert list(zip(rows.tolist(), tokens.tolist(), strict=True)) == expected


def onnx_top_k(log_probs: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """What ONNX TopK(largest, sorted) returns per row: best first, equal values to the lower index."""
    ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :count]
    return np.take_along_axis(log_probs, ids, axis=1), ids


@pytest.mark.parametrize("beam_size", [2, 4, 5])
def test_beam_advance_from_candidates_equals_advance_from_all_log_probs(beam_size: int) -> None:
    rng = np.random.default_rng(beam_size)
    options = SearchOptions(beam_size=beam_size, num_hypotheses=2, max_output_tokens=12, min_output_tokens=3)
    full = make_searcher(options, 5, BOS, EOS, 64)
    from_candidates = copy.deepcopy(full)
    while not full.done:
        rows = len(full.rows)
        log_probs = np.log(rng.dirichlet(np.full(16, 0.3), size=rows)).astype(np.float32)
        log_probs[:, EOS] += 1.0  # EOS often among the best, so the min-length ban and finishing both happen
        log_probs[:, 7] = log_probs[:, 9] = log_probs.max(axis=1)  # exact ties inside a row: the lower id first
        if rows > 1:
            log_probs[1] = log_probs[0]  # identical rows: ties across rows go by token, then row
        needed = from_candidates.candidates_needed  # type: ignore[attr-defined]
        assert needed == 2 * beam_size + (len(full.rows[0]) < options.min_output_tokens)
        values, ids = onnx_top_k(log_probs, needed + 1)  # the engine may hand over more than needed
        expected = full.advance(log_probs)
        got = from_candidates.advance_candidates(values, ids)  # type: ignore[attr-defined]
        assert (expected is None) == (got is None)
        if expected is not None:
            assert list(expected) == list(got)
        assert full.rows == from_candidates.rows and full.row_scores.tolist() == from_candidates.row_scores.tolist()
    assert from_candidates.done and full.hypotheses() == from_candidates.hypotheses()


@pytest.mark.parametrize("options", [SearchOptions(beam_size=4, repetition_penalty=1.2), SearchOptions(beam_size=4, no_repeat_ngram_size=2),
                                     SearchOptions(beam_size=4, target_prefix=(5,))])  # fmt: skip
def test_beam_needs_all_log_probs_when_a_processor_edits_any_token_or_a_prefix_is_forced(options: SearchOptions) -> None:
    searcher = make_searcher(options, 5, BOS, EOS, 64)
    assert searcher.candidates_needed == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="need 0 candidates"):
        searcher.advance_candidates(np.zeros((1, 8), dtype=np.float32), np.zeros((1, 8), dtype=np.int64))  # type: ignore[attr-defined]
