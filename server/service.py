"""The gRPC servicer: validation, then domain objects, then the scheduler, then protobuf; errors via server/status.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from nmt_serve.model.search import FinishReason, Hypothesis, SearchOptions
from nmt_serve.model.sentences import join
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.metrics import Metrics
from nmt_serve.server.requests import InvalidRequest, Limits, RequestReader, Sentence, Source, Task
from nmt_serve.server.runtime import Runtime
from nmt_serve.server.scheduler import Rejected, Scheduler
from nmt_serve.server.settings import ServerSettings
from nmt_serve.server.status import NotReady, status_for

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TranslationService"].full_name
# The methods that take a place in the scheduler's queue (server/admission.py refuses them early when it is full).
QUEUED_METHODS = frozenset(f"/{SERVICE_NAME}/{method}" for method in ("Translate", "TranslateStream"))
FINISH_REASONS = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
REPLACEMENT_CHAR = "\ufffd"  # what a byte-level token that ends mid-character decodes to


class Unparsable:
    """Stands for a request grpcio could not parse (say, invalid UTF-8 in a string), so we can answer INVALID_ARGUMENT."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.detail = f"request is not a valid {message_type}: {error} (string fields must be valid UTF-8)"


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Unparsable(message_class.DESCRIPTOR.name, error)

    return parse


class TranslationService:
    def __init__(self, runtime: Runtime, scheduler: Scheduler, settings: ServerSettings, metrics: Metrics | None = None) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.scheduler = scheduler
        self.settings = settings
        self.tokenizer = runtime.tokenizer
        self.limits = Limits.from_settings(settings, runtime.config.max_positions)
        self.reader = RequestReader(runtime.tokenizer, self.limits, runtime.manifest.model_name)
        self.calls_running = 0  # Translate and TranslateStream handlers not yet answered (the drain reports those it cuts off)

    # ------------------------------------------------------------ RPCs

    async def Translate(self, request: pb.TranslateRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.TranslateResponse:
        async def answer() -> pb.TranslateResponse:
            task = self.reader.translate(self._parsed(request))
            deadline = self._deadline(context)
            # Every sentence of every text is its own job, all submitted at once so that they share batches.
            # A TaskGroup cancels the other jobs as soon as one fails, so none runs on unanswered.
            async with asyncio.TaskGroup() as group:
                jobs = [[group.create_task(self._translate_one(sentence.token_ids, self._sentence_options(task, number), deadline))
                         for number, sentence in enumerate(source.sentences)] for source in task.sources]  # fmt: skip
            translations = [pb.Translation(hypotheses=self._joined(source, [job.result() for job in text_jobs]))
                            for source, text_jobs in zip(task.sources, jobs, strict=True)]  # fmt: skip
            return pb.TranslateResponse(translations=translations, model=self.reader.model_name)

        self.calls_running += 1
        texts = len(request.texts) if isinstance(request, pb.TranslateRequest) else None
        try:
            return await self._guard("Translate", context, answer(), texts)
        finally:
            self.calls_running -= 1

    async def TranslateStream(self, request: pb.TranslateStreamRequest | Unparsable, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TranslateStreamResponse]:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        self.calls_running += 1
        try:
            task = self.reader.stream(self._parsed(request))
            source = task.sources[0]
            if source.blank:
                yield pb.TranslateStreamResponse(final=True, hypotheses=[self._hypothesis(Hypothesis((), 0.0, FinishReason.EOS))])
                return
            async for message in self._stream_sentences(source, task, self._deadline(context)):
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the client went away while the stream waited at a yield, and grpcio closed the generator.
            code = self._cancel_code(context)
            raise
        except Exception as error:  # noqa: BLE001 - every failure gets a deliberate status, see server/status.py
            code, message = self._status(error)
            await context.abort(code, message)
        finally:
            self.calls_running -= 1
            self._answered("TranslateStream", code, started, 1 if isinstance(request, pb.TranslateStreamRequest) else None)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        async def answer() -> pb.ModelInfo:
            self._parsed(request, need_ready=False)
            manifest, settings = self.runtime.manifest, self.settings
            limits = pb.Limits(
                max_texts=self.limits.max_texts, max_chars_per_text=self.limits.max_chars_per_text,
                max_source_tokens=self.limits.max_source_tokens, max_output_tokens=self.limits.max_output_tokens,
                max_beam_size=self.limits.max_beam_size, max_message_bytes=settings.max_message_bytes,
                max_queued_requests=settings.max_queued_requests, default_deadline_seconds=settings.default_deadline_s,
                max_sentences_per_text=self.limits.max_sentences_per_text,
            )  # fmt: skip
            checked = self.runtime.host_check
            host_check = pb.HostCheck() if checked is None else pb.HostCheck(
                checked=True, max_log_prob_diff=checked.max_log_prob_diff, bound=checked.bound, exported_on=checked.reference_cpu,
                checked_on=checked.cpu)  # fmt: skip
            return pb.ModelInfo(name=manifest.model_name, version=manifest.model_version, source_language=manifest.source_language,
                                target_language=manifest.target_language, precision=manifest.precision,
                                execution_provider=self.runtime.provider, limits=limits, host_check=host_check)  # fmt: skip

        return await self._guard("GetModelInfo", context, answer())

    # ------------------------------------------------------------ helpers

    async def _guard(self, method: str, context: grpc.aio.ServicerContext, work: Awaitable[Any], texts: int | None = None) -> Any:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            return await work
        except ExceptionGroup as group:  # from the TaskGroup: answer with the first failure
            code, message = self._status(group.exceptions[0])
            await context.abort(code, message)
        except asyncio.CancelledError:
            code = self._cancel_code(context)
            raise  # the client went away or its deadline passed: grpcio reports that itself
        except Exception as error:  # noqa: BLE001 - every failure gets a deliberate status, see server/status.py
            code, message = self._status(error)
            await context.abort(code, message)
        finally:
            self._answered(method, code, started, texts)

    def _status(self, error: BaseException) -> tuple[grpc.StatusCode, str]:
        """status_for, and a refused call counted by reason (once per call, however many texts it holds)."""
        if isinstance(error, Rejected) and self.metrics is not None:
            self.metrics.rejected_for(error.reason)
        return status_for(error)

    @staticmethod
    def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED

    def _answered(self, method: str, code: grpc.StatusCode, started: float, texts: int | None = None) -> None:
        if self.metrics is not None:
            self.metrics.answered(method, code.name, time.perf_counter() - started, texts)

    def _parsed(self, request: Any, need_ready: bool = True) -> Any:
        if need_ready and not self.runtime.ready:
            raise NotReady("model is warming up; retry shortly")
        if isinstance(request, Unparsable):
            raise InvalidRequest(request.detail)
        return request

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """The engine's monotonic deadline: the client's, or the server default when it sets none; never past the server maximum."""
        remaining = context.time_remaining()
        return time.monotonic() + min(self.settings.default_deadline_s if remaining is None else remaining, self.settings.max_deadline_s)

    async def _translate_one(self, token_ids: tuple[int, ...], options: SearchOptions, deadline: float) -> list[Hypothesis]:
        return await self.scheduler.translate(token_ids, options, deadline)

    @staticmethod
    def _sentence_options(task: Task, number: int) -> SearchOptions:
        """The target prefix starts the text, so only its first sentence is forced to it."""
        if number == 0 or not task.options.target_prefix:
            return task.options
        return dataclasses.replace(task.options, target_prefix=())

    async def _stream_sentences(self, source: Source, task: Task, deadline: float) -> AsyncIterator[pb.TranslateStreamResponse]:
        """Every sentence runs at once; greedy sends each one's text in order, the original whitespace between them.

        Beam search sends nothing before the joined n-best (a beam's best row can change every step).
        """
        streaming = task.options.beam_size == 1
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in source.sentences]
        pumps = [asyncio.create_task(self._pump(sentence, self._sentence_options(task, number), deadline, queue))
                 for number, (sentence, queue) in enumerate(zip(source.sentences, queues, strict=True))]  # fmt: skip
        try:
            nbests: list[list[Hypothesis]] = []
            # Text owed to the client: the whitespace before the next sentence, and a finished sentence's tail
            # (what its last tokens added); it goes out with the next delta, or with the final message.
            pending, cut = "", 0
            for sentence, queue in zip(source.sentences, queues, strict=True):
                pending += source.text[cut:sentence.start]
                cut = sentence.end
                # Forced target-prefix tokens arrive through the stream like chosen ones.
                token_ids: list[int] = []
                sent = ""
                while True:
                    event = await queue.get()
                    if isinstance(event, BaseException):
                        raise event
                    if not isinstance(event, np.ndarray):
                        nbests.append(event)
                        break
                    token_ids.extend(int(token) for token in event if token != self.runtime.config.eos_id)
                    delta, sent = self._delta(token_ids, sent)
                    if delta and streaming:
                        yield pb.TranslateStreamResponse(text_delta=pending + delta)
                        pending = ""
                # The deltas must add up to the final best text, whatever the tokenizer did at the end.
                text = self.tokenizer.decode(nbests[-1][0].token_ids)
                pending += text[len(sent):] if text.startswith(sent) else ""
            hypotheses = self._joined(source, nbests)
            tail = pending + source.text[cut:] if streaming else hypotheses[0].text
            yield pb.TranslateStreamResponse(text_delta=tail, final=True, hypotheses=hypotheses)
        finally:
            for pump in pumps:
                pump.cancel()

    async def _pump(self, sentence: Sentence, options: SearchOptions, deadline: float, queue: asyncio.Queue[Any]) -> None:
        """One sentence's stream into its queue, a failure included, so the sentences ahead of it need not wait."""
        try:
            async for event in self.scheduler.stream(sentence.token_ids, options, deadline):
                queue.put_nowait(event)
        except Exception as error:  # noqa: BLE001 - handed to the call, which answers with its status
            queue.put_nowait(error)

    def _joined(self, source: Source, nbests: list[list[Hypothesis]]) -> list[pb.Hypothesis]:
        """A text's n-best from its sentences' (the rules are the proto's, at DecodingOptions.split_sentences)."""
        if source.blank:
            return [self._hypothesis(Hypothesis((), 0.0, FinishReason.EOS))]  # no engine slot
        if len(nbests) == 1:
            (start, end), = source.spans
            return [self._hypothesis(h, source.text[:start], source.text[end:]) for h in nbests[0]]
        joined = []
        for rank in range(max(len(nbest) for nbest in nbests)):
            picks = [nbest[min(rank, len(nbest) - 1)] for nbest in nbests]
            text = join(source.text, source.spans, [self.tokenizer.decode(h.token_ids) for h in picks])
            # Each sentence weighs the length its own score was normalised by: its tokens, plus EOS when it chose one.
            weights = [len(h.token_ids) + (h.finish_reason is FinishReason.EOS) for h in picks]
            score = sum(h.score * weight for h, weight in zip(picks, weights, strict=True)) / sum(weights)
            reasons = [h.finish_reason for h in picks]
            reason = (FinishReason.LENGTH if FinishReason.LENGTH in reasons else
                      next((r for r in reasons if r is not FinishReason.EOS), FinishReason.EOS))  # fmt: skip
            joined.append(pb.Hypothesis(text=text, score=score, token_count=sum(len(h.token_ids) for h in picks),
                                        finish_reason=FINISH_REASONS[reason]))  # fmt: skip
        return joined

    def _hypothesis(self, hypothesis: Hypothesis, before: str = "", after: str = "") -> pb.Hypothesis:
        """`before` and `after`: the text's own whitespace around its only sentence."""
        return pb.Hypothesis(text=before + self.tokenizer.decode(hypothesis.token_ids) + after, score=hypothesis.score,
                             token_count=len(hypothesis.token_ids), finish_reason=FINISH_REASONS[hypothesis.finish_reason])  # fmt: skip

    def _delta(self, token_ids: list[int], sent: str) -> tuple[str, str]:
        """New text since `sent`; held back while the last token ends mid-character or rewrites what was sent."""
        text = self.tokenizer.decode(token_ids)
        if text.endswith(REPLACEMENT_CHAR) or not text.startswith(sent):
            return "", sent
        return text[len(sent):], text

    def handler(self) -> grpc.GenericRpcHandler:
        """Handlers with lenient request parsing (see Unparsable); responses serialise as usual."""
        handlers = {
            "Translate": grpc.unary_unary_rpc_method_handler(
                self.Translate, request_deserializer=lenient(pb.TranslateRequest), response_serializer=pb.TranslateResponse.SerializeToString),
            "TranslateStream": grpc.unary_stream_rpc_method_handler(
                self.TranslateStream, request_deserializer=lenient(pb.TranslateStreamRequest),
                response_serializer=pb.TranslateStreamResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, request_deserializer=lenient(pb.GetModelInfoRequest), response_serializer=pb.ModelInfo.SerializeToString),
        }  # fmt: skip
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
