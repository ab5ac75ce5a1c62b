"""Request validation: protobuf messages in, domain objects out; every problem names the field and its limit.

Checks run cheapest first (counts, then characters, then options, then tokenizing), so an
oversized request is refused before any tokenizer or model work is spent on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nmt_serve.model.html_text import HtmlDocument, parse_html
from nmt_serve.model.languages import ModelLanguages, UnknownLanguage
from nmt_serve.model.search import SearchOptions
from nmt_serve.model.sentences import split_spans
from nmt_serve.model.verbatim import Span, cut, detect, merge, occurrences
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.settings import ServerSettings

FORMATS = ("text", "html")  # DecodingOptions.format
# Client-sent values quoted in an error message are cut to this many characters: a status message travels in
# the trailers, and a client's default metadata limit (16 KiB) turns a longer one into RESOURCE_EXHAUSTED.
ECHO_CHARS = 80


def clipped(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` for an error message: cut to `limit` characters, its full length named when cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class InvalidRequest(ValueError):
    """A request the server will not run; the message names each bad field and its limit."""


class UnknownModel(LookupError):
    """The request named a model this server does not serve (server/models/registry.py)."""


@dataclass(frozen=True)
class Limits:
    max_texts: int
    max_chars_per_text: int
    max_source_tokens: int  # tokens of one text; EOS takes the last position
    max_output_tokens: int
    max_beam_size: int
    max_sentences_per_text: int = 64  # with split_sentences on; each sentence is its own engine job
    # Engine jobs (sentences) of one request: each takes a place of the scheduler's queue, so a request with
    # more could never be admitted whole; it is refused as invalid, not as a retryable RESOURCE_EXHAUSTED.
    max_inputs_per_request: int = 256
    max_keep_spans: int = 64  # entries of DecodingOptions.keep: each is searched for in every text

    @classmethod
    def from_settings(cls, settings: ServerSettings, max_positions: int) -> Limits:
        return cls(settings.max_texts, settings.max_chars_per_text, max_positions - 1, max_positions, settings.max_beam_size,
                   settings.max_sentences_per_text, settings.max_queued_requests)  # fmt: skip


@dataclass(frozen=True)
class Sentence:
    """One engine input: text[start:end] of its Source (the whole text when splitting is off)."""

    start: int
    end: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """One text to translate, as its sentences; `blank` texts get an empty translation without entering the engine."""

    text: str
    sentences: tuple[Sentence, ...]
    # Tokens every sentence's token_ids start with (a multilingual model's language token); the text does not show them.
    language_tokens: tuple[int, ...] = ()

    @property
    def blank(self) -> bool:
        """Nothing to translate: the text is blank, or all of it is kept verbatim."""
        return not self.sentences

    @property
    def unchanged(self) -> str:
        """The translation of a text with nothing to translate: "" for a blank text, else the text as it came."""
        return self.text if self.text.strip() else ""

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(sentence.start, sentence.end) for sentence in self.sentences]


@dataclass(frozen=True)
class Task:
    sources: tuple[Source, ...]
    options: SearchOptions  # the first sentence's: the target language's token, then the request's target prefix
    # format "html": the request's pages; the sources are their texts (flows, text nodes, alt/title values and the probes
    # that place inline tags), page after page.
    documents: tuple[HtmlDocument, ...] | None = None
    # What every sentence starts its target with: a multilingual model's target-language token (or nothing).
    language_prefix: tuple[int, ...] = ()


class RequestReader:
    """Turns Translate / TranslateStream messages into Tasks for one model's scheduler (the model is already chosen)."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits, languages: ModelLanguages) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.languages = languages

    def translate(self, request: pb.TranslateRequest) -> Task:
        count = len(request.texts)
        if count == 0:
            raise InvalidRequest(f"texts must hold between 1 and {self.limits.max_texts} texts, got 0")
        if count > self.limits.max_texts:
            raise InvalidRequest(f"texts must hold at most {self.limits.max_texts} texts (max_texts, set by nmt-serve --max-texts), got {count}; "
                                 "send fewer texts per request (nmt-translate --batch N sends N per request)")  # fmt: skip
        return self._task(list(request.texts), request.options, "texts", (request.source_language, request.target_language))

    def stream(self, request: pb.TranslateStreamRequest) -> Task:
        return self._task([request.text], request.options, "text", (request.source_language, request.target_language))

    def _task(self, texts: list[str], options: pb.DecodingOptions, field: str, languages: tuple[str, str]) -> Task:
        limit = self.limits.max_chars_per_text
        for index, text in enumerate(texts):
            if len(text) > limit:
                raise InvalidRequest(f"{self._name(field, index, len(texts))} has {len(text)} characters; the limit is {limit} "
                                     "(max_chars_per_text, set by nmt-serve --max-chars-per-text); split the text into shorter texts")  # fmt: skip
        try:
            source_prefix, target_prefix = self.languages.prefixes(*languages)
        except UnknownLanguage as error:
            raise InvalidRequest(str(error)) from None
        search_options = self._options(options, target_prefix)
        documents = self._documents(texts, options)
        if documents is not None:
            texts = [text for document in documents for text in document.texts]
        split = options.split_sentences if options.HasField("split_sentences") else True
        # Spans first, for every text: a text over the sentence limit is refused before any tokenizing.
        # Blank texts have no spans: they stay out of the tokenizer and the engine and translate to "".
        # Splitting stops one sentence past the limit, so a refused text costs no more than an admitted one.
        limit = self.limits.max_sentences_per_text
        spans = [split_spans(text, limit) if split else ([(0, len(text))] if text.strip() else []) for text in texts]
        # Verbatim spans come out of the sentences: the pieces between them are translated, they are kept as they were.
        kept = self._verbatim(texts, options, field)
        if documents is not None:  # inline elements kept as written stand in their flow's text as placeholders, always kept
            owners = [document for document in documents for _ in document.texts]
            kept = [merge([*text_kept, *owner.kept_spans(text)]) for text, text_kept, owner in zip(texts, kept, owners, strict=True)]
        spans = [cut(text_spans, text_kept, text) for text, text_spans, text_kept in zip(texts, spans, kept, strict=True)]
        for index, text_spans in enumerate(spans):
            if len(text_spans) > limit:
                raise InvalidRequest(f"{self._name(field, index, len(texts))} has more than {limit} sentences; the limit is {limit} "
                                     "(max_sentences_per_text, set by nmt-serve --max-sentences-per-text); split the text into shorter "
                                     "texts, or set options.split_sentences to false to send it whole")  # fmt: skip
        inputs = sum(len(text_spans) for text_spans in spans)
        if inputs > self.limits.max_inputs_per_request:
            raise InvalidRequest(f"{field} hold {inputs} sentences; a request may hold at most {self.limits.max_inputs_per_request}, "
                                 "the places of the server's queue (set by nmt-serve --max-queued-requests); send fewer texts per "
                                 "request (nmt-translate --batch N sends N per request)")  # fmt: skip
        sources = []
        for index, (text, text_spans) in enumerate(zip(texts, spans, strict=True)):
            sentences = []
            for number, (start, end) in enumerate(text_spans):
                name = self._name(field, index, len(texts)) + (f" sentence {number}" if split else "")
                token_ids = (*source_prefix, *self.tokenizer.encode(text[start:end]))
                self._check_tokens(name, token_ids, search_options)
                sentences.append(Sentence(start, end, token_ids))
            sources.append(Source(text, tuple(sentences), source_prefix))
        return Task(tuple(sources), search_options, documents, target_prefix)

    @staticmethod
    def _documents(texts: list[str], options: pb.DecodingOptions) -> tuple[HtmlDocument, ...] | None:
        """The parsed pages when options.format is "html"; None for plain text."""
        text_format = options.format if options.HasField("format") else FORMATS[0]
        if text_format not in FORMATS:
            raise InvalidRequest(f"options.format must be one of {', '.join(FORMATS)}, got {clipped(text_format)!r}")
        if text_format == "html" and any(entry.WhichOneof("span") == "range" for entry in options.keep):
            raise InvalidRequest("options.keep may hold no range when options.format is html (a range of the page would cut its markup); "
                                 "keep strings instead")  # fmt: skip
        return tuple(parse_html(text) for text in texts) if text_format == "html" else None

    def _verbatim(self, texts: list[str], options: pb.DecodingOptions, field: str) -> list[list[Span]]:
        """Per text, the spans to keep unchanged: options.keep's and, unless options.detect_verbatim is false, the detected ones."""
        keep = list(options.keep)
        limit = self.limits.max_keep_spans
        if len(keep) > limit:
            raise InvalidRequest(f"options.keep holds {len(keep)} entries; the limit is {limit} (max_keep_spans); keep fewer strings or ranges")
        problems = self._keep_problems(keep, texts, field)
        if problems:
            raise InvalidRequest("; ".join(problems))
        detecting = options.detect_verbatim if options.HasField("detect_verbatim") else True
        strings = [entry.text for entry in keep if entry.WhichOneof("span") == "text"]
        ranges = [(entry.range.start, entry.range.end) for entry in keep if entry.WhichOneof("span") == "range"]
        return [merge([*(detect(text) if detecting else ()), *occurrences(text, strings), *ranges]) for text in texts]

    def _keep_problems(self, keep: list[pb.KeepSpan], texts: list[str], field: str) -> list[str]:
        problems = []
        for index, entry in enumerate(keep):
            name = f"options.keep[{index}]"
            if entry.WhichOneof("span") is None:
                problems.append(f"{name} must set text or range")
            elif entry.WhichOneof("span") == "text" and not entry.text:
                problems.append(f"{name}.text must not be empty")
            elif entry.WhichOneof("span") == "text" and len(entry.text) > self.limits.max_chars_per_text:
                problems.append(f"{name}.text has {len(entry.text)} characters; the limit is {self.limits.max_chars_per_text} (max_chars_per_text)")
            elif entry.WhichOneof("span") == "range" and not 0 <= entry.range.start < entry.range.end:
                problems.append(f"{name}.range must have 0 <= start < end, got start {entry.range.start}, end {entry.range.end}")
            elif entry.WhichOneof("span") == "range":
                for text_index, text in enumerate(texts):
                    if entry.range.end > len(text):
                        problems.append(f"{name}.range ends at {entry.range.end}, past the end of {self._name(field, text_index, len(texts))} "
                                        f"({len(text)} characters); a range must lie within every text of the request")  # fmt: skip
                        break
        return problems

    def _check_tokens(self, name: str, token_ids: tuple[int, ...], search_options: SearchOptions) -> None:
        """One engine input's source length, and the min output length against the max in force for it."""
        if len(token_ids) > self.limits.max_source_tokens:
            raise InvalidRequest(f"{name} has {len(token_ids)} tokens; the limit is {self.limits.max_source_tokens} (max_source_tokens, "
                                 "the model's positions less one); split it into shorter sentences")  # fmt: skip
        # One rule for the minimum: it may not pass the max in force, given or default (a default max that
        # cut it short would drop it without a word).
        longest = search_options.max_length(len(token_ids), self.limits.max_output_tokens)
        if token_ids and search_options.min_output_tokens > longest:
            given = ("options.max_output_tokens" if search_options.max_output_tokens is not None else
                     f"the default max_output_tokens, {search_options.max_len_a:g} x its {len(token_ids)} source tokens + {search_options.max_len_b}")
            raise InvalidRequest(f"options.min_output_tokens must be at most the max output tokens of {name} "
                                 f"({longest}: {given}; set options.max_output_tokens), got {search_options.min_output_tokens}")  # fmt: skip

    @staticmethod
    def _name(field: str, index: int, count: int) -> str:
        return f"{field}[{index}]" if field == "texts" else field

    def _options(self, options: pb.DecodingOptions, language_prefix: tuple[int, ...]) -> SearchOptions:
        limits = self.limits
        beam = options.beam_size if options.HasField("beam_size") else 1
        problems = []
        # The server's beam cap is tighter than the search's own; check it first so its name shows.
        if options.HasField("beam_size") and not 1 <= beam <= limits.max_beam_size:
            problems.append(f"options.beam_size must be between 1 and {limits.max_beam_size} (max_beam_size, set by nmt-serve --max-beam-size), "
                            f"got {beam}")  # fmt: skip
        if options.HasField("max_output_tokens") and options.max_output_tokens < 1:
            problems.append(f"options.max_output_tokens must be at least 1, got {options.max_output_tokens}")
        prefix_text = options.target_prefix if options.HasField("target_prefix") else ""
        if len(prefix_text) > limits.max_chars_per_text:
            problems.append(f"options.target_prefix has {len(prefix_text)} characters; the limit is {limits.max_chars_per_text} "
                            "(max_chars_per_text, set by nmt-serve --max-chars-per-text)")  # fmt: skip
        if problems:
            raise InvalidRequest("; ".join(problems))
        prefix = (*language_prefix, *self.tokenizer.encode(prefix_text)) if prefix_text else language_prefix
        values = {
            "beam_size": beam,
            "num_hypotheses": options.num_hypotheses if options.HasField("num_hypotheses") else 1,
            "length_penalty": options.length_penalty if options.HasField("length_penalty") else 1.0,
            # Clamped to the position table rather than rejected (reported by GetModelInfo).
            "max_output_tokens": min(options.max_output_tokens, limits.max_output_tokens) if options.HasField("max_output_tokens") else None,
            "min_output_tokens": options.min_output_tokens if options.HasField("min_output_tokens") else 0,
            "repetition_penalty": options.repetition_penalty if options.HasField("repetition_penalty") else 1.0,
            "no_repeat_ngram_size": options.no_repeat_ngram_size if options.HasField("no_repeat_ngram_size") else 0,
            "target_prefix": prefix,
        }
        search_options = SearchOptions(**values)
        try:
            search_options.validate(limits.max_output_tokens)
        except ValueError as error:
            # Search names fields without the message path; the client sees them under "options.".
            raise InvalidRequest(str(error).replace("invalid search options: ", "invalid options: options.").replace("; ", "; options.")) from None
        return search_options
