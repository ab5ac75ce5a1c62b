"""The compiled steady greedy step (runtime/kernels/greedy_step.c, built by runtime/build_extensions.py) against the
Python path it stands in for: the same stores, choices, scores and endings, alone on random candidate tables and
through the engine on the tiny model."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from nmt_serve.model.search import GreedySearch, SearchOptions, advance_greedy_candidates
from nmt_serve.runtime.step_cache import StepCache
from nmt_serve.server.engine import engine as engine_module
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from tests.engine_plans import run_plan
from tests.extensions import compiled_extension

EOS, BOS, STRIDE, CAPACITY = 2, 1, 3, 12


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compiled_extension("greedy_step", tmp_path_factory.mktemp("greedy_step"))  # type: ignore[return-value]


class CandidateTables:
    """Stands in for the decoder's run: each call writes the next random candidate table (ids best first, EOS often
    first) into the bound candidate buffers, and records the tokens it was fed."""

    def __init__(self, rng: np.random.Generator, values: np.ndarray, ids: np.ndarray, tgt_ids: np.ndarray, rows: int) -> None:
        self.rng, self.values, self.ids, self.tgt_ids, self.rows = rng, values, ids, tgt_ids, rows
        self.fed: list[list[int]] = []

    def __call__(self, binding: object) -> None:
        assert binding == "binding"
        self.fed.append(self.tgt_ids[: self.rows, 0].tolist())
        for row in range(self.rows):
            tokens = self.rng.choice(np.arange(3, 40), size=STRIDE, replace=False)
            if self.rng.random() < 0.3:
                tokens[int(self.rng.integers(0, 2))] = EOS
            self.ids[row * STRIDE : (row + 1) * STRIDE] = tokens
            self.values[row * STRIDE : (row + 1) * STRIDE] = np.sort(self.rng.standard_normal(STRIDE).astype(np.float32))[::-1]


def test_compiled_steps_choose_score_and_end_as_python_does(compiled: ModuleType) -> None:
    """Random tables over several steps, requests with EOS banned for a while and different lengths: the compiled step
    feeds each request's row (in any order) its token, numbers each row's slot, advances its position, and leaves each searcher as
    `advance_greedy_candidates` leaves a copy; a request its token ends is reported with that token and score, untouched."""
    rng = np.random.default_rng(0)
    rows = 5
    limits = ((0, 9), (4, 9), (0, 3), (6, 6), (2, 11))  # (min_output_tokens, max_output_tokens)
    options = [SearchOptions(min_output_tokens=minimum, max_output_tokens=most) for minimum, most in limits]
    searchers = [GreedySearch(option, 4, BOS, EOS, 64) for option in options]
    tgt_ids, positions = np.zeros((8, 1), dtype=np.int64), np.zeros(8, dtype=np.int64)
    slot_ids = np.zeros((8, CAPACITY), dtype=np.int64)
    values, ids = np.zeros(8 * STRIDE, dtype=np.float32), np.zeros(8 * STRIDE, dtype=np.int64)
    tables = CandidateTables(rng, values, ids, tgt_ids, rows)
    live = list(range(rows))
    for step in range(8):
        if not live:
            break
        tables.rows = len(live)
        active = [searchers[index] for index in live]
        expected = copy.deepcopy(active)
        fed_before = [searcher.next_token for searcher in active]
        positions_before = positions[: len(live)].copy()
        row_of = rng.permutation(len(live)).tolist()  # the requests' rows in the call, in any order (a leave moves rows)
        ending = compiled.step(tables, "binding", tgt_ids, positions, slot_ids, 100 * step, values, ids, STRIDE,
                               [searcher.step_state() for searcher in active], row_of)  # fmt: skip
        assert [tables.fed[-1][row] for row in row_of] == fed_before
        assert (positions[: len(live)] == positions_before + 1).all()
        assert [slot_ids[row, positions_before[row]] for row in range(len(live))] == [100 * step + row for row in range(len(live))]
        chosen = advance_greedy_candidates(expected, values[: len(live) * STRIDE].tolist(), ids[: len(live) * STRIDE].tolist(), STRIDE)
        ended = {row for row, _, _ in ending}
        for row, (searcher, reference, result) in enumerate(zip(active, expected, chosen, strict=True)):
            assert (result is None) == (row in ended)
            if row not in ended:
                assert (searcher.rows, searcher.score, searcher.next_token) == (reference.rows, reference.score, reference.next_token)
        for row, token, score in ending:
            assert active[row].extend_one(token, score) is None
            assert active[row].finished == expected[row].finished
        # The rows of the requests still running move down, as the engine's next layout would give them new rows.
        keep = [row for row in range(len(live)) if row not in ended]
        positions[: len(keep)] = positions[keep]
        live = [live[row] for row in keep]
    reasons = {searcher.finished[0][2].name for searcher in searchers if searcher.finished}
    assert reasons == {"EOS", "LENGTH"}  # both endings met


def test_the_compiled_step_refuses_what_it_cannot_run_and_runs_nothing(compiled: ModuleType) -> None:
    calls: list[object] = []
    searcher = GreedySearch(SearchOptions(), 4, BOS, EOS, 64)
    buffers = [np.zeros((2, 1), np.int64), np.zeros(2, np.int64), np.zeros((2, 4), np.int64), 0,
               np.zeros(4, np.float32), np.zeros(4, np.int64)]  # fmt: skip
    one = [searcher.step_state()]
    with pytest.raises(ValueError, match="two or more candidates per row"):
        compiled.step(calls.append, None, *buffers, 1, one, [0])
    with pytest.raises(ValueError, match="every row"):
        compiled.step(calls.append, None, *buffers, 2, one * 3, [0, 1, 2])
    with pytest.raises(TypeError, match="request 0 must be a tuple"):
        compiled.step(calls.append, None, *buffers, 2, [[1, 2]], [0])
    with pytest.raises(ValueError, match="8-byte items"):
        compiled.step(calls.append, None, np.zeros(2, np.int32), *buffers[1:], 2, one, [0])
    with pytest.raises(ValueError, match="one length"):
        compiled.step(calls.append, None, *buffers, 2, one, [0, 1])
    with pytest.raises(ValueError, match="request 1's row 0: the rows must be 0 to 1, one per request"):
        compiled.step(calls.append, None, *buffers, 2, one * 2, [0, 0])
    buffers[1][0] = 4
    with pytest.raises(ValueError, match="position 4, outside the cache's 4 slots"):
        compiled.step(calls.append, None, *buffers, 2, one, [0])
    assert not calls


def test_engine_steps_compiled_and_in_python_give_the_same_translations(tiny_model_dir: Path, compiled: ModuleType,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Greedy requests joining at different steps, EOS banned for a while in some, one cancelled: the same tokens,
    scores, outcomes and step counts with the compiled steady step as with the Python path, which made none of them."""
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))
    sources = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23], [24, 25, 26, 27]]
    limits = ((0, 14), (3, 20), (9, 12), (0, 6), (5, 25), (0, 30))  # (min_output_tokens, max_output_tokens)
    options = [SearchOptions(min_output_tokens=minimum, max_output_tokens=most) for minimum, most in limits]
    plan = [(arrival, source, option) for arrival, source, option in zip((0, 0, 2, 5, 5, 11), sources, options, strict=True)]
    compiled_steps: list[int] = []
    real_stepped = StepCache.stepped_in_place

    def stepped_in_place(cache: StepCache) -> None:
        compiled_steps.append(cache.rows)
        real_stepped(cache)

    monkeypatch.setattr(StepCache, "stepped_in_place", stepped_in_place)
    monkeypatch.setattr(engine_module, "native_greedy_step", None)
    in_python = run_plan(runtime, plan, cancel_at=7)
    assert not compiled_steps
    row_orders: list[list[int]] = []

    class Recording:
        """The compiled step, recording each call's rows per request."""

        @staticmethod
        def step(*args: object) -> object:
            row_orders.append(list(args[-1]))  # type: ignore[call-overload]
            return compiled.step(*args)

    monkeypatch.setattr(engine_module, "native_greedy_step", Recording)
    in_c = run_plan(runtime, plan, cancel_at=7)
    assert any(rows != sorted(rows) for rows in row_orders)  # steps after a leave moved a row: rows out of request order
    assert len(compiled_steps) >= 10 and max(compiled_steps) >= 3  # steady stretches of one request and of several
    for python_job, c_job in zip(in_python, in_c, strict=True):
        assert (c_job.outcome, c_job.steps) == (python_job.outcome, python_job.steps)
        assert [(hypothesis.token_ids, hypothesis.score) for hypothesis in c_job.hypotheses] == [
            (hypothesis.token_ids, hypothesis.score) for hypothesis in python_job.hypotheses]  # fmt: skip
