"""The compiled steady beam step (runtime/kernels/beam_step.c, built by runtime/build_extensions.py) against the Python
path it stands in for: the same places, moves, stores, choices and hand-backs, alone on random caches and candidate
tables, and through the engine on the tiny model."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from nmt_serve.model.search import BeamSearch, Hypothesis, SearchOptions
from nmt_serve.runtime.step_cache import StepCache
from nmt_serve.server.engine import engine as engine_module
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import Outcome
from nmt_serve.server.engine.row_placement import place_rows_list
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from tests.engine_plans import run_plan
from tests.extensions import compiled_extension

EOS, BOS, VOCAB, CAPACITY = 2, 1, 40, 24
TENSORS, HEADS, HEAD_DIM = 3, 2, 4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compiled_extension("beam_step", tmp_path_factory.mktemp("beam_step"))  # type: ignore[return-value]


class CandidateTables:
    """Stands in for the decoder's run: records the tokens fed and the candidate rows named, then writes a random
    candidate table (distinct ids per row, best first, EOS often among the first) into the bound candidate buffers."""

    def __init__(self, rng: np.random.Generator, buffers: dict[str, np.ndarray], stride: int) -> None:
        self.rng, self.buffers, self.stride = rng, buffers, stride
        self.rows = 0
        self.fed: list[int] = []
        self.named: list[int] = []

    def __call__(self, binding: object) -> None:
        assert binding == "binding"
        self.fed = self.buffers["tgt_ids"][: self.rows, 0].tolist()
        self.named = self.buffers["candidate_rows"][: self.rows].tolist()
        for row in range(self.rows):
            tokens = self.rng.choice(np.arange(3, VOCAB), size=self.stride, replace=False)
            if self.rng.random() < 0.25:
                tokens[int(self.rng.integers(0, 3))] = EOS
            values = np.sort(self.rng.standard_normal(self.stride).astype(np.float32))[::-1]
            if self.rng.random() < 0.2:
                values[1] = values[0]  # a tie: the lower token id goes first
                tokens[:2] = np.sort(tokens[:2])
            self.buffers["ids"][row * self.stride : (row + 1) * self.stride] = tokens
            self.buffers["values"][row * self.stride : (row + 1) * self.stride] = values


def started_searchers(rng: np.random.Generator) -> list[BeamSearch]:
    """Beam searches of different widths, bans and lengths, each past its first step (as many rows as its beam)."""
    limits = ((4, 0, 30), (2, 6, 30), (3, 0, 5), (4, 9, 12), (5, 0, 30))  # (beam, min_output_tokens, max_output_tokens)
    searchers = []
    for beam, minimum, most in limits:
        searcher = BeamSearch(SearchOptions(beam_size=beam, min_output_tokens=minimum, max_output_tokens=most), 4, BOS, EOS, 64)
        first = rng.standard_normal((1, VOCAB)).astype(np.float32)
        first[0, EOS] = -50.0  # no hypothesis ends at the first step
        searcher.advance(first)
        searchers.append(searcher)
    return searchers


def expected_cache(block: np.ndarray, lineage: np.ndarray, moves: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """The cache after the moves (row, from row, length), as StepCache._copy_rows makes them: each row takes the other's
    slots from the first whose lineage number differs (0 differs from everything)."""
    block, lineage, copied = block.copy(), lineage.copy(), 0
    for row, origin, length in moves:
        first = 0
        while first < length and lineage[origin, first] != 0 and lineage[row, first] == lineage[origin, first]:
            first += 1
        block[:, row, :, first:length] = block[:, origin, :, first:length]
        lineage[row, first:length] = lineage[origin, first:length]
        copied += length - first
    return block, lineage, copied


def test_compiled_steps_lay_out_copy_choose_and_hand_back_as_python_does(compiled: ModuleType) -> None:
    """Random caches, places and candidate tables over several steps: the compiled step places each request's rows as
    place_rows_list does, copies the moved rows' slots as StepCache._copy_rows does, feeds each row its token, names the
    candidate rows, numbers the slots and advances the positions; each searcher ends as `advance_candidates` leaves a
    copy of it, extended in place or handed back with the choices that `take_choices` then takes."""
    rng = np.random.default_rng(1)
    searchers = started_searchers(rng)
    stride = max(2 * searcher.options.beam_size + 1 for searcher in searchers)
    capacity_rows = sum(searcher.options.beam_size for searcher in searchers)
    buffers = {"tgt_ids": np.zeros((capacity_rows, 1), np.int64), "candidate_rows": np.zeros(capacity_rows, np.int64),
               "values": np.zeros(capacity_rows * stride, np.float32), "ids": np.zeros(capacity_rows * stride, np.int64)}  # fmt: skip
    tables = CandidateTables(rng, buffers, stride)
    handed_back = in_place = 0
    for step in range(12):
        live = [searcher for searcher in searchers if not searcher.done]
        if not live:
            break
        widths = [len(searcher.rows) for searcher in live]
        rows = tables.rows = sum(widths)
        places = rng.permutation(rows).tolist()  # each request's places in the last call, anywhere in it
        row_ids = [places[first : first + width] for first, width in zip(np.cumsum([0, *widths[:-1]]).tolist(), widths, strict=True)]
        parents = [[int(rng.integers(0, width)) for _ in range(width)] for width in widths]
        positions = np.zeros(capacity_rows, np.int64)
        for held, searcher in zip(row_ids, live, strict=True):
            positions[held] = len(searcher.rows[0]) + 1 + rng.integers(0, 3, size=len(held))  # a moved row takes its parent's
        block = rng.standard_normal((TENSORS, capacity_rows, HEADS, CAPACITY, HEAD_DIM)).astype(np.float32)
        lineage = rng.integers(0, 3, size=(capacity_rows, CAPACITY)).astype(np.int64)  # equal numbers now and then
        # The reference: the engine's placement over the same places and parents, and the moves it implies.
        origin = [held[parent] for held, request_parents in zip(row_ids, parents, strict=True) for parent in request_parents]
        place = place_rows_list(origin, [(width, held) for width, held in zip(widths, row_ids, strict=True)])
        moves = [(row, from_row, int(positions[from_row])) for row, from_row in zip(place, origin, strict=True) if row != from_row]
        want_block, want_lineage, want_copied = expected_cache(block, lineage, moves)
        want_positions = positions.copy()
        for row, from_row, _ in moves:
            want_positions[row] = positions[from_row]
        fed_before = [token for searcher in live for token in searcher.next_token_list]
        references = copy.deepcopy(live)
        states = [(held, request_parents, *searcher.step_state())
                  for held, request_parents, searcher in zip(row_ids, parents, live, strict=True)]  # fmt: skip
        copied, handed = compiled.step(tables, "binding", block, lineage, buffers["tgt_ids"], positions, 1000 * step,
                                       buffers["candidate_rows"], buffers["values"], buffers["ids"], stride, states)  # fmt: skip
        # The layout.
        assert [row for held in row_ids for row in held] == place  # each request's list now holds its new places
        assert tables.named == place
        assert [tables.fed[row] for row in place] == fed_before
        assert copied == want_copied
        want_lineage[range(rows), want_positions[:rows]] = 1000 * step + np.arange(rows)
        assert np.array_equal(lineage, want_lineage) and np.array_equal(block, want_block)
        assert np.array_equal(positions[:rows], want_positions[:rows] + 1)
        # The choices.
        handed_choices = dict(handed)
        first = 0
        for index, (searcher, reference, width) in enumerate(zip(live, references, widths, strict=True)):
            span = slice(first * stride, (first + width) * stride)
            values = buffers["values"][span].reshape(width, stride)
            ids = buffers["ids"][span].reshape(width, stride)
            want_parents = reference.advance_candidates(values, ids)
            if index in handed_choices:
                handed_back += 1
                assert searcher.take_choices(handed_choices[index]) == want_parents
            else:
                in_place += 1
                assert states[index][1] == want_parents
            assert (searcher.rows, searcher.row_scores.tolist(), searcher.next_token_list, searcher.finished, searcher.done) == (
                reference.rows, reference.row_scores.tolist(), reference.next_token_list, reference.finished, reference.done)
            first += width
    assert handed_back >= 5 and in_place >= 10  # both kinds of step met
    reasons = {reason.name for searcher in searchers for _, _, reason in searcher.finished}
    assert reasons == {"EOS", "LENGTH"}


def test_the_compiled_step_refuses_what_it_cannot_run_and_changes_nothing(compiled: ModuleType) -> None:
    calls: list[object] = []
    searcher = started_searchers(np.random.default_rng(2))[1]  # a beam of 2, EOS banned: 5 candidates per row
    block = np.ones((TENSORS, 4, HEADS, CAPACITY, HEAD_DIM), np.float32)
    lineage, positions = np.zeros((4, CAPACITY), np.int64), np.ones(4, np.int64)

    def step(row_ids: list[int], parents: list[int], stride: int = 5, state: tuple[object, ...] | None = None) -> object:
        buffers = (block, lineage, np.zeros((4, 1), np.int64), positions, 7, np.zeros(4, np.int64), np.zeros(4 * stride, np.float32),
                   np.zeros(4 * stride, np.int64))  # fmt: skip
        return compiled.step(calls.append, "binding", *buffers, stride, [state or (row_ids, parents, *searcher.step_state())])

    with pytest.raises(ValueError, match="place 1, parent 0: each of the 2 places must be held once"):
        step([1, 1], [0, 0])
    with pytest.raises(ValueError, match="place 0, parent 2"):
        step([1, 0], [0, 2])
    with pytest.raises(ValueError, match="needs 5 candidates per row; the call has 4"):
        step([0, 1], [0, 0], stride=4)
    with pytest.raises(ValueError, match="one length, at least 1"):
        step([0, 1, 2], [0, 0, 0])
    with pytest.raises(TypeError, match="request 0 must be a tuple"):
        step([0, 1], [0, 0], state=([0, 1], [0, 0]))
    positions[1] = CAPACITY
    with pytest.raises(ValueError, match=f"row 1 is at position {CAPACITY}, outside the cache's {CAPACITY} slots"):
        step([0, 1], [1, 1])
    assert not calls
    assert (block == 1).all() and not lineage.any()


def test_engine_steps_compiled_and_in_python_give_the_same_translations(tiny_model_dir: Path, compiled: ModuleType,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Beam requests of different widths joining at different steps, EOS banned for a while in some, one cancelled,
    one in a prefix first: the same hypotheses, scores, outcomes, step counts and slots copied with the compiled steady
    beam step as with the Python path."""
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))
    sources = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23], [24, 25, 26, 27]]
    limits = ((4, 0, 14), (3, 3, 20), (2, 9, 12), (4, 0, 6), (5, 5, 25), (3, 0, 30))  # (beam, min, max output tokens)
    options = [SearchOptions(beam_size=beam, min_output_tokens=minimum, max_output_tokens=most, num_hypotheses=beam)
               for beam, minimum, most in limits]  # fmt: skip
    options[5] = SearchOptions(beam_size=3, max_output_tokens=30, target_prefix=(7, 8, 9))
    plan = [(arrival, source, option) for arrival, source, option in zip((0, 0, 2, 5, 5, 11), sources, options, strict=True)]
    profiles = []
    real_init = Engine.__init__

    def recording_init(engine: Engine, *args: object, **kwargs: object) -> None:
        real_init(engine, *args, **kwargs)  # type: ignore[arg-type]
        profiles.append(engine.profile)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    monkeypatch.setattr(engine_module, "native_beam_step", None)
    in_python = run_plan(runtime, plan, cancel_at=7)
    handed: list[int] = []

    class Recording:
        """The compiled step, recording how many requests each call handed back."""

        @staticmethod
        def step(*args: object) -> object:
            result = compiled.step(*args)
            handed.append(len(result[1]))
            return result

    monkeypatch.setattr(engine_module, "native_beam_step", Recording)
    in_c = run_plan(runtime, plan, cancel_at=7)
    assert len(handed) >= 20 and sum(handed) >= 3  # steady stretches, and requests handed back from them
    assert in_c[1].outcome is Outcome.CANCELLED
    for python_job, c_job in zip(in_python, in_c, strict=True):
        assert (c_job.outcome, c_job.steps) == (python_job.outcome, python_job.steps)
        assert [(hypothesis.token_ids, hypothesis.score, hypothesis.finish_reason) for hypothesis in c_job.hypotheses] == [
            (hypothesis.token_ids, hypothesis.score, hypothesis.finish_reason) for hypothesis in python_job.hypotheses]  # fmt: skip
    assert profiles[0].slots_copied == profiles[1].slots_copied > 0


def test_engine_out_of_memory_on_a_compiled_beam_step_sheds_one_and_the_others_equal_alone(
        tiny_model_dir: Path, compiled: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoder call of a compiled steady beam step fails for memory: the request holding the most cache leaves with
    OUT_OF_MEMORY, its slot numbers stay taken, and the retried call keeps the others on the results they get alone."""
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))
    monkeypatch.setattr(engine_module, "native_beam_step", compiled)
    kept = [(SearchOptions(beam_size=3, min_output_tokens=8, max_output_tokens=8), [5, 6, 7]),
            (SearchOptions(beam_size=2, max_output_tokens=10), [10, 11, 12, 13])]  # fmt: skip
    largest = SearchOptions(beam_size=4, min_output_tokens=20, max_output_tokens=20)

    def alone(options: SearchOptions, source: list[int]) -> list[Hypothesis]:
        engine = Engine(runtime)
        job = engine.submit(source, options)
        engine.run_until_idle()
        return job.hypotheses

    expected = [alone(options, source) for options, source in kept]
    real_args = StepCache.start_beam_step
    state = {"compiled_steps": 0, "failed": 0}

    def start_beam_step(cache: StepCache) -> tuple[object, ...] | None:
        args = real_args(cache)
        if args is None:
            return None
        state["compiled_steps"] += 1
        if state["compiled_steps"] != 3:
            return args

        def run_out_of_memory(binding: object) -> None:
            state["failed"] += 1
            state["numbers_taken"] = cache._next_slot_id == args[6] + cache.rows  # type: ignore[operator]
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer")

        return (run_out_of_memory, *args[1:])

    monkeypatch.setattr(StepCache, "start_beam_step", start_beam_step)
    engine = Engine(runtime)
    jobs = [engine.submit([15, 16, 17, 18, 19], largest), *(engine.submit(source, options) for options, source in kept)]
    engine.run_until_idle()
    assert state["failed"] == 1 and state["numbers_taken"]
    assert jobs[0].outcome is Outcome.OUT_OF_MEMORY
    assert state["compiled_steps"] > 4  # steady steps compiled again after the retry
    for job, want in zip(jobs[1:], expected, strict=True):
        assert job.outcome is Outcome.OK
        assert [hypothesis.token_ids for hypothesis in job.hypotheses] == [hypothesis.token_ids for hypothesis in want]
        assert [hypothesis.score for hypothesis in job.hypotheses] == pytest.approx([hypothesis.score for hypothesis in want], abs=1e-4)


def test_a_streaming_beam_request_gets_the_same_tokens_after_compiled_steps(tiny_model_dir: Path, compiled: ModuleType,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A callback per step: after a compiled steady beam step each request's callback gets its rows' next tokens, in
    request order, as the Python path calls it."""
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))
    plan = [([5, 6, 7], SearchOptions(beam_size=3, min_output_tokens=9, max_output_tokens=9)),
            ([8, 9, 10, 11], SearchOptions(beam_size=2, max_output_tokens=12))]  # fmt: skip

    def streamed(beam_step: object) -> list[tuple[int, list[int]]]:
        monkeypatch.setattr(engine_module, "native_beam_step", beam_step)
        calls: list[tuple[int, list[int]]] = []
        engine = Engine(runtime)
        for index, (source, options) in enumerate(plan):
            engine.submit(source, options, on_tokens=lambda job, tokens, index=index: calls.append((index, tokens.tolist())))
        engine.run_until_idle()
        return calls

    compiled_steps: list[int] = []

    class Counting:
        @staticmethod
        def step(*args: object) -> object:
            compiled_steps.append(1)
            return compiled.step(*args)

    in_python = streamed(None)
    assert streamed(Counting) == in_python
    assert len(compiled_steps) >= 5 and len(in_python) >= 15
