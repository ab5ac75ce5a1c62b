"""The gRPC servicer: parse, choose the model (server/models/registry.py), hand the request to it; errors via server/api/status.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.arrivals import ARRIVED
from nmt_serve.server.api.error_details import abort
from nmt_serve.server.api.status import MessageTooLarge, NotReady, status_for
from nmt_serve.server.engine.scheduler import Rejected
from nmt_serve.server.models.metrics import UNATTRIBUTED, Metrics
from nmt_serve.server.models.registry import ModelRegistry
from nmt_serve.server.models.requests import InvalidRequest
from nmt_serve.server.models.served_model import ServedModel
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TranslationService"].full_name
# The methods that take a place in the scheduler's queue (server/api/admission.py refuses them early when it is full).
QUEUED_METHODS = frozenset(f"/{SERVICE_NAME}/{method}" for method in ("Translate", "TranslateStream"))
# A call still running when a drain's grace period ends: retryable on another replica.
CUT_OFF = "server is shutting down: the grace period (--grace-s) ended before this call finished; retry"


# grpc core's own receive limit is this many times --max-message-bytes, at most TRANSPORT_SLACK_MAX_BYTES above it
# (what one call may hold in memory): a message between the two reaches lenient(), which answers it RESOURCE_EXHAUSTED
# naming the limit and the flag. What core refuses itself never reaches a handler as a message, only as an ended stream
# (server/api/request_deadline.py, CORE_REFUSAL); the slack keeps that to messages far past the limit.
TRANSPORT_SLACK_FACTOR = 4
TRANSPORT_SLACK_MAX_BYTES = 16 << 20
GRPC_MAX_LENGTH = (1 << 31) - 1  # grpc core's channel arguments are C ints


def transport_receive_limit(max_message_bytes: int) -> int:
    """grpc core's receive limit for a server whose messages may hold `max_message_bytes`: it bounds what one call
    holds in memory (a compressed message decompresses at most this far)."""
    slack = min((TRANSPORT_SLACK_FACTOR - 1) * max_message_bytes, TRANSPORT_SLACK_MAX_BYTES)
    return min(max_message_bytes + slack, GRPC_MAX_LENGTH)


class Unparsable:
    """Stands for a request grpcio could not parse (say, invalid UTF-8 in a string), so we can answer INVALID_ARGUMENT."""

    def __init__(self, message_type: str, problem: str) -> None:
        self.detail = f"request is not a valid {message_type}: {problem}"

    def error(self) -> Exception:
        return InvalidRequest(self.detail)


class Oversized(Unparsable):
    """A request message over --max-message-bytes (after decompression) that grpc core let through: RESOURCE_EXHAUSTED."""

    def __init__(self, message_type: str, size: int, limit: int) -> None:
        self.detail = (f"request message {message_type} has {size} bytes; the limit is {limit} bytes (max_message_bytes, set by "
                       "nmt-serve --max-message-bytes); send fewer or shorter texts per request")  # fmt: skip

    def error(self) -> Exception:
        return MessageTooLarge(self.detail)


def lenient(message_class: Any, max_bytes: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if len(data) > max_bytes:  # not parsed: its size alone answers it
            return Oversized(message_class.DESCRIPTOR.name, len(data), max_bytes)
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Unparsable(message_class.DESCRIPTOR.name, f"{error} (string fields must be valid UTF-8)")

    return parse


@dataclass
class Call:
    """What one call's answer is counted under: the model, once its name has been resolved."""

    model: str = UNATTRIBUTED


class TranslationService:
    def __init__(self, models: ModelRegistry, settings: ServerSettings, metrics: Metrics | None = None) -> None:
        self.models = models
        self.metrics = metrics
        self.settings = settings
        # The tasks of the Translate and TranslateStream handlers not yet answered; those the drain cuts off at the end of
        # its grace period (cut_off) answer UNAVAILABLE instead of being cancelled by grpcio (CANCELLED at the client).
        self._running: set[asyncio.Task[Any]] = set()
        self._cut_off: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ RPCs

    async def Translate(self, request: pb.TranslateRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.TranslateResponse:
        call = Call()

        async def answer() -> pb.TranslateResponse:
            model = self._model(self._parsed(request).model, call)
            return await model.translate(request, self._deadline(context))

        texts = len(request.texts) if isinstance(request, pb.TranslateRequest) else None
        with self._counted():
            return await self._guard("Translate", context, answer(), call, texts)

    async def TranslateStream(self, request: pb.TranslateStreamRequest | Unparsable, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TranslateStreamResponse]:
        started, code, call = time.perf_counter(), grpc.StatusCode.OK, Call()
        with self._counted():
            try:
                model = self._model(self._parsed(request).model, call)
                async for message in model.stream(request, self._deadline(context)):
                    yield message
            except asyncio.CancelledError:
                if self._was_cut_off():
                    code = grpc.StatusCode.UNAVAILABLE
                    await abort(context, code, CUT_OFF)
                code = self._cancel_code(context)
                raise
            except GeneratorExit:
                # The client went away while the stream waited at a yield, and grpcio closed the generator.
                code = self._cancel_code(context)
                raise
            except Exception as error:  # noqa: BLE001 - every failure gets a deliberate status, see server/api/status.py
                code, message = self._status(error, call)
                await abort(context, code, message)
            finally:
                self._answered("TranslateStream", code, started, call, 1 if isinstance(request, pb.TranslateStreamRequest) else None)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        call = Call()

        async def answer() -> pb.ModelInfo:
            return self._model(self._parsed(request).model, call, need_ready=False).info()

        return await self._guard("GetModelInfo", context, answer(), call)

    async def ListModels(self, request: pb.ListModelsRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        async def answer() -> pb.ListModelsResponse:
            self._parsed(request)
            return pb.ListModelsResponse(models=[model.info() for model in self.models], default_model=self.models.default.name)

        return await self._guard("ListModels", context, answer(), Call())

    # ------------------------------------------------------------ the drain

    @property
    def calls_running(self) -> int:
        """Translate and TranslateStream calls not yet answered."""
        return len(self._running)

    def cut_off(self) -> int:
        """Ends every running Translate and TranslateStream call with UNAVAILABLE (retryable; the drain's grace period is
        over); returns how many. Their requests leave the batch as a cancelled call's do."""
        for task in self._running:
            self._cut_off.add(task)
            task.cancel()
        return len(self._running)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        task = asyncio.current_task()
        if task is None:  # not on an event loop's task: nothing the drain could cut off
            yield
            return
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)
            self._cut_off.discard(task)

    def _was_cut_off(self) -> bool:
        """Whether the cancel being handled is the drain's cut_off; if so the task goes on as not cancelled (it answers)."""
        task = asyncio.current_task()
        if task is None or task not in self._cut_off:
            return False
        task.uncancel()
        return True

    # ------------------------------------------------------------ helpers

    async def _guard(self, method: str, context: grpc.aio.ServicerContext, work: Awaitable[Any], call: Call, texts: int | None = None) -> Any:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            return await work
        except ExceptionGroup as group:  # from the TaskGroup: answer with the first failure
            code, message = self._status(group.exceptions[0], call)
            await abort(context, code, message)
        except asyncio.CancelledError:
            if self._was_cut_off():
                code = grpc.StatusCode.UNAVAILABLE
                await abort(context, code, CUT_OFF)
            code = self._cancel_code(context)
            raise  # the client went away or its deadline passed: grpcio reports that itself
        except Exception as error:  # noqa: BLE001 - every failure gets a deliberate status, see server/api/status.py
            code, message = self._status(error, call)
            await abort(context, code, message)
        finally:
            self._answered(method, code, started, call, texts)

    def _status(self, error: BaseException, call: Call) -> tuple[grpc.StatusCode, str]:
        """status_for, and a refused call counted by reason (once per call, however many texts it holds)."""
        if isinstance(error, Rejected) and self.metrics is not None:
            self.metrics.rejected_for(error.reason, call.model)
        return status_for(error)

    @staticmethod
    def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED

    def _answered(self, method: str, code: grpc.StatusCode, started: float, call: Call, texts: int | None = None) -> None:
        if self.metrics is not None:
            self.metrics.answered(method, code.name, time.perf_counter() - started, texts, call.model)

    @staticmethod
    def _parsed(request: Any) -> Any:
        if isinstance(request, Unparsable):
            raise request.error()
        return request

    def _model(self, name: str, call: Call, need_ready: bool = True) -> ServedModel:
        """The model a request names (NOT_FOUND when none is served by that name), from then on the call's metrics label."""
        model = self.models.resolve(name)
        call.model = model.name
        if need_ready and not model.runtime.ready:
            raise NotReady("model is warming up; retry shortly")
        return model

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """The engine's monotonic deadline: the client's, or the server default when it sets none; never past the server
        maximum, counted from the call's arrival (its request's read took part of it)."""
        now, remaining = time.monotonic(), context.time_remaining()
        arrived = ARRIVED.get()
        arrived = now if arrived is None else arrived
        chosen = arrived + self.settings.default_deadline_s if remaining is None else now + remaining
        return min(chosen, arrived + self.settings.max_deadline_s)

    def handler(self) -> grpc.GenericRpcHandler:
        """Handlers with lenient request parsing (see Unparsable, Oversized); responses serialise as usual."""
        limit = self.settings.max_message_bytes
        handlers = {
            "Translate": grpc.unary_unary_rpc_method_handler(
                self.Translate, request_deserializer=lenient(pb.TranslateRequest, limit), response_serializer=pb.TranslateResponse.SerializeToString),
            "TranslateStream": grpc.unary_stream_rpc_method_handler(
                self.TranslateStream, request_deserializer=lenient(pb.TranslateStreamRequest, limit),
                response_serializer=pb.TranslateStreamResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, request_deserializer=lenient(pb.GetModelInfoRequest, limit), response_serializer=pb.ModelInfo.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.ListModels, request_deserializer=lenient(pb.ListModelsRequest, limit),
                response_serializer=pb.ListModelsResponse.SerializeToString),
        }  # fmt: skip
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
