"""Engine: iteration-level (continuous) batching; each decoder call runs every live row of every active request.

A request is a per-request searcher from model/search.py plus its rows (a beam of K is K rows).
Between steps, new requests are encoded and join (their rows start at position 0), and finished,
cancelled and expired requests leave. The rows and their caches live in a StepCache
(runtime/step_cache.py): each row has its own cache that the decoder extends in place, so rows at
different positions share a call without padding, and only rows that changed place are copied.
Each request's tokens are the ones it gets alone; only the batch it shares a step with changes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from nmt_serve.model.padding import pad_sources
from nmt_serve.model.search import GREEDY_CANDIDATES, BeamSearch, GreedySearch, SearchOptions, advance_greedy_candidates, make_searcher
from nmt_serve.runtime import float_mode
from nmt_serve.runtime.step_cache import native_beam_step, native_greedy_step
from nmt_serve.server.engine.jobs import EngineLimits, Job, Outcome, StepProfile
from nmt_serve.server.engine.row_placement import PYTHON_PLACEMENT_ROWS, place_rows, place_rows_list, split_rows
from nmt_serve.server.engine.sessions import Runtime
from nmt_serve.server.engine.source_pool import SourcePool

logger = logging.getLogger(__name__)


def notify(callback: Callable[..., None], *args: object) -> None:
    """Run a caller's callback; its failure (say, a closed event loop) must not break the step for others."""
    try:
        callback(*args)
    except Exception:
        logger.exception("engine callback failed")


class EngineObserver(Protocol):
    """What the engine reports per call (server/models/metrics.py implements it); called on the engine thread."""

    def encoded(self, seconds: float) -> None: ...

    def stepped(self, seconds: float, rows: int, padding_ratio: float) -> None: ...

    def engine_failed(self) -> None: ...


# How allocation failures read: numpy's MemoryError, ONNX Runtime's arena ("Failed to allocate memory for
# requested buffer"), CUDA ("out of memory", cudaErrorMemoryAllocation), cuBLAS/cuDNN (..._ALLOC_FAILED), C++ bad_alloc.
_OUT_OF_MEMORY_MARKERS = ("out of memory", "failed to allocate", "alloc_failed", "cudaerrormemoryallocation", "bad_alloc")


# What a request dropped for memory is told (RESOURCE_EXHAUSTED); the log keeps the runtime's own message.
OUT_OF_MEMORY_MESSAGE = "the device running the model is out of memory; retry later, or with fewer or shorter texts or a smaller beam"


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or any(marker in str(error).lower() for marker in _OUT_OF_MEMORY_MARKERS)


def length_groups(jobs: list[Job], stretch: float = 1.5, slack: int = 4) -> list[list[Job]]:
    """Jobs sorted by source length, cut where a source is over `stretch` x its group's shortest + `slack` tokens."""
    groups: list[list[Job]] = []
    for job in sorted(jobs, key=lambda job: len(job.src_ids)):
        if groups and len(job.src_ids) <= stretch * len(groups[-1][0].src_ids) + slack:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


class Engine:
    """Not thread-safe by itself except `submit` and `cancel`; one worker thread calls `step`."""

    def __init__(self, runtime: Runtime, limits: EngineLimits = EngineLimits(), observer: EngineObserver | None = None) -> None:
        self.runtime = runtime
        self.observer = observer
        self.config = runtime.config
        self.limits = limits
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: deque[Job] = deque()
        self._load = 0  # beam rows of the requests submitted and not finished (`load`)
        self._load_lock = threading.Lock()  # its own: `_finish` also runs inside `_lock` (jobs dropped at admission)
        self._waited_steps = 0  # steps the pending requests have waited to join a running batch (EngineLimits.join_wait_steps)
        self.active: list[Job] = []
        self.profile = StepProfile()
        # A step's ONNX Runtime calls run on this thread; on the CPU they flush denormal floats to zero (the same bits,
        # much faster where a log-softmax meets them: runtime/kernels/float_mode.c), and the step puts the mode back.
        self._float_switch = float_mode.native_float_mode if runtime.provider == "CPUExecutionProvider" else None
        self._last_rows, self._last_padding = 0, 0.0  # the current step's decoder call, for the observer
        self._rows_in_order = False  # the last layout put the rows 0..n-1 in job order, one per job (greedy alone)
        # After a step whose requests were all greedy and none left: how many there were (0 otherwise). If
        # the next step has the same requests, every row continues in its place and is only fed its token.
        self._steady_greedy_jobs = 0
        # The plain greedy requests of the arranged call, in the order of their candidate rows (the first rows the graph's
        # TopK answers), and whether any greedy request was left out (one not yet batchable: steady steps look again).
        self._greedy_jobs: list[Job] = []
        self._greedy_left_out = False
        # The steady greedy requests' search states for the compiled step (GreedySearch.step_state), their rows and whether
        # any streams its tokens, made at the first such step after the requests changed.
        self._greedy_states: tuple[list[tuple[object, ...]], list[int], bool] | None = None
        # After a step whose requests were all beam searches advancing from the graph's TopK, each with as many rows as
        # places, and none left: how many there were (0 otherwise). If the next step has the same requests, each lays
        # its rows out over its own places: a compiled steady beam step can make it. Its per-request state tuples
        # (engine lists, then BeamSearch.step_state), made at the first such step after the requests changed.
        self._steady_beam_jobs = 0
        self._beam_states: list[tuple[object, ...]] | None = None
        self._beam_streaming = False  # whether any of those requests streams its tokens
        self._cache = runtime.new_step_cache()
        self._pool = SourcePool(len(runtime.cross_names), self.config.n_heads, self.config.head_dim)
        # Lowered when the device runs out of memory: the rows the last retried call fitted in.
        self.row_ceiling = limits.max_rows

    # ------------------------------------------------------------ interface for other threads

    def submit(self, src_ids: Sequence[int], options: SearchOptions, deadline: float | None = None,
               on_tokens: Callable[[Job, np.ndarray], None] | None = None, on_done: Callable[[Job], None] | None = None) -> Job:
        """Queue a request (options must already be validated); it joins the batch at the next step."""
        job = Job(next(self._ids), list(src_ids), options, deadline, on_tokens=on_tokens, on_done=on_done)
        with self._lock:
            self._pending.append(job)
        with self._load_lock:
            self._load += options.beam_size
        return job

    def cancel(self, job: Job) -> None:
        """The job's rows leave at the next step (at most one more decoder call includes them)."""
        job.cancel_requested = True

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def load(self) -> int:
        """Beam rows of the requests submitted here and not finished, waiting or running (a scheduler
        with several engines sends the next request to the least loaded)."""
        return self._load

    @property
    def has_work(self) -> bool:
        return bool(self.active or self._pending)

    def run_until_idle(self) -> None:
        """Step until nothing waits or runs: for a caller that owns the engine outright (benchmarks, tests);
        the server's workers step it from server/engine/scheduler.py instead."""
        while self.has_work:
            self.step()

    # ------------------------------------------------------------ the step

    def step(self) -> None:
        """Admit, drop, run one decoder call for all live rows, advance every searcher."""
        started = time.perf_counter()
        self._last_rows, self._last_padding = 0, 0.0
        switch = self._float_switch
        mode = switch.flush_denormals() if switch is not None else None
        try:
            self._step()
        finally:
            if switch is not None:
                switch.restore(mode)
            seconds = time.perf_counter() - started
            self.profile.steps += 1
            self.profile.total_s += seconds
            if self.observer is not None and self._last_rows:
                self.observer.stepped(seconds, self._last_rows, self._last_padding)

    def _step(self) -> None:
        now = time.monotonic()
        self._drop_leaving(now)
        joined = self._admit(now)
        if not self.active:
            self._cache.clear()
            self._pool.clear()
            return
        shed = False
        if not joined and len(self.active) == self._steady_greedy_jobs:
            made = self._compiled_greedy_step()
            if made:
                return
            shed = made is False
        elif not joined and len(self.active) == self._steady_beam_jobs:
            made = self._compiled_beam_step()
            if made:
                return
            shed = made is False
        while True:
            candidate_jobs: dict[int, tuple[int, int]] = {}
            try:
                if not joined and len(self.active) == self._steady_greedy_jobs:  # the same greedy requests as the last step
                    self._arrange_in_place()
                else:
                    slots, keys, parents, tgt_ids = self._row_inputs(joined)
                    candidate_jobs, candidate_rows, candidate_count = self._candidate_rows()
                    self._arrange(slots, keys, parents, tgt_ids, candidate_rows, candidate_count)
            except Exception as error:  # a half-arranged cache cannot be retried
                self._fail_all(error)
                return
            try:
                log_probs = self._run_decoder()
                break
            except Exception as error:  # a failed run fails the requests in it, not the engine
                if not is_out_of_memory(error) or len(self.active) == 1:
                    self._fail_all(error)
                    return
                self._shed_largest(error, self._last_rows)
                shed = True
        if shed and self._last_rows < self.row_ceiling:
            self.row_ceiling = self._last_rows
            logger.warning("after running out of memory the engine admits up to %d rows (limit %d)", self.row_ceiling, self.limits.max_rows)
        searched = time.perf_counter()
        self._advance(log_probs, candidate_jobs)
        self.profile.search_s += time.perf_counter() - searched

    def _compiled_greedy_step(self) -> bool | None:
        """A steady greedy step (the same requests as the last step, all greedy) in one compiled call
        (runtime/kernels/greedy_step.c: the same stores, run and choices as `_arrange_in_place`, `_run_decoder` and
        `_advance`), where it applies: each request in its own row and all in the candidate rows, the call's binding kept
        and room in the rows' caches. True: the step is made. None: it is not (the Python path makes it). False: the run
        ran out of memory and the largest request left (the Python path lays the rest out and runs again)."""
        if native_greedy_step is None or self._greedy_left_out:
            return None
        if self._greedy_states is None:
            states = [job.searcher.step_state() for job in self.active]  # type: ignore[union-attr]
            rows = [int(job.row_ids[0]) for job in self.active]
            self._greedy_states = states, rows, any(job.on_tokens is not None for job in self.active)
        states, rows, streaming = self._greedy_states
        args = self._cache.start_greedy_step()
        if args is None:
            return None
        decoding = time.perf_counter()
        try:
            ending = native_greedy_step.step(*args, states, rows)
        except Exception as error:
            return self._compiled_step_failed(error)
        self._cache.stepped_in_place()
        self._compiled_step_made(decoding)
        if ending or streaming:
            self._after_greedy(ending)
        return True

    def _compiled_step_failed(self, error: BaseException) -> bool:
        """A compiled step's run failed: handled as `_step` handles a failed run. True: every request failed (the step
        is made); False: out of memory, the largest request left (the Python path lays the rest out and runs again)."""
        if not is_out_of_memory(error) or len(self.active) == 1:
            self._fail_all(error)
            return True
        self._shed_largest(error, self._cache.rows)
        return False

    def _compiled_step_made(self, decoding: float) -> None:
        """After a compiled step's call: its time counts as the decoder's (its host work included), and each request
        made a step."""
        self.profile.decode_s += time.perf_counter() - decoding
        self._last_rows = self._cache.rows
        if self.observer is not None:
            self._last_padding = self._cache.padding_ratio()
        for job in self.active:
            job.steps += 1

    def _after_greedy(self, ending: list[tuple[int, int, float]]) -> None:
        """After a compiled greedy step, in request order as `_advance` goes: a request the step ended (EOS, or its length
        reached; `ending` holds (request's index, token, score), its searcher as the step left it) is ended by
        `extend_one` and finished, a streaming one that goes on gets its token."""
        ended = {index: (token, score) for index, token, score in ending}
        still_active = []
        for index, job in enumerate(self.active):
            if index in ended:
                job.searcher.extend_one(*ended[index])  # type: ignore[union-attr]
                self._finish(job, Outcome.OK)
                continue
            if job.on_tokens is not None:
                notify(job.on_tokens, job, job.searcher.next_tokens)  # type: ignore[union-attr]
            still_active.append(job)
        if not ended:
            return
        self._steady_greedy_jobs, self._greedy_states = 0, None
        self._keep_active(still_active)

    def _compiled_beam_step(self) -> bool | None:
        """A steady beam step (the same beam requests as the last step, each with as many rows as places) in one compiled
        call (runtime/kernels/beam_step.c: the same places, moves, stores, run and choices as `_row_inputs`, `_arrange`,
        `_run_decoder` and `_advance`), where the call's binding is kept and the rows' caches have room. Returns as
        `_compiled_greedy_step` does."""
        if native_beam_step is None:
            return None
        if self._beam_states is None:
            for job in self.active:  # the step rewrites each request's places in its list
                if not isinstance(job.row_ids, list):
                    job.row_ids = job.row_ids.tolist()
            self._beam_states = [(job.row_ids, job.local_parents, *job.searcher.step_state()) for job in self.active]  # type: ignore[union-attr]
            self._beam_streaming = any(job.on_tokens is not None for job in self.active)
        args = self._cache.start_beam_step()
        if args is None:
            return None
        decoding = time.perf_counter()
        try:
            copied, handed = native_beam_step.step(*args, self._beam_states)
        except Exception as error:
            return self._compiled_step_failed(error)
        self._cache.stepped_beam(copied)
        self.profile.slots_copied += copied
        self._compiled_step_made(decoding)
        if handed or self._beam_streaming:
            self._after_beam(dict(handed))
        return True

    def _after_beam(self, handed: dict[int, list[tuple[int, int, float]]]) -> None:
        """After a compiled beam step, in request order as `_advance` goes: a request handed back (a choice of its ends a
        hypothesis) takes its choices in Python and is finished when done; a streaming one that goes on gets its tokens.
        A request that is done, or whose rows no longer match its places, ends the steady steps."""
        still_active, steady = [], True
        for index, job in enumerate(self.active):
            searcher = job.searcher
            assert isinstance(searcher, BeamSearch)
            if index in handed:
                local_parents = searcher.take_choices(handed[index])
                if local_parents is None:
                    self._finish(job, Outcome.OK)
                    steady = False
                    continue
                job.local_parents, job.rows = local_parents, len(local_parents)
                steady = steady and job.rows == len(job.row_ids)
                self._beam_states[index] = (job.row_ids, job.local_parents, *searcher.step_state())  # type: ignore[index]
            if job.on_tokens is not None:
                notify(job.on_tokens, job, searcher.next_tokens)
            still_active.append(job)
        if steady:
            return
        self._steady_beam_jobs, self._beam_states = 0, None
        self._keep_active(still_active)

    def _fail_all(self, error: BaseException) -> None:
        """Every active request gets FAILED (or OUT_OF_MEMORY) and the caches are dropped; the engine serves on."""
        outcome = Outcome.OUT_OF_MEMORY if is_out_of_memory(error) else Outcome.FAILED
        logger.error("decoder step failed for %d requests (%s)", len(self.active), outcome.value, exc_info=error)
        if self.observer is not None:
            self.observer.engine_failed()
        for job in self.active:
            self._finish(job, outcome, error if outcome is Outcome.FAILED else MemoryError(OUT_OF_MEMORY_MESSAGE))
        self.active, self._steady_greedy_jobs, self._greedy_states = [], 0, None
        self._steady_beam_jobs, self._beam_states = 0, None
        self._reset_cache()

    def _shed_largest(self, error: BaseException, rows: int) -> None:
        """Out of memory with several requests in the call: the one holding the most cache leaves with
        OUT_OF_MEMORY and the call is retried without it. The cache holds the failed call's layout (the
        run writes only the slot each row was about to fill, and positions advance only after a run), so
        every other row continues in its place."""
        largest = max(self.active, key=lambda job: job.rows * self._max_length(job))
        logger.warning("out of memory with %d rows in the decoder call; dropping request %d (%d rows) and retrying: %s",
                       rows, largest.job_id, largest.rows, error)  # fmt: skip
        if self.observer is not None:
            self.observer.engine_failed()
        self.active = [job for job in self.active if job is not largest]
        self._finish(largest, Outcome.OUT_OF_MEMORY, MemoryError(OUT_OF_MEMORY_MESSAGE))
        for job in self.active:
            job.local_parents = list(range(job.rows))
        self._steady_greedy_jobs = 0
        self._greedy_states = None
        self._steady_beam_jobs, self._beam_states = 0, None

    def _drop_leaving(self, now: float) -> None:
        keep = []
        for job in self.active:
            if job.cancel_requested:
                self._finish(job, Outcome.CANCELLED)
            elif job.deadline is not None and now >= job.deadline:
                self._finish(job, Outcome.EXPIRED)
            else:
                keep.append(job)
        self.active = keep

    def _admit(self, now: float) -> set[int]:
        """Move pending jobs into the batch while the row budget allows; encode them in one call."""
        if not self._pending:  # read without the lock: a job submitted right now joins at the next step
            return set()
        if self.active and len(self._pending) < self.limits.join_group and self._waited_steps < self.limits.join_wait_steps:
            self._waited_steps += 1
            return set()
        self._waited_steps = 0
        rows = sum(job.rows for job in self.active)
        cache_tokens = sum(job.rows * self._max_length(job) for job in self.active)
        admitted: list[Job] = []
        with self._lock:
            while self._pending:
                job = self._pending[0]
                if job.cancel_requested or (job.deadline is not None and now >= job.deadline):
                    self._pending.popleft()
                    # Expired work never reaches the encoder.
                    self._finish(job, Outcome.CANCELLED if job.cancel_requested else Outcome.EXPIRED)
                    continue
                job_rows = job.options.beam_size
                job_tokens = job_rows * self._max_length(job)
                over_budget = rows + job_rows > self.row_ceiling or cache_tokens + job_tokens > self.limits.max_cache_tokens
                # An empty engine always takes the first request, so one large request cannot wait forever.
                if over_budget and (self.active or admitted):
                    break
                self._pending.popleft()
                admitted.append(job)
                rows += job_rows
                cache_tokens += job_tokens
        if not admitted:
            return set()
        try:
            self._encode(admitted)
        except Exception as error:
            logger.exception("encoder failed for %d requests", len(admitted))
            if self.observer is not None:
                self.observer.engine_failed()
            out_of_memory = is_out_of_memory(error)
            for job in admitted:
                if out_of_memory:
                    self._finish(job, Outcome.OUT_OF_MEMORY, MemoryError(OUT_OF_MEMORY_MESSAGE))
                else:
                    self._finish(job, Outcome.FAILED, error)
            return set()
        joined_at = time.perf_counter()
        for job in admitted:
            job.joined_at = joined_at
            job.searcher = make_searcher(job.options, len(job.src_ids), self.config.bos_id, self.config.eos_id, self.config.max_positions)
            job.rows = len(job.searcher.next_tokens)
        self.active.extend(admitted)
        return {job.job_id for job in admitted}

    def _row_inputs(self, joined: set[int]) -> tuple[np.ndarray | list[int], np.ndarray | list[int], np.ndarray | list[int],
                                                     np.ndarray | list[int]]:  # fmt: skip
        """Lay out the next call: per row, the source pool slot, source key (the job id), row continued (-1 = new), token fed.

        Rows stay where they are: a row continues in its own place (greedy rows, the first beam
        taking a parent), so nothing is copied for it. The rest (a second beam from one parent, a
        new request, a row above the new top after others left) fill the holes below the top. A
        leaving request thus costs a move of at most its own number of rows, not a slide of all
        rows after it.
        """
        jobs = self.active
        next_tokens = [job.searcher.next_token_list for job in jobs]  # type: ignore[union-attr]
        counts = [len(tokens) for tokens in next_tokens]
        rows = sum(counts)
        if rows <= PYTHON_PLACEMENT_ROWS:
            return self._few_row_inputs(joined, next_tokens, counts)
        # A request with one row before and after (greedy) continues its row: no index needed.
        origin = np.concatenate([np.full(count, -1, dtype=np.int64) if job.job_id in joined
                                 else np.asarray(job.row_ids) if count == 1 == len(job.row_ids)
                                 else np.asarray(job.row_ids)[job.local_parents]
                                 for job, count in zip(jobs, counts, strict=True)])  # fmt: skip
        place = place_rows(origin, [(count, () if job.job_id in joined else np.asarray(job.row_ids))
                                    for job, count in zip(jobs, counts, strict=True)])  # fmt: skip
        parents = np.empty(rows, dtype=np.int64)
        parents[place] = origin
        tokens, slots, keys = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
        tokens[place] = np.concatenate(next_tokens)
        slots[place] = np.repeat(np.array([job.slot for job in jobs], dtype=np.int64), counts)
        keys[place] = np.repeat(np.array([job.job_id for job in jobs], dtype=np.int64), counts)
        for job, row_ids in zip(jobs, split_rows(place, counts), strict=True):
            job.row_ids = row_ids
        self._rows_in_order = rows == len(jobs) and bool((place == np.arange(rows)).all())
        return slots, keys, parents, tokens

    def _few_row_inputs(self, joined: set[int], next_tokens: list[list[int]],
                        counts: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:  # fmt: skip
        """`_row_inputs` on lists, for at most PYTHON_PLACEMENT_ROWS rows (a beam or two): no numpy call; each request's
        rows are kept as a list (`Job.row_ids`)."""
        jobs = self.active
        origin: list[int] = []
        for job, count in zip(jobs, counts, strict=True):
            if job.job_id in joined:
                origin += [-1] * count
            else:
                row_ids = job.row_ids if isinstance(job.row_ids, list) else job.row_ids.tolist()
                origin += [row_ids[parent] for parent in job.local_parents]
        place = place_rows_list(origin, [(count, () if job.job_id in joined else list(job.row_ids))
                                         for job, count in zip(jobs, counts, strict=True)])  # fmt: skip
        rows = len(place)
        parents, tokens, slots, keys = [0] * rows, [0] * rows, [0] * rows, [0] * rows
        first = 0
        for job, count, job_tokens in zip(jobs, counts, next_tokens, strict=True):
            job_places = place[first : first + count]
            for where, parent, token in zip(job_places, origin[first : first + count], job_tokens, strict=True):
                parents[where], tokens[where], slots[where], keys[where] = parent, token, job.slot, job.job_id
            job.row_ids = job_places
            first += count
        self._rows_in_order = rows == len(jobs) and place == list(range(rows))
        return slots, keys, parents, tokens  # lists: the step cache lays out this few rows on lists

    def _candidate_rows(self) -> tuple[dict[int, tuple[int, int]], np.ndarray | list[int], int]:
        """Requests that can advance from each row's best log-probs (the graph's TopK) instead of all V: the plain greedy
        ones first (`_greedy_jobs`, GREEDY_CANDIDATES each), then beam requests: {beam job id: (first, end) in the
        candidate rows}, the candidate rows, candidates per row."""
        spans: dict[int, tuple[int, int]] = {}
        greedy = [job for job in self.active if isinstance(job.searcher, GreedySearch)]
        self._greedy_jobs = [job for job in greedy if job.searcher.batchable]  # type: ignore[union-attr]
        self._greedy_left_out = len(self._greedy_jobs) < len(greedy)
        row_ids = [job.row_ids[:1] for job in self._greedy_jobs]
        filled = len(row_ids)
        count = GREEDY_CANDIDATES if filled else 0
        for job in self.active:
            needed = job.searcher.candidates_needed if isinstance(job.searcher, BeamSearch) else 0
            if needed:
                spans[job.job_id] = (filled, filled + len(job.row_ids))
                filled += len(job.row_ids)
                row_ids.append(job.row_ids)
                count = max(count, needed)
        if filled <= PYTHON_PLACEMENT_ROWS:  # the few-row layout's lists, kept a list: no numpy call
            return spans, [row for ids in row_ids for row in (ids if isinstance(ids, list) else ids.tolist())], count
        return spans, np.concatenate(row_ids), count

    def _arrange(self, slots: np.ndarray | list[int], keys: np.ndarray | list[int], parents: np.ndarray | list[int],
                 tgt_ids: np.ndarray | list[int], candidate_rows: np.ndarray | list[int], candidate_count: int) -> None:  # fmt: skip
        arranging, copied = time.perf_counter(), self._cache.slots_copied
        self._cache.arrange(parents, tgt_ids, keys, slots, self._pool.cross, self._pool.src_mask, candidate_rows, candidate_count)
        self.profile.slots_copied += self._cache.slots_copied - copied
        self._arranged(arranging)

    def _arrange_in_place(self) -> None:
        """The last step's rows again, each fed the token its request chose (what `_row_inputs` would lay out
        for the same greedy requests: every row continues in its place)."""
        arranging = time.perf_counter()
        tokens = [job.searcher.next_token for job in self.active]  # type: ignore[union-attr]
        if not self._rows_in_order:  # a leave moved a row into a hole: each token goes to its request's row
            by_row = np.empty(len(tokens), dtype=np.int64)
            by_row[np.concatenate([job.row_ids for job in self.active])] = tokens
            tokens = by_row  # type: ignore[assignment]
        if self._greedy_left_out:  # a greedy request's forced prefix may have ended: its row joins the candidate rows
            _, candidate_rows, candidate_count = self._candidate_rows()
            self._cache.want_candidates(candidate_rows, candidate_count)
        self._cache.continue_in_place(tokens)
        self._arranged(arranging)

    def _arranged(self, arranging: float) -> None:
        """Both layout paths: the time they took, and the call's rows and padding for the observer."""
        self.profile.arrange_s += time.perf_counter() - arranging
        self._last_rows = self._cache.rows
        if self.observer is not None:  # only the metrics read it
            self._last_padding = self._cache.padding_ratio()

    def _run_decoder(self) -> np.ndarray:
        decoding = time.perf_counter()
        log_probs = self._cache.run()
        self.profile.decode_s += time.perf_counter() - decoding
        return log_probs

    def _advance(self, log_probs: np.ndarray, candidate_jobs: dict[int, tuple[int, int]]) -> None:
        greedy = self._advance_greedy()
        candidate_log_probs, candidate_ids = self._cache.candidate_items()
        still_active = []
        for job in self.active:
            searcher = job.searcher
            assert searcher is not None
            if job.job_id in greedy:
                local_parents = greedy[job.job_id]
            elif job.job_id in candidate_jobs:
                first, end = candidate_jobs[job.job_id]
                local_parents = searcher.advance_candidates(candidate_log_probs[first:end], candidate_ids[first:end])  # type: ignore[attr-defined]
            else:
                local_parents = searcher.advance(log_probs[job.row_ids])
            job.steps += 1
            if job.steps == 1:
                job.first_token_at = time.perf_counter()
            if local_parents is None:
                self._finish(job, Outcome.OK)
            else:
                job.local_parents, job.rows = local_parents, len(local_parents)
                if job.on_tokens is not None:
                    notify(job.on_tokens, job, searcher.next_tokens)
                still_active.append(job)
        # Every request advanced from the graph's TopK is a greedy one: the common steady case needs no look at each.
        all_greedy = len(greedy) == len(still_active) or all(isinstance(job.searcher, GreedySearch) for job in still_active)
        steady = len(still_active) == len(self.active) and all_greedy
        self._steady_greedy_jobs = len(still_active) if steady else 0
        self._greedy_states = None
        none_left = len(still_active) == len(self.active)
        self._steady_beam_jobs = len(still_active) if none_left and not steady and self._all_steady_beams(still_active) else 0
        self._beam_states = None
        self._keep_active(still_active)

    def _keep_active(self, jobs: list[Job]) -> None:
        """After a step: the requests that go on; with none, the caches are dropped (their buffers kept up to a bound)."""
        self.active = jobs
        if not self.active:
            self._cache.clear()
            self._pool.clear()

    @staticmethod
    def _all_steady_beams(jobs: list[Job]) -> bool:
        """Whether every request is a beam search advancing from the graph's TopK with as many rows as places: the next
        step, if the requests stay, lays each request's rows over its own places (a compiled steady beam step)."""
        return bool(jobs) and all(isinstance(job.searcher, BeamSearch) and job.searcher.candidates_needed > 0
                                  and len(job.local_parents) == len(job.row_ids) for job in jobs)  # fmt: skip

    def _advance_greedy(self) -> dict[int, np.ndarray | None]:
        """Plain greedy requests advance together from the graph's TopK of their rows, read as lists: no numpy call per
        request, and none over all V. A greedy request left out of the candidate rows (its forced prefix not yet
        consumed, or a processor that edits any token) advances through `Searcher.advance` like any other."""
        jobs = self._greedy_jobs
        if not jobs:
            return {}
        values, ids, stride = self._cache.first_candidates(len(jobs))
        chosen = advance_greedy_candidates([job.searcher for job in jobs], values, ids, stride)  # type: ignore[misc]
        return {job.job_id: result for job, result in zip(jobs, chosen, strict=True)}

    def _max_length(self, job: Job) -> int:
        return job.options.max_length(len(job.src_ids), self.config.max_positions)

    def _finish(self, job: Job, outcome: Outcome, error: BaseException | None = None) -> None:
        job.outcome, job.error, job.finished_at = outcome, error, time.perf_counter()
        with self._load_lock:
            self._load -= job.options.beam_size
        if outcome is Outcome.OK and job.searcher is not None:
            job.hypotheses = job.searcher.hypotheses()
        if job.slot >= 0:
            self._pool.release(job.slot)
            job.slot = -1
        job.done.set()
        if job.on_done is not None:
            notify(job.on_done, job)

    # ------------------------------------------------------------ caches

    def _reset_cache(self) -> None:
        self._cache.reset()

    def _encode(self, jobs: list[Job]) -> None:
        """Encode in groups of similar length: an encoder call costs its padded size, so one long
        source would make every short one in its call pay for the long one's length."""
        self._pool.fit(max(len(job.src_ids) for job in [*self.active, *jobs]) + 1)  # + EOS
        for group in length_groups(jobs):
            self._encode_group(group)

    def _encode_group(self, jobs: list[Job]) -> None:
        config = self.config
        ids, mask = pad_sources([job.src_ids for job in jobs], config.pad_id, config.eos_id)
        encoding = time.perf_counter()
        cross = self.runtime.encode(ids, mask)
        seconds = time.perf_counter() - encoding
        self.profile.encode_s += seconds
        if self.observer is not None:
            self.observer.encoded(seconds)
        for job, slot in zip(jobs, self._pool.store(cross, mask), strict=True):
            job.slot = slot
