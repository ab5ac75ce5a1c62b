"""A request and a step as the engine tracks them: the Job and its Outcome, the engine's limits, the StepProfile."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nmt_serve.model.search import Hypothesis, Searcher, SearchOptions


class Outcome(enum.Enum):
    OK = "ok"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"
    OUT_OF_MEMORY = "out of memory"


@dataclass
class Job:
    """One request inside the engine. `done` is set once `outcome` (and `hypotheses` or `error`) is final."""

    job_id: int
    src_ids: list[int]
    options: SearchOptions
    deadline: float | None  # time.monotonic() seconds; None = no deadline
    on_tokens: Callable[[Job, np.ndarray], None] | None = None  # greedy streaming: the row's new token
    searcher: Searcher | None = None
    slot: int = -1  # row of the cross-K/V pool holding this request's source
    rows: int = 0  # rows in the next decoder call
    local_parents: list[int] = field(default_factory=list)  # rows continued, local
    # Its rows in the last decoder call, local order: a list where the call had at most PYTHON_PLACEMENT_ROWS rows.
    row_ids: np.ndarray | list[int] = field(default_factory=list)
    steps: int = 0
    cancel_requested: bool = False
    outcome: Outcome | None = None
    hypotheses: list[Hypothesis] = field(default_factory=list)
    error: BaseException | None = None
    finished_at: float = 0.0  # time.perf_counter() when the outcome was set
    submitted_at: float = field(default_factory=time.perf_counter)
    joined_at: float = 0.0  # perf_counter() once encoded and in the batch; 0 = never joined
    first_token_at: float = 0.0  # perf_counter() after its first decoder step
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[Job], None] | None = None


@dataclass
class StepProfile:
    """Where step time goes, summed over steps: ONNX Runtime (encoder, decoder), cache moves, search (numpy + Python), the rest."""

    steps: int = 0
    total_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    arrange_s: float = 0.0
    search_s: float = 0.0
    slots_copied: int = 0  # cache slots (one row's K and V of every layer at one position) the moves copied

    def __add__(self, other: StepProfile) -> StepProfile:
        return StepProfile(**{name: value + getattr(other, name) for name, value in vars(self).items()})

    def __sub__(self, earlier: StepProfile) -> StepProfile:
        """What was added since `earlier` (a copy of this profile taken before)."""
        return StepProfile(**{name: value - getattr(earlier, name) for name, value in vars(self).items()})

    def shares(self) -> dict[str, float]:
        total = max(self.total_s, 1e-12)
        other = self.total_s - self.encode_s - self.decode_s - self.arrange_s - self.search_s
        return {"encoder run": self.encode_s / total, "decoder run": self.decode_s / total, "search": self.search_s / total,
                "cache moves (beam reorders, rows leaving)": self.arrange_s / total, "batching bookkeeping": other / total}  # fmt: skip


@dataclass(frozen=True)
class EngineLimits:
    max_rows: int = 256  # rows (beams included) in one decoder call
    max_cache_tokens: int = 256 * 128  # rows x past length kept as K/V: bounds cache memory
    # Newcomers join a running batch together: once `join_group` are waiting, or the oldest has waited
    # `join_wait_steps` steps (0: at the next step). Every join stalls the running requests for an encoder
    # call and a new row layout, so near saturation joining in groups keeps the long requests' tail down
    # (measured in the README), for a few steps of wait. A cancelled or expired newcomer is dropped when it
    # would have joined.
    join_wait_steps: int = 0
    join_group: int = 4
