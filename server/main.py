"""nmt-serve: load and verify model dirs, serve them over gRPC with health and reflection, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nmt_serve.runtime.manifest import ModelDirError
from nmt_serve.runtime.ort_step import available_providers
from nmt_serve.runtime.self_check import SelfCheckError
from nmt_serve.server.api.admission import EarlyAdmission
from nmt_serve.server.api.arrivals import ArrivalClock
from nmt_serve.server.api.auth import BearerTokenInterceptor
from nmt_serve.server.api.burst_hold import BurstHold
from nmt_serve.server.api.drain import stop_accepting
from nmt_serve.server.api.fault_logs import quiet_transport_faults
from nmt_serve.server.api.http_server import HttpServer
from nmt_serve.server.api.reflection import add_reflection
from nmt_serve.server.api.request_deadline import RequestDeadline
from nmt_serve.server.api.request_ids import RequestIds
from nmt_serve.server.api.service import QUEUED_METHODS, SERVICE_NAME, TranslationService, transport_receive_limit
from nmt_serve.server.engine.workers import available_cores, plan_workers
from nmt_serve.server.models.access_log import AccessLog
from nmt_serve.server.models.log_format import configure_logging
from nmt_serve.server.models.metrics import Metrics
from nmt_serve.server.models.preparation import share_the_gil
from nmt_serve.server.models.registry import HostCheckRefused, ModelSetError, load_models
from nmt_serve.server.settings import ServerSettings, parse_settings
from nmt_serve.server.startup import USAGE_ERROR, StartupError, check_model_dirs, check_ports, listen_error, probe

logger = logging.getLogger("nmt-serve")

OVERALL = ""  # grpc.health.v1's name for the whole server
# A draining server stops once no call has reached a handler for this long (handlers caught up with arrivals),
# waiting at most DRAIN_QUIET_MAX_S: a balancer keeps sending to a replica until its port closes.
DRAIN_QUIET_S = 0.05
DRAIN_QUIET_MAX_S = 2.0
# The longest wait for calls cut off at the end of the grace period, and for the held refusals, to be answered.
CUT_OFF_ANSWER_S = 1.0
RELEASE_S = 1.0


class Server:
    """One process: the models (runtimes, engines on one worker pool), gRPC server; `run` returns when a drain has finished."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        quiet_transport_faults()
        share_the_gil()  # the event loop gets the GIL back within 1 ms from request preparation (server/models/preparation.py)
        providers = tuple(p for p in settings.providers.split(",") if p) or tuple(available_providers())
        plan = plan_workers(settings.engines, settings.threads, providers[0] == "CUDAExecutionProvider", available_cores(), settings.max_rows)
        self.metrics = Metrics(AccessLog() if settings.access_log else None)
        self.models = load_models(settings, plan, providers, self.metrics)
        logger.info("%d model(s) (%s), each with %d engine(s) of up to %d rows per step; %d worker(s) step them all, %s ONNX Runtime "
                    "thread(s) per session", len(self.models), ", ".join(self.models.names), plan.engines, plan.max_rows, plan.engines,
                    plan.threads or "default")  # fmt: skip
        # The default model's runtime, and every model's schedulers as one (the drain and the early admission ask them).
        self.runtime = self.models.default.runtime
        self.scheduler = self.models.schedulers
        self.health = health.aio.HealthServicer()
        self.service = TranslationService(self.models, settings, self.metrics)
        self.port = 0
        self.metrics_port = 0
        self.http: HttpServer | None = None  # the HTTP/JSON API (--http-port), started with the gRPC server
        self._metrics_server: Any = None
        self.serving = threading.Event()  # set once health says SERVING (scripts and tests wait on it)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.arrivals = ArrivalClock()
        self.burst_hold = BurstHold(self.scheduler, math.ceil(settings.burst_hold_share * settings.max_queued_requests),
                                    engines=self.scheduler.pool if settings.burst_pause else None, on_pause=self.metrics.burst_pauses.inc)
        self.admission = EarlyAdmission(self.scheduler, QUEUED_METHODS, self.metrics, max_hold_s=DRAIN_QUIET_MAX_S + 1,
                                        burst_hold=self.burst_hold)

    def request_stop(self) -> None:
        """Start the drain, from any thread (what SIGTERM does); nothing once the server has stopped."""
        if self._stop is not None:
            self.call_soon(self._stop.set)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Runs `callback` on the server's event loop, from any thread; nothing once the server has stopped."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback)

    async def _set_health(self, status: int) -> None:
        for name in (OVERALL, SERVICE_NAME, *(model.health_name for model in self.models)):
            await self.health.set(name, status)

    def _build(self) -> grpc.aio.Server:
        settings = self.settings
        # The token check's refusals read no request (server/api/auth.py); the calls it lets through read theirs under
        # the request deadline.
        interceptors: list[grpc.aio.ServerInterceptor] = [self.arrivals, RequestDeadline(settings.max_deadline_s, self.metrics.answered)]
        interceptors.insert(1, self.admission)
        interceptors.insert(0, RequestIds())  # first: the refusals of the others carry the call's request id too
        if settings.auth_token:
            interceptors.append(BearerTokenInterceptor(settings.auth_token, self.metrics.refused))
        # Above --max-message-bytes: the handlers answer a message between the two limits, and count it (server/api/service.py).
        options = [("grpc.max_receive_message_length", transport_receive_limit(settings.max_message_bytes)), ("grpc.so_reuseport", 0)]
        if settings.max_connection_age_s > 0:
            # The grace lets every call on the old connection run to the longest deadline any call can have.
            options += [("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(settings.max_deadline_s * 1000))]  # fmt: skip
        server = grpc.aio.server(interceptors=interceptors, options=options)
        server.add_generic_rpc_handlers([self.service.handler()])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        add_reflection(server, [SERVICE_NAME, health.SERVICE_NAME])
        address = f"{settings.host}:{settings.port}"
        try:
            if settings.tls_cert:
                credentials = grpc.ssl_server_credentials([(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())])
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as error:  # grpcio says only "Failed to bind"; a probe finds out why
            raise listen_error("--port", settings, probe(settings.host, settings.port) or error) from None
        return server

    async def run(self, install_signals: bool = True) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = self._build()
        try:
            await self._listen(server)
        except BaseException:
            await server.stop(None)  # stopped on this loop, not left for a collector that finds the loop closed
            self._stop_metrics()
            raise
        if install_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._stop.set)
        logger.info("listening on %s:%d (%s); warming up", self.settings.host, self.port, "TLS" if self.settings.tls_cert else "plaintext")
        # Warm-up runs ONNX Runtime, so it stays off the event loop; health says NOT_SERVING meanwhile.
        for model in self.models:
            await asyncio.to_thread(model.runtime.warm_up)
        # Objects made at start-up (modules, sessions, the tokenizer) live as long as the process: frozen,
        # the cyclic collector stops walking them, so a full collection no longer pauses every row of the
        # batch (measured: ~40k tracked objects after warm-up, a full collection 30 ms before, 0.002 ms after).
        gc.freeze()
        self.scheduler.start()
        if not self._stop.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            if self.settings.port_file:
                Path(self.settings.port_file).write_text(str(self.port), encoding="utf-8")
            logger.info("serving %s on port %d", ", ".join(f"{model.name} ({model.runtime.manifest.precision}, {model.runtime.provider})"
                                                        for model in self.models), self.port)  # fmt: skip
            self.serving.set()
        await self._stop.wait()
        await self.drain(server)

    async def _listen(self, server: grpc.aio.Server) -> None:
        """Metrics, gRPC, then HTTP: a port that cannot be listened on ends in StartupError naming its flag."""
        settings = self.settings
        if settings.metrics_port >= 0:
            try:
                self._metrics_server, self.metrics_port = self.metrics.serve(settings.metrics_host, settings.metrics_port)
            except OSError as error:
                raise listen_error("--metrics-port", settings, error) from None
            logger.info("metrics on http://%s:%d/metrics", settings.metrics_host, self.metrics_port)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if settings.http_port:
            self.http = HttpServer(self.service, settings, self.metrics, self.serving.is_set, self.admission)
            try:
                await self.http.start()
            except OSError as error:
                raise listen_error("--http-port", settings, error) from None
            logger.info("HTTP API on http://%s:%d/ (docs at /openapi.json)", settings.http_host, self.http.port)

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    async def drain(self, server: grpc.aio.Server) -> None:
        """Health NOT_SERVING at once; new calls UNAVAILABLE at once, or with a settle period (--drain-settle-s) no new
        connections at once and new calls served until it ends; in-flight calls get the grace period."""
        logger.info("draining: %d requests in flight, grace %.0f s", self.scheduler.in_flight, self.settings.grace_s)
        self.serving.clear()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.settings.drain_settle_s > 0:
            # Behind a balancer: it moves away on NOT_SERVING or on a refused connection (server/api/drain.py), and calls it
            # sent before it did are served, where an UNAVAILABLE would reach a client that does not retry.
            closed = await stop_accepting(self.port)
            logger.info("port %d refuses new connections (%d listener(s) closed); serving calls on open connections for %.3g s",
                        self.port, closed, self.settings.drain_settle_s)  # fmt: skip
            await asyncio.sleep(self.settings.drain_settle_s)
        self.scheduler.draining = True
        self.burst_hold.release()  # calls waiting for a burst to end go on now, and are answered as draining
        # Keep the port open while admitted requests finish: calls arriving meanwhile get our UNAVAILABLE
        # ("shutting down", retryable) instead of grpcio cancelling them mid-shutdown.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.grace_s
        while self.scheduler.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        # Calls still running now are answered UNAVAILABLE (retryable) by their handlers, not left for grpcio's stop,
        # which would cancel them (CANCELLED at the client).
        cut_off = self.service.cut_off() if loop.time() >= deadline else 0
        if cut_off:
            self.metrics.cut_off.inc(cut_off)
            logger.warning("grace period of %.3g s over: %d call(s) still running cut off (answered UNAVAILABLE)", self.settings.grace_s, cut_off)
            answered_by = loop.time() + CUT_OFF_ANSWER_S
            while self.service.calls_running and loop.time() < answered_by:
                await asyncio.sleep(0.005)
        # The HTTP server stops first (its calls were refused with 503 since the scheduler began draining, like gRPC's):
        # its stop can take up to a second, which must not fall inside the last phase below.
        if self.http is not None:
            await self.http.stop()
        # grpc core ends CANCELLED a call it holds unhanded when the server stops, and one that reaches it on an open
        # connection after the stop, before the client has read the GOAWAY (grpc/grpc#41785). So: refusals are held
        # (server/api/admission.py) until no call has reached a handler for DRAIN_QUIET_S; a client whose call is held
        # sends nothing. Then the stop begins (GOAWAY on every connection, the port closed), and only then are the held
        # refusals answered: on each connection the GOAWAY goes out before the UNAVAILABLE, so a client that retries at
        # once, however short its back-off, sends its retry to a closed port (UNAVAILABLE), never into the stop.
        quiet_until = min(deadline, loop.time() + DRAIN_QUIET_MAX_S)
        self.admission.hold()
        while self.arrivals.quiet_for() < DRAIN_QUIET_S and loop.time() < quiet_until:
            await asyncio.sleep(DRAIN_QUIET_S / 5)
        logger.info("stopping the gRPC server; last call arrived %.3f s ago", self.arrivals.quiet_for())
        # The held refusals are still to be answered: the stop's grace covers them even when the drain's is over.
        stopped = asyncio.create_task(server.stop(max(deadline - loop.time(), RELEASE_S)))
        await asyncio.sleep(0)  # the stop task runs until its first wait: grpc core has begun the stop
        await self.admission.release(RELEASE_S)
        await stopped
        self.scheduler.stop()
        self._stop_metrics()
        logger.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 2 for a command line that names something unusable, 1 for a runtime failure, each with one line on stderr."""
    try:
        settings = parse_settings(argv)
        check_model_dirs(settings)
        check_ports(settings)
    except ValueError as error:
        return fail(StartupError(str(error), USAGE_ERROR))
    except StartupError as error:
        return fail(error)
    configure_logging(settings.log_level, settings.log_format)
    try:
        server = Server(settings)
    except (ModelDirError, ModelSetError, FileNotFoundError, PermissionError, SelfCheckError, HostCheckRefused) as error:
        logger.error("cannot serve %s: %s", ", ".join(map(str, settings.model_dirs)), error)
        return 1
    except Exception as error:  # an ONNX Runtime load failure names the file inside its message
        logger.error("cannot load %s: %s", ", ".join(map(str, settings.model_dirs)), error)
        return 1
    try:
        asyncio.run(server.run())
    except StartupError as error:  # a port taken between the check and the bind
        return fail(error)
    return 0


def fail(error: StartupError) -> int:
    sys.stderr.write(f"nmt-serve: {error}\n")
    return error.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
