"""The HTTP/JSON API (docs/http.md) behind the gRPC stub's interface, so that nmt-loadtest runs the same load over either."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import aiohttp
import grpc
from google.protobuf import json_format

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

# The HTTP API's own error codes and the gRPC code each stands for: server/api/http_status.py's COUNTED_AS, repeated here
# because the client imports nothing of the server (tests/test_http.py keeps the two equal).
TRANSPORT_CODES = {"PAYLOAD_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED.name, "REQUEST_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED.name,
                   "UNSUPPORTED_MEDIA_TYPE": grpc.StatusCode.INVALID_ARGUMENT.name}


class HttpCallError(Exception):
    """An answer other than 200: its JSON error's code, as a gRPC status code (the report counts both transports alike;
    the HTTP API's own 413 and 408 count as the gRPC codes the server counts them under)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        code = TRANSPORT_CODES.get(code, code)
        self._code = grpc.StatusCode[code] if code in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN

    def code(self) -> grpc.StatusCode:
        return self._code


class HttpCaller:
    """Translate and TranslateStream over HTTP, one aiohttp session (its connections kept alive) for every call."""

    def __init__(self, target: str, connections: int = 0) -> None:
        self.base = target if target.startswith(("http://", "https://")) else f"http://{target}"
        self._connections = connections  # 0 = no cap, as a gRPC channel multiplexes every call
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpCaller:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._connections))
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use HttpCaller as an async context manager"
        return self._session

    async def Translate(self, request: pb.TranslateRequest, timeout: float, metadata: Sequence[tuple[str, str]] = ()) -> pb.TranslateResponse:
        async with self.session.post(f"{self.base}/v1/translate", data=to_body(request), headers=headers(timeout, metadata),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as response:  # fmt: skip
            body = await response.read()
            if response.status != 200:
                raise error_of(body, response.status)
            return json_format.Parse(body, pb.TranslateResponse())

    async def TranslateStream(self, request: pb.TranslateStreamRequest, timeout: float, metadata: Sequence[tuple[str, str]] = (),
                              ) -> AsyncIterator[pb.TranslateStreamResponse]:  # fmt: skip
        async with self.session.post(f"{self.base}/v1/translate/stream", data=to_body(request), headers=headers(timeout, metadata),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as response:  # fmt: skip
            if response.status != 200:
                raise error_of(await response.read(), response.status)
            name = ""
            async for raw in response.content:  # one line at a time
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    data = json.loads(line[len("data: "):])
                    if name == "error":
                        raise HttpCallError(data["error"]["code"], data["error"]["message"])
                    yield json_format.ParseDict(data, pb.TranslateStreamResponse())

    async def wait_ready(self, timeout_s: float) -> None:
        """Until GET /readyz answers 200, or fail after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self.session.get(f"{self.base}/readyz", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"nmt-loadtest: {timeout_s:g} s without a ready answer from {self.base}/readyz")
            await asyncio.sleep(0.5)


def to_body(message: pb.TranslateRequest | pb.TranslateStreamRequest) -> bytes:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None).encode()


def headers(timeout: float, metadata: Sequence[tuple[str, str]]) -> dict[str, str]:
    """JSON, the call's deadline (Request-Timeout, seconds) and the gRPC metadata's authorization as its header."""
    result = {"Content-Type": "application/json", "Request-Timeout": f"{timeout:g}"}
    result.update({"Authorization": value for key, value in metadata if key == "authorization"})
    return result


def error_of(body: bytes, status: int) -> HttpCallError:
    try:
        error = json.loads(body)["error"]
        return HttpCallError(error["code"], error["message"])
    except (ValueError, KeyError, TypeError):
        return HttpCallError("UNKNOWN", f"HTTP {status}: {body[:200]!r}")
