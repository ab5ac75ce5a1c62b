"""One served model's view of the server's metrics: the observer calls of its engines, scheduler and self-check."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # metrics.py hands out these views, so it imports this module
    from nmt_serve.server.models.metrics import Metrics


class ModelMetrics:
    """The model's children of the labelled metrics, made once: the engine observes every step through them."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        self.queue_wait = metrics.queue_wait.labels(model=model)
        self.time_to_first_token = metrics.time_to_first_token.labels(model=model)
        self.input_tokens = metrics.input_tokens.labels(model=model)
        self.output_tokens = metrics.output_tokens.labels(model=model)
        self.encode_duration = metrics.encode_duration.labels(model=model)
        self.step_duration = metrics.step_duration.labels(model=model)
        self.batch_rows = metrics.batch_rows.labels(model=model)
        self.padding_ratio = metrics.padding_ratio.labels(model=model)
        self.generated_tokens = metrics.generated_tokens.labels(model=model)
        self.engine_failures = metrics.engine_failures.labels(model=model)
        self.cache_hits = metrics.cache_hits.labels(model=model)
        self.cache_misses = metrics.cache_misses.labels(model=model)
        self.cache_evictions = metrics.cache_evictions.labels(model=model)
        self.cache_bytes = metrics.cache_bytes.labels(model=model)
        self.checked_host(-1.0, -1.0)

    def describe(self, version: str, precision: str, provider: str) -> None:
        self.metrics.model_info.labels(model=self.model).info({"version": version, "precision": precision, "provider": provider})

    def checked_host(self, max_log_prob_diff: float, bound: float) -> None:
        self.metrics.self_check_diff.labels(model=self.model).set(max_log_prob_diff)
        self.metrics.self_check_bound.labels(model=self.model).set(bound)

    def watch_queue(self, depth: Callable[[], float], active: Callable[[], float]) -> None:
        """Gauges read at scrape time, so the engine thread never touches them."""
        self.metrics.queue_depth.labels(model=self.model).set_function(depth)
        self.metrics.active_requests.labels(model=self.model).set_function(active)

    def encoded(self, seconds: float) -> None:
        self.encode_duration.observe(seconds)

    def stepped(self, seconds: float, rows: int, padding_ratio: float) -> None:
        self.step_duration.observe(seconds)
        self.batch_rows.observe(rows)
        self.padding_ratio.observe(padding_ratio)
        self.generated_tokens.inc(rows)

    def engine_failed(self) -> None:
        self.engine_failures.inc()

    def cache_looked_up(self, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).inc()

    def cache_evicted(self) -> None:
        self.cache_evictions.inc()

    def cache_resized(self, delta_bytes: int) -> None:
        self.cache_bytes.inc(delta_bytes)

    def finished_job(self, queue_wait_s: float | None, first_token_s: float | None, input_tokens: int, output_tokens: int | None) -> None:
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s)
        if first_token_s is not None:
            self.time_to_first_token.observe(first_token_s)
        self.input_tokens.observe(input_tokens)
        if output_tokens is not None:
            self.output_tokens.observe(output_tokens)
