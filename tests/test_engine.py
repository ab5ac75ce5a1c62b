"""Engine: continuous batching gives every request exactly its alone-result; cancel, expiry, budgets, failures."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt_serve.model.search import Hypothesis, SearchOptions, generate
from nmt_serve.runtime import step_cache
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.source_group import source_width
from nmt_serve.runtime.step_cache import StepCache
from nmt_serve.server.engine import engine as engine_module
from nmt_serve.server.engine import row_placement
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import EngineLimits, Job, Outcome
from nmt_serve.server.engine.row_placement import place_rows_numpy, place_rows_python
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from tests.extensions import compiled_extension

SOURCES = [[5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]
GREEDY_LONG = SearchOptions(beam_size=1, min_output_tokens=8, max_output_tokens=14)
BEAM3 = SearchOptions(beam_size=3, num_hypotheses=2, min_output_tokens=5, max_output_tokens=12)
GREEDY_SHORT = SearchOptions(beam_size=1, max_output_tokens=4)


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Runtime:
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=4, warmup_src_len=8))
    runtime.warm_up()
    return runtime


@pytest.fixture
def python_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady greedy and beam steps made in Python (StepCache.continue_in_place or arrange, then run), for tests that
    count or fail `StepCache.run`: the compiled steady steps (runtime/kernels/greedy_step.c, beam_step.c) run the
    session themselves. Both paths give the same steps (tests/test_greedy_step.py, tests/test_beam_step.py)."""
    monkeypatch.setattr(engine_module, "native_greedy_step", None)
    monkeypatch.setattr(engine_module, "native_beam_step", None)


@pytest.fixture(scope="module")
def compiled_greedy_step(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The compiled steady greedy step built in this session from its source (tests/extensions.py)."""
    return compiled_extension("greedy_step", tmp_path_factory.mktemp("greedy_step"))


def use_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, steps: str) -> None:
    """Steady greedy steps made in Python ("python") or by the compiled step built in this session ("compiled")."""
    compiled = request.getfixturevalue("compiled_greedy_step") if steps == "compiled" else None
    monkeypatch.setattr(engine_module, "native_greedy_step", compiled)


def engine_alone(runtime: Runtime, source: list[int], options: SearchOptions) -> list[Hypothesis]:
    """A request's result from an engine of its own."""
    engine = Engine(runtime)
    job = engine.submit(source, options)
    run_until_done(engine, [job])
    return job.hypotheses


def alone(model_dir: Path, source: list[int], options: SearchOptions) -> list[Hypothesis]:
    config = OrtStep(model_dir).config
    return generate(OrtStep(model_dir), [source], options, config.bos_id, config.eos_id, config.max_positions)[0]


def run_until_done(engine: Engine, jobs: list[Job], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if all(job.done.is_set() for job in jobs):
            return
        engine.step()
    raise AssertionError("engine did not finish")


def test_engine_run_until_idle_finishes_every_request(runtime: Runtime) -> None:
    engine = Engine(runtime)
    jobs = [engine.submit(source, GREEDY_SHORT) for source in SOURCES[:3]]
    engine.run_until_idle()
    assert not engine.has_work and [job.outcome for job in jobs] == [Outcome.OK] * 3


def assert_same(job: Job, expected: list[Hypothesis]) -> None:
    assert job.outcome is Outcome.OK
    assert [h.token_ids for h in job.hypotheses] == [h.token_ids for h in expected]
    assert [h.score for h in job.hypotheses] == pytest.approx([h.score for h in expected], abs=1e-4)


def record_calls(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Count rows per decoder call and sources per encoder call, calling the real sessions."""
    calls: dict[str, list[int]] = {"decode": [], "encode": []}
    real_run, real_encode = StepCache.run, runtime.encode

    def run(cache: StepCache) -> np.ndarray:
        calls["decode"].append(cache.rows)
        return real_run(cache)

    def encode(src_ids: np.ndarray, src_mask: np.ndarray) -> object:
        calls["encode"].append(len(src_ids))
        return real_encode(src_ids, src_mask)

    monkeypatch.setattr(StepCache, "run", run)
    monkeypatch.setattr(runtime, "encode", encode)
    return calls


LayoutPaths = tuple[list[tuple[str, frozenset[int]]], list[int], list[int]]


def record_layout_paths(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> LayoutPaths:
    """Per decoder call, which layout path it took ("arrange" or "in place": Python's `continue_in_place` or the
    compiled steady greedy step) and the requests in it; the rows a short-path call fed another request's token
    (each row must get its own request's); and the calls (their index) the compiled step made."""
    calls: list[tuple[str, frozenset[int]]] = []
    compiled: list[int] = []
    misrouted: list[int] = []
    compiled_feeds: list[dict[int, int]] = []  # the tokens each row is due in the compiled step about to run
    real_arrange, real_continue = StepCache.arrange, StepCache.continue_in_place
    real_args, real_stepped = StepCache.start_greedy_step, StepCache.stepped_in_place

    def due() -> dict[int, int]:
        return {int(job.row_ids[0]): int(job.searcher.next_tokens[0]) for job in engine.active}  # type: ignore[union-attr]

    def arrange(cache: StepCache, *args: object, **kwargs: object) -> None:
        calls.append(("arrange", frozenset(job.job_id for job in engine.active)))
        real_arrange(cache, *args, **kwargs)  # type: ignore[arg-type]

    def continue_in_place(cache: StepCache, tgt_ids: np.ndarray) -> None:
        calls.append(("in place", frozenset(job.job_id for job in engine.active)))
        real_continue(cache, tgt_ids)
        misrouted.extend(row for row, token in due().items() if cache._tgt_ids[row, 0] != token)

    def start_greedy_step(cache: StepCache) -> tuple[object, ...] | None:
        args = real_args(cache)
        if args is not None:
            compiled_feeds.append(due())
        return args

    def stepped_in_place(cache: StepCache) -> None:
        compiled.append(len(calls))
        calls.append(("in place", frozenset(job.job_id for job in engine.active)))
        misrouted.extend(row for row, token in compiled_feeds[-1].items() if cache._tgt_ids[row, 0] != token)
        real_stepped(cache)

    monkeypatch.setattr(StepCache, "arrange", arrange)
    monkeypatch.setattr(StepCache, "continue_in_place", continue_in_place)
    monkeypatch.setattr(StepCache, "start_greedy_step", start_greedy_step)
    monkeypatch.setattr(StepCache, "stepped_in_place", stepped_in_place)
    return calls, misrouted, compiled


@pytest.mark.parametrize("layout", ["lists", "numpy"])
def test_engine_staggered_mixed_requests_equal_each_alone(runtime: Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          layout: str) -> None:  # fmt: skip
    """Greedy and beam requests joining at different steps each equal themselves alone, with the calls' rows laid out on
    lists (a few rows, the default here) or with numpy (more rows than PYTHON_PLACEMENT_ROWS / PYTHON_LAYOUT_ROWS)."""
    if layout == "numpy":
        monkeypatch.setattr(engine_module, "PYTHON_PLACEMENT_ROWS", 0)
        monkeypatch.setattr(row_placement, "PYTHON_PLACEMENT_ROWS", 0)
        monkeypatch.setattr(step_cache, "PYTHON_LAYOUT_ROWS", 0)
    engine = Engine(runtime)
    plan = [(0, SOURCES[0], GREEDY_LONG), (0, SOURCES[1], BEAM3), (2, SOURCES[2], GREEDY_SHORT), (3, SOURCES[3], BEAM3), (5, SOURCES[4], GREEDY_LONG)]
    jobs: list[tuple[Job, list[int], SearchOptions]] = []
    for step in range(6):
        for arrival, source, options in plan:
            if arrival == step:
                jobs.append((engine.submit(source, options), source, options))
        engine.step()
    run_until_done(engine, [job for job, _, _ in jobs])
    for job, source, options in jobs:
        assert_same(job, alone(tiny_model_dir, source, options))


@pytest.mark.parametrize("dummy_places", [False, True])
def test_engine_short_and_long_sources_coming_and_going_equal_each_alone(runtime: Runtime, tiny_model_dir: Path,
                                                                         dummy_places: bool) -> None:
    """Sources of at most 16 tokens and longer ones, greedy and beam, joining and leaving: the calls read the narrow
    group alone, both groups, and the wide group alone, and every request equals itself decoded alone. With dummy
    places (what other execution providers get) as without."""
    engine = Engine(runtime)
    engine._cache.dummy_places = dummy_places
    long_a, long_c, long_e = list(range(4, 34)), list(range(30, 50)), list(range(10, 45))
    plan = [(0, long_a, GREEDY_SHORT), (0, SOURCES[0], GREEDY_SHORT), (0, long_c, BEAM3), (7, SOURCES[3], GREEDY_LONG),
            (9, long_e, GREEDY_SHORT)]  # fmt: skip
    jobs: list[tuple[Job, list[int], SearchOptions]] = []
    groups = set()
    for step in range(40):
        for arrival, source, options in plan:
            if arrival == step:
                jobs.append((engine.submit(source, options), source, options))
        if not engine.has_work:
            break
        engine.step()
        cache = engine._cache
        if cache.rows:
            groups.add((cache.narrow.sources > 0, cache.wide.sources > 0))
    assert groups == {(True, True), (False, True), (True, False)}
    run_until_done(engine, [job for job, _, _ in jobs])
    for job, source, options in jobs:
        assert_same(job, alone(tiny_model_dir, source, options))


def test_engine_narrows_its_source_buffers_once_a_long_source_leaves_and_each_equals_alone(runtime: Runtime, tiny_model_dir: Path) -> None:
    """Cross-attention runs over the bound source width: after a long source leaves, the StepCache's wide group
    narrows to the longest live source and the engine's pool follows (a busy engine would otherwise pay for it until
    it idles); with no long source left the idle wide group binds nothing."""
    engine = Engine(runtime)
    long_source, medium_source = list(range(4, 64)), list(range(20, 40))
    plan = [(0, long_source, SearchOptions(max_output_tokens=2)), (0, medium_source, SearchOptions(max_output_tokens=5)),
            (0, SOURCES[0], GREEDY_LONG), (0, SOURCES[1], BEAM3), (6, SOURCES[2], GREEDY_LONG)]  # fmt: skip
    jobs: list[tuple[Job, list[int], SearchOptions]] = []
    widths, wide_places = [], []
    for step in range(8):
        for arrival, source, options in plan:
            if arrival == step:
                jobs.append((engine.submit(source, options), source, options))
        engine.step()
        widths.append(engine._cache.capacity[2])
        wide_places.append(engine._cache.wide.bound)
    # + EOS, rounded up to the source width multiple; the long request left after 2 steps, the medium one after 5
    assert widths[0] == source_width(len(long_source) + 1) and jobs[0][0].done.is_set()
    assert widths[2] == source_width(len(medium_source) + 1)
    assert wide_places[0] == 2 and wide_places[2] == 1 and wide_places[-1] == 0
    assert engine._pool.width < len(long_source)  # the pool narrowed at the later join
    run_until_done(engine, [job for job, _, _ in jobs])
    for job, source, options in jobs:
        assert_same(job, alone(tiny_model_dir, source, options))


@pytest.mark.usefixtures("python_steps")
def test_engine_busy_batch_takes_newcomers_in_groups_and_each_equals_alone(runtime: Runtime, tiny_model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """join_wait_steps 3, join_group 2: one newcomer waits 3 steps, two join at once, and outputs do not change."""
    calls = record_calls(runtime, monkeypatch)
    engine = Engine(runtime, EngineLimits(join_wait_steps=3, join_group=2))
    running = engine.submit(SOURCES[0], GREEDY_LONG)
    engine.step()  # an idle engine takes a request at once
    assert calls["encode"] == [1]
    late = engine.submit(SOURCES[1], BEAM3)
    for _ in range(3):
        engine.step()
        assert engine.pending == 1 and calls["encode"] == [1]  # waiting for company
    engine.step()  # the 4th step: it has waited 3
    assert engine.pending == 0 and calls["encode"] == [1, 1]
    pair = [engine.submit(SOURCES[2], GREEDY_SHORT), engine.submit(SOURCES[3], BEAM3)]
    engine.step()  # a group of 2 joins at the next step
    assert engine.pending == 0 and sum(calls["encode"][2:]) == 2
    run_until_done(engine, [running, late, *pair])
    for job, source, options in zip([running, late, *pair], SOURCES, [GREEDY_LONG, BEAM3, GREEDY_SHORT, BEAM3]):
        assert_same(job, alone(tiny_model_dir, source, options))


@pytest.mark.usefixtures("python_steps")
def test_engine_cancelled_request_leaves_within_one_step(runtime: Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(runtime, monkeypatch)
    engine = Engine(runtime)
    victim = engine.submit(SOURCES[3], BEAM3)
    survivor = engine.submit(SOURCES[0], GREEDY_LONG)
    for _ in range(3):
        engine.step()
    engine.cancel(victim)
    engine.step()
    assert victim.outcome is Outcome.CANCELLED
    assert calls["decode"][-1] == 1  # only the survivor's row ran in the step after cancel
    run_until_done(engine, [survivor])
    assert_same(survivor, alone(tiny_model_dir, SOURCES[0], GREEDY_LONG))


@pytest.mark.usefixtures("python_steps")
def test_engine_expired_request_never_reaches_the_model(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(runtime, monkeypatch)
    engine = Engine(runtime)
    expired = engine.submit(SOURCES[0], GREEDY_LONG, deadline=time.monotonic() - 1)
    engine.step()
    assert expired.outcome is Outcome.EXPIRED
    assert calls == {"decode": [], "encode": []}


def test_engine_request_expiring_mid_decode_leaves_the_batch(runtime: Runtime, tiny_model_dir: Path) -> None:
    engine = Engine(runtime)
    expiring = engine.submit(SOURCES[1], GREEDY_LONG, deadline=time.monotonic() + 3600)
    other = engine.submit(SOURCES[2], BEAM3)
    engine.step()
    expiring.deadline = time.monotonic() - 1  # as if its deadline passed during the step
    engine.step()
    assert expiring.outcome is Outcome.EXPIRED
    assert expiring not in engine.active
    run_until_done(engine, [other])
    assert_same(other, alone(tiny_model_dir, SOURCES[2], BEAM3))


@pytest.mark.usefixtures("python_steps")
def test_engine_row_budget_bounds_every_call(runtime: Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(runtime, monkeypatch)
    engine = Engine(runtime, EngineLimits(max_rows=4))
    jobs = [engine.submit(source, BEAM3) for source in SOURCES[:3]]
    run_until_done(engine, jobs)
    assert max(calls["decode"]) <= 4
    for job, source in zip(jobs, SOURCES, strict=False):
        assert_same(job, alone(tiny_model_dir, source, BEAM3))


@pytest.mark.usefixtures("python_steps")
def test_engine_failed_step_fails_its_requests_and_keeps_serving(runtime: Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(runtime)
    real_run = StepCache.run
    failing = {"left": 1}

    def run(cache: StepCache) -> np.ndarray:
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("injected ONNX Runtime failure")
        return real_run(cache)

    monkeypatch.setattr(StepCache, "run", run)
    broken = engine.submit(SOURCES[0], GREEDY_LONG)
    engine.step()
    assert broken.outcome is Outcome.FAILED
    assert "injected" in str(broken.error)
    later = engine.submit(SOURCES[4], BEAM3)
    run_until_done(engine, [later])
    assert_same(later, alone(tiny_model_dir, SOURCES[4], BEAM3))


@pytest.mark.usefixtures("python_steps")
def test_engine_out_of_memory_drops_the_largest_request_and_the_others_equal_alone(runtime: Runtime, tiny_model_dir: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Out of memory: the decoder call fails for memory mid-decode (beam rows have just been reordered);
    the request holding the most cache leaves with OUT_OF_MEMORY, the call is retried, and the others'
    outputs are still exactly their alone-results."""
    engine = Engine(runtime)
    real_run = StepCache.run
    state = {"failed": 0, "retried_rows": 0}
    beam4 = SearchOptions(beam_size=4, min_output_tokens=30, max_output_tokens=30)  # the largest until the end
    kept_beam, kept_greedy, largest = engine.submit(SOURCES[0], BEAM3), engine.submit(SOURCES[1], GREEDY_LONG), engine.submit(SOURCES[2], beam4)

    def run(cache: StepCache) -> np.ndarray:
        # Fail the first call in which the kept beam's rows were reordered (a row copied from another) after
        # its first steps, when its rows' caches differ (the rows of step 1 all copy the one BOS row).
        reordered = kept_beam.steps >= 3 and not np.array_equal(kept_beam.local_parents, np.arange(kept_beam.rows))
        if reordered and not state["failed"]:
            state["failed"] += 1
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer of size 1048576")
        if state["failed"] and not state["retried_rows"]:
            state["retried_rows"] = cache.rows
        return real_run(cache)

    monkeypatch.setattr(StepCache, "run", run)
    run_until_done(engine, [kept_beam, kept_greedy, largest])
    assert state["failed"] == 1 and largest.outcome is Outcome.OUT_OF_MEMORY and "out of memory" in str(largest.error)
    assert_same(kept_beam, alone(tiny_model_dir, SOURCES[0], BEAM3))
    assert_same(kept_greedy, alone(tiny_model_dir, SOURCES[1], GREEDY_LONG))
    assert engine.row_ceiling == state["retried_rows"]  # admissions now stop at what the retried call fitted

    # A lone request that does not fit gets OUT_OF_MEMORY; the engine serves the next one.
    def always_out_of_memory(cache: StepCache) -> np.ndarray:
        raise MemoryError("injected")

    monkeypatch.setattr(StepCache, "run", always_out_of_memory)
    lone = engine.submit(SOURCES[3], BEAM3)
    run_until_done(engine, [lone])
    assert lone.outcome is Outcome.OUT_OF_MEMORY
    monkeypatch.setattr(StepCache, "run", real_run)
    later = engine.submit(SOURCES[4], BEAM3)
    run_until_done(engine, [later])
    assert_same(later, alone(tiny_model_dir, SOURCES[4], BEAM3))


@pytest.mark.parametrize("steps", ["python", "compiled"])
def test_engine_streams_greedy_tokens_as_chosen(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                                steps: str) -> None:  # fmt: skip
    """Streaming and plain greedy requests in one batch: each streaming request's callback gets every chosen token in
    order (in Python or after the compiled step), and the plain requests' results are those they get alone."""
    use_steps(request, monkeypatch, steps)
    engine = Engine(runtime)
    _, _, compiled = record_layout_paths(engine, monkeypatch)
    streamed: dict[int, list[int]] = {0: [], 2: []}
    plan = [(SOURCES[0], GREEDY_LONG), (SOURCES[1], GREEDY_LONG), (SOURCES[2], SearchOptions(min_output_tokens=5, max_output_tokens=9))]

    def stream_into(index: int) -> Callable[[Job, np.ndarray], None] | None:
        return (lambda _, tokens: streamed[index].extend(tokens.tolist())) if index in streamed else None

    jobs = [engine.submit(source, options, on_tokens=stream_into(index)) for index, (source, options) in enumerate(plan)]
    run_until_done(engine, jobs)
    for index, tokens in streamed.items():
        expected = list(jobs[index].hypotheses[0].token_ids)
        # Every chosen token is streamed, except a final one that ends the request (EOS or the length limit).
        assert tokens == expected[: len(tokens)] and len(expected) - len(tokens) <= 1
    assert jobs[1].hypotheses == engine_alone(runtime, SOURCES[1], GREEDY_LONG)
    assert bool(compiled) == (steps == "compiled")


def test_engine_rows_stay_in_place_and_a_leaving_request_moves_only_its_rows(runtime: Runtime, tiny_model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Greedy rows in steady state copy nothing; when a request leaves, at most its own rows' worth move down."""
    moved: list[int] = []
    real_arrange = StepCache.arrange

    def arrange(cache: StepCache, parents: np.ndarray | list[int], *args: object) -> None:
        continuing = np.asarray(parents) >= 0
        moved.append(int((np.asarray(parents)[continuing] != np.flatnonzero(continuing)).sum()))
        real_arrange(cache, parents, *args)

    monkeypatch.setattr(StepCache, "arrange", arrange)
    engine = Engine(runtime)
    short = SearchOptions(beam_size=1, min_output_tokens=3, max_output_tokens=3)
    long = SearchOptions(beam_size=1, min_output_tokens=10, max_output_tokens=10)
    plan = [(SOURCES[0], short), (SOURCES[1], long), (SOURCES[2], long), (SOURCES[3], long)]
    jobs = [engine.submit(source, options) for source, options in plan]
    run_until_done(engine, jobs)
    # The first request (row 0) leaves after 3 tokens: one row (the top one) fills its place, once.
    assert sum(moved) == 1 and moved.count(1) == 1
    for job, (source, options) in zip(jobs, plan, strict=True):
        assert_same(job, alone(tiny_model_dir, source, options))


@pytest.mark.parametrize("steps", ["python", "compiled"])
def test_engine_steady_greedy_steps_only_feed_tokens_and_each_equals_alone(runtime: Runtime, tiny_model_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                                                           steps: str) -> None:  # fmt: skip
    """Between joins and leaves, a step of greedy requests only feeds each row its token (StepCache.continue_in_place,
    or the compiled steady step); a join, a leave or a beam request sends the step back through the full layout, and
    every output equals alone."""
    use_steps(request, monkeypatch, steps)
    engine = Engine(runtime)
    calls, misrouted, compiled = record_layout_paths(engine, monkeypatch)
    short = SearchOptions(beam_size=1, min_output_tokens=3, max_output_tokens=3)
    plan = [(0, SOURCES[0], GREEDY_LONG), (0, SOURCES[1], short), (6, SOURCES[2], GREEDY_LONG), (9, SOURCES[3], BEAM3)]
    jobs: list[tuple[Job, list[int], SearchOptions]] = []
    for step in range(40):
        jobs += [(engine.submit(source, options), source, options) for arrival, source, options in plan if arrival == step]
        engine.step()
    beam_ids = {job.job_id for job, _, options in jobs if options.beam_size > 1}
    # Each call with the same greedy requests as the one before it (and only those) takes the short path.
    pairs = zip(calls, calls[1:], strict=False)
    expected = ["in place" if requests == before and not requests & beam_ids else "arrange" for (_, before), (_, requests) in pairs]
    assert [path for path, _ in calls[1:]] == expected
    assert expected.count("in place") >= 4 and calls[0][0] == "arrange" and not misrouted
    # The compiled step makes every short-path call where it is built in, none where it is not.
    assert compiled == ([index + 1 for index, path in enumerate(expected) if path == "in place"] if steps == "compiled" else [])
    for job, source, options in jobs:
        assert_same(job, alone(tiny_model_dir, source, options))


@settings(max_examples=400, deadline=None, database=None)
@given(st.lists(st.integers(-1, 40), min_size=1, max_size=40))
def test_row_placement_python_and_numpy_agree(continued: list[int]) -> None:
    """Small calls place rows in plain Python, large ones with numpy: the same places, a permutation of the
    rows in which the first row continuing a place below the row count stays there."""
    origin = np.array(continued, dtype=np.int64)
    place = place_rows_python(origin)
    assert place.tolist() == place_rows_numpy(origin).tolist()
    assert sorted(place.tolist()) == list(range(len(continued)))
    for row, parent in enumerate(continued):
        if 0 <= parent < len(continued) and parent not in continued[:row]:
            assert place[row] == parent


@settings(max_examples=400, deadline=None, database=None)
@given(st.data())
def test_a_request_keeping_its_row_count_keeps_its_places(data: st.DataObject) -> None:
    """With each request's places in the last call, Python and numpy still agree and rows still stay on the place they
    continue; a request with as many rows as places (all still below the row count) gets exactly its own places back,
    whichever parents its rows pick, so each place keeps its source."""
    last_rows = data.draw(st.integers(1, 40))
    old = data.draw(st.permutations(list(range(last_rows))))
    cuts = sorted(data.draw(st.lists(st.integers(0, last_rows), max_size=6)))
    held = [old[start:end] for start, end in zip([0, *cuts], [*cuts, last_rows], strict=True)] + [[]]  # the last: a new request
    groups, origin = [], []
    for places in held:
        count = data.draw(st.integers(0, 6))
        origin += data.draw(st.lists(st.sampled_from(places), min_size=count, max_size=count)) if places else [-1] * count
        groups.append((count, places))
    if not origin:
        return
    array = np.array(origin, dtype=np.int64)
    place = place_rows_python(array, groups)
    assert place.tolist() == place_rows_numpy(array, groups).tolist()
    assert sorted(place.tolist()) == list(range(len(origin)))
    for row, parent in enumerate(origin):
        if 0 <= parent < len(origin) and parent not in origin[:row]:
            assert place[row] == parent
    first = 0
    for count, places in groups:
        if count == len(places) and all(where < len(origin) for where in places):
            assert sorted(place[first : first + count].tolist()) == sorted(places)
        first += count


@pytest.mark.parametrize("steps", ["python", "compiled"])
def test_engine_out_of_memory_on_a_steady_greedy_step_sheds_one_and_the_others_equal_alone(
        runtime: Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, steps: str) -> None:
    """Out of memory on the short path: the decoder call of a steady greedy step (only tokens fed, in Python or in the
    compiled step) fails for memory; the request holding the most cache leaves with OUT_OF_MEMORY and the retried call
    keeps the others exactly on their alone-results."""
    use_steps(request, monkeypatch, steps)
    engine = Engine(runtime)
    real_run, real_continue, real_args = StepCache.run, StepCache.continue_in_place, StepCache.start_greedy_step
    state = {"failed": 0, "in_place_calls": 0}
    message = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer of size 1048576"

    def failing_now() -> bool:
        state["in_place_calls"] += 1
        if state["in_place_calls"] == 3 and not state["failed"]:  # the third short-path step
            state["failed"] += 1
            return True
        return False

    def continue_in_place(cache: StepCache, tgt_ids: np.ndarray) -> None:
        state["python_fails"] = failing_now()
        real_continue(cache, tgt_ids)

    def run(cache: StepCache) -> np.ndarray:
        if state.pop("python_fails", False):
            raise RuntimeError(message)
        return real_run(cache)

    def start_greedy_step(cache: StepCache) -> tuple[object, ...] | None:
        args = real_args(cache)
        if args is None or not failing_now():
            return args
        state["compiled_failed"] = 1

        def run_out_of_memory(binding: object) -> None:
            # The failed call's slot numbers are taken before its run, as StepCache.run takes them: it may have written
            # the slots, and the retried call must not number other contents with them.
            state["numbers_taken"] = cache._next_slot_id == args[5] + cache.rows  # type: ignore[operator]
            raise RuntimeError(message)

        return (run_out_of_memory, *args[1:])

    monkeypatch.setattr(StepCache, "continue_in_place", continue_in_place)
    monkeypatch.setattr(StepCache, "run", run)
    monkeypatch.setattr(StepCache, "start_greedy_step", start_greedy_step)
    longest = SearchOptions(beam_size=1, min_output_tokens=20, max_output_tokens=20)  # the most cache when it fails
    plan = [(SOURCES[3], longest), (SOURCES[0], GREEDY_LONG), (SOURCES[2], GREEDY_LONG)]
    jobs = [engine.submit(source, options) for source, options in plan]
    run_until_done(engine, jobs)
    assert state["failed"] == 1 and jobs[0].outcome is Outcome.OUT_OF_MEMORY
    assert state.get("compiled_failed", 0) == (steps == "compiled")  # the failure met the path under test
    assert state.get("numbers_taken", steps == "python")
    for job, (source, options) in zip(jobs[1:], plan[1:], strict=True):
        assert_same(job, alone(tiny_model_dir, source, options))


@pytest.mark.parametrize("steps", ["python", "compiled"])
def test_engine_greedy_rows_out_of_request_order_still_only_feed_tokens(runtime: Runtime, tiny_model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                                                        steps: str) -> None:  # fmt: skip
    """The first request leaves and the top row fills its place, so rows are no longer in request order:
    every later step with the same greedy requests still takes the short path (each token to its
    request's row, in Python or in the compiled step), and every output equals alone."""
    use_steps(request, monkeypatch, steps)
    engine = Engine(runtime)
    calls, misrouted, compiled = record_layout_paths(engine, monkeypatch)  # the tiny model's outputs alone could hide a mix-up
    short = SearchOptions(beam_size=1, min_output_tokens=2, max_output_tokens=2)
    # Forced prefixes make every request feed different tokens (the tiny model alone picks the same ones).
    longs = [SearchOptions(beam_size=1, min_output_tokens=10, max_output_tokens=10, target_prefix=tuple(range(first, first + 7)))
             for first in (10, 20, 30)]  # fmt: skip
    plan = [(SOURCES[0], short), *zip(SOURCES[1:4], longs, strict=True)]
    jobs = [engine.submit(source, options) for source, options in plan]
    engine.step()
    engine.step()  # the short request's last step
    assert jobs[0].done.is_set()
    engine.step()  # the leave: a full layout, the top row moves into row 0
    assert [int(job.row_ids[0]) for job in jobs[1:]] == [1, 2, 0]
    run_until_done(engine, jobs)
    paths = [path for path, _ in calls]
    assert paths[:3] == ["arrange", "in place", "arrange"] and set(paths[3:]) == {"in place"} and len(paths) == 10
    assert not misrouted
    assert bool(compiled) == (steps == "compiled") and all(index >= 3 for index in compiled[1:])
    for job, (source, options) in zip(jobs, plan, strict=True):
        assert_same(job, alone(tiny_model_dir, source, options))


def test_engine_steady_greedy_rows_keep_their_sources_when_the_cache_grows(tiny_model_dir: Path) -> None:
    """A fresh engine's cache is 16 positions long and doubles as rows pass it; three greedy requests of
    different sources running 40 tokens in steady steps (only tokens fed) cross two growths. Each must
    still read its own source: growth once reset every row's place among the sources to the first row's."""
    runtime = Runtime(tiny_model_dir, RuntimeSettings(intra_op_threads=1))
    engine = Engine(runtime, EngineLimits(max_rows=32, max_cache_tokens=1 << 16), None)
    options = SearchOptions(beam_size=1, min_output_tokens=40, max_output_tokens=40)
    jobs = [engine.submit(source, options) for source in SOURCES[:3]]
    engine.run_until_idle()
    assert engine._cache.capacity[1] >= 41  # the cache grew past its first 16 and 32 positions during the run
    for job, source in zip(jobs, SOURCES[:3], strict=True):
        assert_same(job, alone(tiny_model_dir, source, options))
