"""One served model as the service uses it: its runtime, scheduler and request reader; translate, stream, describe."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from nmt_serve.model.languages import ModelLanguages, load_languages
from nmt_serve.model.search import FinishReason, Hypothesis, SearchOptions
from nmt_serve.model.sentences import join
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.engine.scheduler import Scheduler
from nmt_serve.server.engine.sessions import Runtime
from nmt_serve.server.models.preparation import prepare
from nmt_serve.server.models.html_pages import rendered
from nmt_serve.server.models.requests import Limits, RequestReader, Sentence, Source, Task
from nmt_serve.server.models.translation_cache import ModelCache
from nmt_serve.server.settings import ServerSettings

FINISH_REASONS = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
REPLACEMENT_CHAR = "\ufffd"  # what a byte-level token that ends mid-character decodes to
# A model's grpc.health.v1 name: the service's, a slash, the model's name.
HEALTH_PREFIX = pb.DESCRIPTOR.services_by_name["TranslationService"].full_name + "/"


class ServedModel:
    """Requests reach it validated only as far as its name; everything after that depends on the model."""

    def __init__(self, runtime: Runtime, scheduler: Scheduler, settings: ServerSettings, cache: ModelCache | None = None) -> None:
        self.runtime = runtime
        self.cache = cache  # None: every sentence goes to the engine (server/models/translation_cache.py says when)
        self.scheduler = scheduler
        self.settings = settings
        self.name = runtime.manifest.model_name
        self.tokenizer = runtime.tokenizer
        self.limits = Limits.from_settings(settings, runtime.config.max_positions)
        manifest = runtime.manifest
        self.languages = ModelLanguages(manifest.source_language, manifest.target_language, load_languages(runtime.model_dir))
        self.reader = RequestReader(runtime.tokenizer, self.limits, self.languages)

    @property
    def health_name(self) -> str:
        return HEALTH_PREFIX + self.name

    async def translate(self, request: pb.TranslateRequest, deadline: float) -> pb.TranslateResponse:
        task = await prepare(lambda: self.reader.translate(request), request.ByteSize())
        return pb.TranslateResponse(translations=await self._translations(task, deadline), model=self.name)

    async def _translations(self, task: Task, deadline: float) -> list[pb.Translation]:
        # Every sentence of every text is its own job, all submitted at once so that they share batches.
        # A TaskGroup cancels the other jobs as soon as one fails, so none runs on unanswered.
        # A sentence the cache holds is answered at once and takes no place in the queue.
        async with asyncio.TaskGroup() as group:
            jobs = [[self._answer(group, source, sentence, self._sentence_options(task, number), deadline)
                     for number, sentence in enumerate(source.sentences)] for source in task.sources]  # fmt: skip
        translations = [pb.Translation(hypotheses=self._joined(source, [job.result() for job in text_jobs]))
                        for source, text_jobs in zip(task.sources, jobs, strict=True)]  # fmt: skip
        return translations if task.documents is None else rendered(task.documents, translations)

    async def stream(self, request: pb.TranslateStreamRequest, deadline: float) -> AsyncIterator[pb.TranslateStreamResponse]:
        task = await prepare(lambda: self.reader.stream(request), request.ByteSize())
        if task.documents is not None:
            async for message in self._stream_page(task, deadline):
                yield message
            return
        source = task.sources[0]
        if source.blank:
            unchanged = self._hypothesis(Hypothesis((), 0.0, FinishReason.EOS), source.unchanged)
            yield pb.TranslateStreamResponse(text_delta=unchanged.text, final=True, hypotheses=[unchanged])
            return
        async for message in self._stream_sentences(source, task, deadline):
            yield message

    def info(self) -> pb.ModelInfo:
        manifest, settings, limits = self.runtime.manifest, self.settings, self.limits
        pb_limits = pb.Limits(
            max_texts=limits.max_texts, max_chars_per_text=limits.max_chars_per_text, max_source_tokens=limits.max_source_tokens,
            max_output_tokens=limits.max_output_tokens, max_beam_size=limits.max_beam_size, max_message_bytes=settings.max_message_bytes,
            max_queued_requests=settings.max_queued_requests, default_deadline_seconds=settings.default_deadline_s,
            max_sentences_per_text=limits.max_sentences_per_text, max_keep_spans=limits.max_keep_spans,
        )  # fmt: skip
        checked = self.runtime.host_check
        host_check = pb.HostCheck() if checked is None else pb.HostCheck(
            checked=True, max_log_prob_diff=checked.max_log_prob_diff, bound=checked.bound, exported_on=checked.reference_cpu,
            checked_on=checked.cpu)  # fmt: skip
        return pb.ModelInfo(name=manifest.model_name, version=manifest.model_version, source_language=manifest.source_language,
                            target_language=manifest.target_language, precision=manifest.precision,
                            execution_provider=self.runtime.provider, limits=pb_limits, host_check=host_check,
                            source_languages=self.languages.source_codes, target_languages=self.languages.target_codes)  # fmt: skip

    async def _stream_page(self, task: Task, deadline: float) -> AsyncIterator[pb.TranslateStreamResponse]:
        """An HTML page part by part: each part (markup, a block's text with its inline tags, an attribute value) goes out
        once it and every part before it is translated; the last message holds the rest and the page's n-best.

        All of the page's sentences run at once; the deltas join to hypotheses[0].text (each part is rendered from its
        texts' best translations, which are final once their sentences are done)."""
        (document,) = task.documents or ()
        jobs = [[self._answer(None, source, sentence, self._sentence_options(task, number), deadline)
                 for number, sentence in enumerate(source.sentences)] for source in task.sources]  # fmt: skip
        try:
            texts: list[str | None] = [None] * len(task.sources)
            parts, sent = 0, 0  # parts and characters sent so far
            for index, (source, text_jobs) in enumerate(zip(task.sources, jobs, strict=True)):
                texts[index] = self._joined(source, [await job for job in text_jobs])[0].text
                ready = list(document.rendered_parts(texts, parts))
                parts += len(ready)
                delta = "".join(ready)
                if delta and parts < len(document.parts):
                    sent += len(delta)
                    yield pb.TranslateStreamResponse(text_delta=delta)
            translations = [pb.Translation(hypotheses=self._joined(source, [job.result() for job in text_jobs]))
                            for source, text_jobs in zip(task.sources, jobs, strict=True)]  # fmt: skip
            (page,) = rendered([document], translations)
            yield pb.TranslateStreamResponse(text_delta=page.hypotheses[0].text[sent:], final=True, hypotheses=page.hypotheses)
        finally:
            for text_jobs in jobs:
                for job in text_jobs:
                    job.cancel()

    def _answer(self, group: asyncio.TaskGroup | None, source: Source, sentence: Sentence, options: SearchOptions,
                deadline: float) -> asyncio.Future[list[Hypothesis]]:  # fmt: skip
        """The sentence's n-best: from the cache, else a task (of `group`, when given) that runs it and keeps the answer."""
        text, cached = self._look_up(source, sentence, options)
        if cached is None:
            work = self._translate_sentence(text, source, sentence, options, deadline)
            return group.create_task(work) if group is not None else asyncio.create_task(work)
        answered: asyncio.Future[list[Hypothesis]] = asyncio.get_running_loop().create_future()
        answered.set_result(cached)
        return answered

    def _look_up(self, source: Source, sentence: Sentence, options: SearchOptions) -> tuple[str, list[Hypothesis] | None]:
        """The sentence's text, and its n-best when the cache holds it."""
        text = source.text[sentence.start:sentence.end]
        return text, (self.cache.get(options, text, source.language_tokens) if self.cache is not None else None)

    async def _translate_sentence(self, text: str, source: Source, sentence: Sentence, options: SearchOptions, deadline: float) -> list[Hypothesis]:
        nbest = await self.scheduler.translate(sentence.token_ids, options, deadline)
        if self.cache is not None:
            self.cache.put(options, text, nbest, source.language_tokens)
        return nbest

    @staticmethod
    def _sentence_options(task: Task, number: int) -> SearchOptions:
        """The target prefix starts the text, so only its first sentence is forced to it; every sentence starts with the language token."""
        if number == 0 or task.options.target_prefix == task.language_prefix:
            return task.options
        return dataclasses.replace(task.options, target_prefix=task.language_prefix)

    async def _stream_sentences(self, source: Source, task: Task, deadline: float) -> AsyncIterator[pb.TranslateStreamResponse]:
        """Every sentence runs at once; greedy sends each one's text in order, the original whitespace between them.

        Beam search sends nothing before the joined n-best (a beam's best row can change every step).
        """
        streaming = task.options.beam_size == 1
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in source.sentences]
        pumps = [self._start_pump(source, sentence, self._sentence_options(task, number), deadline, queue)
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
                if pump is not None:
                    pump.cancel()

    def _start_pump(self, source: Source, sentence: Sentence, options: SearchOptions, deadline: float,
                    queue: asyncio.Queue[Any]) -> asyncio.Task[None] | None:  # fmt: skip
        """A cached sentence's n-best goes into its queue at once (its whole text then leaves as one delta); None then."""
        text, cached = self._look_up(source, sentence, options)
        if cached is None:
            return asyncio.create_task(self._pump(text, source, sentence, options, deadline, queue))
        queue.put_nowait(cached)
        return None

    async def _pump(self, text: str, source: Source, sentence: Sentence, options: SearchOptions, deadline: float, queue: asyncio.Queue[Any]) -> None:
        """One sentence's stream into its queue, a failure included, so the sentences ahead of it need not wait."""
        try:
            async for event in self.scheduler.stream(sentence.token_ids, options, deadline):
                if self.cache is not None and isinstance(event, list):
                    self.cache.put(options, text, event, source.language_tokens)
                queue.put_nowait(event)
        except Exception as error:  # noqa: BLE001 - handed to the call, which answers with its status
            queue.put_nowait(error)

    def _joined(self, source: Source, nbests: list[list[Hypothesis]]) -> list[pb.Hypothesis]:
        """A text's n-best from its sentences' (the rules are the proto's, at DecodingOptions.split_sentences)."""
        if source.blank:
            return [self._hypothesis(Hypothesis((), 0.0, FinishReason.EOS), source.unchanged)]  # no engine slot
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
