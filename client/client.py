"""A small synchronous client for the translation service."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import grpc

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# The retry policy is published beside the .proto so that clients in every language use the same one;
# this client reads it from there rather than keeping a copy. Why it retries what it does:
# UNAVAILABLE means not admitted (a draining or restarting server, a balancer without a replica):
# safe to retry. A CANCELLED the server sends (this client's own cancels are never retried) comes from a
# stopping server: grpc core cancels calls it had not yet handed to a handler (grpc/grpc#41785), and calls
# still running when the grace period ends. Translation is idempotent, so both are retried, with gRPC's
# built-in retries and exponential backoff 0.1 s .. 1 s. Balancing is round_robin: a name that resolves
# to several replicas (a headless Kubernetes Service, a multi-address target) gets calls spread over all
# of them; pick_first, gRPC's default, would send every call to the first.
SERVICE_CONFIG_FILE = "service_config.json"
SERVICE_CONFIG = json.loads(resources.files(pb.__package__).joinpath(SERVICE_CONFIG_FILE).read_text(encoding="utf-8"))
CHANNEL_OPTIONS = [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(SERVICE_CONFIG))]


@dataclass(frozen=True)
class Options:
    """Unset (None) fields take the server defaults."""

    beam_size: int | None = None
    num_hypotheses: int | None = None
    length_penalty: float | None = None
    max_output_tokens: int | None = None
    min_output_tokens: int | None = None
    target_prefix: str | None = None
    split_sentences: bool | None = None  # None: the server's default (on: each sentence translated, whitespace kept)
    # Returned unchanged: every occurrence of a string, or characters (start, end) of every text.
    keep: tuple[str | tuple[int, int], ...] = ()
    detect_verbatim: bool | None = None  # None: the server's default (on: URLs, paths, code, placeholders, keys kept unchanged)
    format: str | None = None  # "text" (the server's default) or "html": the markup kept, the text nodes translated

    def to_proto(self) -> pb.DecodingOptions:
        values = {name: value for name, value in self.__dict__.items() if value is not None and name != "keep"}
        keep = [pb.KeepSpan(text=span) if isinstance(span, str) else pb.KeepSpan(range=pb.CharRange(start=span[0], end=span[1]))
                for span in self.keep]  # fmt: skip
        return pb.DecodingOptions(**values, keep=keep)


class TranslationClient:
    """Wraps one channel; use as a context manager or call close(). `model`: the served model to use (empty: the server's default);
    `languages`: the (source, target) language codes of every request (empty: the model's defaults)."""

    def __init__(self, target: str = DEFAULT_TARGET, token: str = "", root_certificate: Path | None = None, model: str = "",
                 languages: tuple[str, str] = ("", "")) -> None:  # fmt: skip
        self.model = model
        self.languages = {"source_language": languages[0], "target_language": languages[1]} if any(languages) else {}
        if root_certificate is not None:
            credentials = grpc.ssl_channel_credentials(Path(root_certificate).read_bytes())
            self.channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.TranslationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def __enter__(self) -> TranslationClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def translate(self, texts: Sequence[str], options: Options = Options(), timeout: float | None = None) -> list[list[pb.Hypothesis]]:
        """n-best hypotheses per text, best first."""
        request = pb.TranslateRequest(texts=list(texts), options=options.to_proto(), model=self.model, **self.languages)
        response = self.stub.Translate(request, timeout=timeout, metadata=self.metadata)
        return [list(translation.hypotheses) for translation in response.translations]

    def translate_stream(self, text: str, options: Options = Options(), timeout: float | None = None) -> Iterator[pb.TranslateStreamResponse]:
        request = pb.TranslateStreamRequest(text=text, options=options.to_proto(), model=self.model, **self.languages)
        yield from self.stub.TranslateStream(request, timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(model=self.model), timeout=timeout, metadata=self.metadata)

    def list_models(self, timeout: float | None = None) -> pb.ListModelsResponse:
        """Every model the server serves, its default first."""
        return self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=self.metadata)
