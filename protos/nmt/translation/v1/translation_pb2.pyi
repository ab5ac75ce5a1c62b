from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason

class DecodingOptions(_message.Message):
    __slots__ = ("beam_size", "num_hypotheses", "length_penalty", "max_output_tokens", "min_output_tokens", "repetition_penalty", "no_repeat_ngram_size", "target_prefix", "split_sentences", "keep", "detect_verbatim", "format")
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SENTENCES_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    DETECT_VERBATIM_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    beam_size: int
    num_hypotheses: int
    length_penalty: float
    max_output_tokens: int
    min_output_tokens: int
    repetition_penalty: float
    no_repeat_ngram_size: int
    target_prefix: str
    split_sentences: bool
    keep: _containers.RepeatedCompositeFieldContainer[KeepSpan]
    detect_verbatim: bool
    format: str
    def __init__(self, beam_size: _Optional[int] = ..., num_hypotheses: _Optional[int] = ..., length_penalty: _Optional[float] = ..., max_output_tokens: _Optional[int] = ..., min_output_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., no_repeat_ngram_size: _Optional[int] = ..., target_prefix: _Optional[str] = ..., split_sentences: _Optional[bool] = ..., keep: _Optional[_Iterable[_Union[KeepSpan, _Mapping]]] = ..., detect_verbatim: _Optional[bool] = ..., format: _Optional[str] = ...) -> None: ...

class KeepSpan(_message.Message):
    __slots__ = ("text", "range")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    range: CharRange
    def __init__(self, text: _Optional[str] = ..., range: _Optional[_Union[CharRange, _Mapping]] = ...) -> None: ...

class CharRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Hypothesis(_message.Message):
    __slots__ = ("text", "score", "token_count", "finish_reason")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    text: str
    score: float
    token_count: int
    finish_reason: FinishReason
    def __init__(self, text: _Optional[str] = ..., score: _Optional[float] = ..., token_count: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Translation(_message.Message):
    __slots__ = ("hypotheses",)
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    hypotheses: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    def __init__(self, hypotheses: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ...) -> None: ...

class TranslateRequest(_message.Message):
    __slots__ = ("texts", "options", "model", "source_language", "target_language")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    options: DecodingOptions
    model: str
    source_language: str
    target_language: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ...) -> None: ...

class TranslateResponse(_message.Message):
    __slots__ = ("translations", "model")
    TRANSLATIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    translations: _containers.RepeatedCompositeFieldContainer[Translation]
    model: str
    def __init__(self, translations: _Optional[_Iterable[_Union[Translation, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class TranslateStreamRequest(_message.Message):
    __slots__ = ("text", "options", "model", "source_language", "target_language")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    options: DecodingOptions
    model: str
    source_language: str
    target_language: str
    def __init__(self, text: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ...) -> None: ...

class TranslateStreamResponse(_message.Message):
    __slots__ = ("text_delta", "final", "hypotheses")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    final: bool
    hypotheses: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    def __init__(self, text_delta: _Optional[str] = ..., final: _Optional[bool] = ..., hypotheses: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_texts", "max_chars_per_text", "max_source_tokens", "max_output_tokens", "max_beam_size", "max_message_bytes", "max_queued_requests", "default_deadline_seconds", "max_sentences_per_text", "max_keep_spans")
    MAX_TEXTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHARS_PER_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SENTENCES_PER_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_KEEP_SPANS_FIELD_NUMBER: _ClassVar[int]
    max_texts: int
    max_chars_per_text: int
    max_source_tokens: int
    max_output_tokens: int
    max_beam_size: int
    max_message_bytes: int
    max_queued_requests: int
    default_deadline_seconds: float
    max_sentences_per_text: int
    max_keep_spans: int
    def __init__(self, max_texts: _Optional[int] = ..., max_chars_per_text: _Optional[int] = ..., max_source_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., max_beam_size: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., default_deadline_seconds: _Optional[float] = ..., max_sentences_per_text: _Optional[int] = ..., max_keep_spans: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "source_language", "target_language", "precision", "execution_provider", "limits", "host_check", "source_languages", "target_languages")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    HOST_CHECK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    source_language: str
    target_language: str
    precision: str
    execution_provider: str
    limits: Limits
    host_check: HostCheck
    source_languages: _containers.RepeatedScalarFieldContainer[str]
    target_languages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ..., precision: _Optional[str] = ..., execution_provider: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., host_check: _Optional[_Union[HostCheck, _Mapping]] = ..., source_languages: _Optional[_Iterable[str]] = ..., target_languages: _Optional[_Iterable[str]] = ...) -> None: ...

class HostCheck(_message.Message):
    __slots__ = ("checked", "max_log_prob_diff", "bound", "exported_on", "checked_on")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOG_PROB_DIFF_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_ON_FIELD_NUMBER: _ClassVar[int]
    CHECKED_ON_FIELD_NUMBER: _ClassVar[int]
    checked: bool
    max_log_prob_diff: float
    bound: float
    exported_on: str
    checked_on: str
    def __init__(self, checked: _Optional[bool] = ..., max_log_prob_diff: _Optional[float] = ..., bound: _Optional[float] = ..., exported_on: _Optional[str] = ..., checked_on: _Optional[str] = ...) -> None: ...
