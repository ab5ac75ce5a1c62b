"""Every Prometheus metric of the server, defined once: prefix nmt_, base units, few labels.

Each server owns its registry (tests run several servers in one process); process and Python
collectors are registered on it too. Every metric about requests, engines or a model carries a
`model` label; the engine and scheduler report through a ModelMetrics (observer calls bound to one
model, server/models/model_metrics.py), so neither imports prometheus_client.
"""

from __future__ import annotations

import contextvars
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import onnxruntime as ort
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, start_http_server
from prometheus_client.exposition import generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from nmt_serve.server.models.access_log import AccessLog
from nmt_serve.runtime.ort_step import available_providers
from nmt_serve.server.models.model_metrics import ModelMetrics

# No <name>_created series: a counter's or histogram's creation time, one more series per label set, that no query
# here reads (Prometheus 2.x ingests them as plain gauges). prometheus_client's switch is process-wide.
disable_created_metrics()
# The commit the image was built from (Dockerfile: ARG REVISION); empty where unknown. Build metadata, not a setting.
BUILD_COMMIT_VARIABLE = "NMT_BUILD_COMMIT"

# The documented latency objective: 99% of single-sentence requests within 0.5 s on the default
# model (measured p99 at 70% load on 1 core: 0.28 s, bench/results/engine.md). 0.5 is a bucket edge.
LATENCY_SLO_SECONDS = 0.5
# Requests: from a 20 ms greedy sentence to the 30 s default deadline.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, LATENCY_SLO_SECONDS, 1.0, 2.5, 5.0, 10.0, 30.0)
# Decoder steps and encoder calls: 0.2 ms (one row, int8) to 50+ ms (hundreds of rows).
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# The model label of calls answered before a served model was known: refused at arrival or for their token,
# a message that never came, or a model name not served (a name a client sends never becomes a label value).
UNATTRIBUTED = ""
# The transport label of nmt_requests and nmt_request_duration_seconds: "grpc" unless the HTTP API set it for its call
# (a context variable, so the service and the interceptors count a call without being told which transport carried it).
TRANSPORTS = ("grpc", "http")
TRANSPORT: contextvars.ContextVar[str] = contextvars.ContextVar("transport", default=TRANSPORTS[0])


def build_labels() -> dict[str, str]:
    """nmt_build_info's labels: the installed nmt-serve's version, the commit where known, onnxruntime's version and the
    providers it offers on this host (nmt_model_info says which one each model runs on)."""
    try:
        installed = version("nmt-serve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = ""
    return {"version": installed, "commit": os.environ.get(BUILD_COMMIT_VARIABLE, ""), "onnxruntime": ort.__version__,
            "providers": ",".join(available_providers())}


class Metrics:
    def __init__(self, access_log: AccessLog | None = None) -> None:
        self.access_log = access_log
        # (method, code, model, transport) -> the request counter's and duration histogram's children: labels() validates
        # and locks on every call, and every finished call passes through answered() on the event loop.
        self._request_series: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        registry = self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        model = ["model"]
        self.requests = Counter("nmt_requests", "Finished RPCs by method, gRPC status code, model and transport.",
                                ["method", "code", "model", "transport"],
                                registry=registry)  # fmt: skip
        self.request_duration = Histogram("nmt_request_duration_seconds", "RPC time from arrival to answer.", ["method", "model", "transport"],
                                          buckets=REQUEST_BUCKETS, registry=registry)  # fmt: skip
        self.queue_wait = Histogram("nmt_queue_wait_seconds", "Time from admission to joining the batch (encoded).", model,
                                    buckets=REQUEST_BUCKETS, registry=registry)  # fmt: skip
        self.time_to_first_token = Histogram("nmt_time_to_first_token_seconds", "Time from admission to the first chosen token.", model,
                                             buckets=REQUEST_BUCKETS, registry=registry)  # fmt: skip
        self.input_tokens = Histogram("nmt_input_tokens", "Source tokens per text.", model, buckets=TOKEN_BUCKETS, registry=registry)
        self.output_tokens = Histogram("nmt_output_tokens", "Tokens of the best hypothesis per text.", model, buckets=TOKEN_BUCKETS,
                                       registry=registry)  # fmt: skip
        self.encode_duration = Histogram("nmt_encode_duration_seconds", "Encoder calls (all sources joining at one step).", model,
                                         buckets=STEP_BUCKETS, registry=registry)  # fmt: skip
        self.step_duration = Histogram("nmt_decode_step_duration_seconds", "Whole engine steps: joins, decoder call, search.", model,
                                       buckets=STEP_BUCKETS, registry=registry)  # fmt: skip
        self.batch_rows = Histogram("nmt_batch_rows", "Rows (beams included) in one decoder call.", model, buckets=ROW_BUCKETS,
                                    registry=registry)  # fmt: skip
        self.padding_ratio = Histogram("nmt_padding_ratio", "Share of the decoder call's past K/V slots that are padding.", model,
                                       buckets=RATIO_BUCKETS, registry=registry)  # fmt: skip
        self.generated_tokens = Counter("nmt_generated_tokens", "Tokens chosen by the decoder, beams included.", model, registry=registry)
        self.queue_depth = Gauge("nmt_queue_depth", "Admitted requests waiting to join the batch.", model, registry=registry)
        self.active_requests = Gauge("nmt_active_requests", "Requests in the batch.", model, registry=registry)
        self.rejected = Counter("nmt_rejected", "Calls refused before admission, by reason; a call counts once, however many texts it holds.",
                                ["reason", "model"], registry=registry)  # fmt: skip
        # Not per model: the drain stops the whole server under them.
        self.cut_off = Counter("nmt_cut_off_calls", "Calls still running when the SIGTERM grace period ended; the server stopped under them.",
                               registry=registry)  # fmt: skip
        # Not per model: the pool's workers step every model's engines.
        self.burst_pauses = Counter("nmt_burst_engine_pauses", "Times the engines started no step for a burst of arrivals "
                                    "(--burst-pause), each until the burst was over, at most 0.5 s.", registry=registry)  # fmt: skip
        self.http_unparsed = Counter("nmt_http_unparsed_requests", "HTTP requests aiohttp could not parse, answered 400 before any route "
                                     "(their method and path are unknown).", registry=registry)  # fmt: skip
        self.engine_failures = Counter("nmt_engine_failures", "ONNX Runtime calls that failed (their requests got INTERNAL).", model,
                                       registry=registry)  # fmt: skip
        self.cache_hits = Counter("nmt_cache_hits", "Sentences answered from the translation cache.", model, registry=registry)
        self.cache_misses = Counter("nmt_cache_misses", "Sentences looked up in the translation cache and not found.", model,
                                    registry=registry)  # fmt: skip
        self.cache_evictions = Counter("nmt_cache_evictions", "Entries dropped from the translation cache to make room.", model,
                                       registry=registry)  # fmt: skip
        self.cache_bytes = Gauge("nmt_cache_bytes", "Bytes the model's entries count against the translation cache's budget.", model,
                                 registry=registry)  # fmt: skip
        self.model_info = Info("nmt_model", "A served model.", model, registry=registry)
        self.self_check_diff = Gauge("nmt_self_check_max_log_prob_diff", "Largest |log-prob difference| of the model dir's self-check "
                                     "references on this host at start, against the exporting host's (-1: not checked).", model,
                                     registry=registry)  # fmt: skip
        self.self_check_bound = Gauge("nmt_self_check_bound", "The model dir's bound on nmt_self_check_max_log_prob_diff (-1: not checked).",
                                      model, registry=registry)  # fmt: skip
        self.build_info = Gauge("nmt_build_info", "Always 1: what this process runs (nmt-serve version, commit, onnxruntime, its providers).",
                                list(build_labels()), registry=registry)  # fmt: skip
        self.build_info.labels(**build_labels()).set(1)

    def for_model(self, model: str) -> ModelMetrics:
        """The observer calls of one served model (its engines, scheduler and self-check)."""
        return ModelMetrics(self, model)

    def rejected_for(self, reason: str, model: str = UNATTRIBUTED) -> None:
        self.rejected.labels(reason=reason, model=model).inc()

    def refused(self, method: str, seconds: float) -> None:
        """A call the bearer-token check turned away (server/api/auth.py)."""
        self.answered(method, "UNAUTHENTICATED", seconds)

    def answered(self, method: str, code: str, seconds: float, texts: int | None = None, model: str = UNATTRIBUTED) -> None:
        """Every finished call passes here (the service, the early refusals, the token and deadline checks):
        counted, and written to the access log when the server keeps one."""
        key = (method, code, model, TRANSPORT.get())
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (self.requests.labels(method=method, code=code, model=model, transport=key[3]),
                                                  self.request_duration.labels(method=method, model=model, transport=key[3]))  # fmt: skip
        series[0].inc()
        series[1].observe(seconds)
        if self.access_log is not None:
            self.access_log.record(method, code, seconds, texts, model, key[3])

    # ------------------------------------------------------------ exposition

    def serve(self, host: str, port: int) -> tuple[object, int]:
        """Starts the /metrics HTTP endpoint on its own thread; returns (server, bound port)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    def names(self) -> set[str]:
        """Every sample name the server can export, including label sets not seen yet (for dashboard checks)."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",), "gauge": ("",),
                    "summary": ("_sum", "_count")}  # fmt: skip
        return {family.name + suffix for family in self.registry.collect() for suffix in suffixes.get(family.type, ("",))}
