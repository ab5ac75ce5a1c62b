"""An HTTP API request's body: checked before it is read (media type, encoding, declared size), read under the call's
deadline, decoded, and parsed as the method's proto message; every failure is an HttpAbort or an Unparsable."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from nmt_serve.server.api.http_status import PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, UNSUPPORTED_MEDIA_TYPE, HttpAbort
from nmt_serve.server.api.service import Unparsable
from nmt_serve.server.models.preparation import prepare
from nmt_serve.server.models.requests import clipped

JSON_TYPE = "application/json"
# Content-Encoding values the server decodes. aiohttp's own decoding is off (server/api/http_server.py): it answered
# a body that did not decode with 500, and codings it does not know as if they were identity.
DECODERS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
CONTINUE = "100-continue"


def check_headers(request: web.Request, limit: int) -> list[str]:
    """The body's declared media type, encodings and length, before any of it is read; returns the encodings to undo."""
    given = request.headers.get("Content-Type", "")
    if request.content_type != JSON_TYPE:
        raise HttpAbort(UNSUPPORTED_MEDIA_TYPE, f"Content-Type must be {JSON_TYPE}, got {clipped(given)!r}; send the body as JSON "
                                                f"with the header Content-Type: {JSON_TYPE}")  # fmt: skip
    encodings = [part.strip().lower() for part in request.headers.get("Content-Encoding", "identity").split(",") if part.strip()]
    unknown = [encoding for encoding in encodings if encoding not in DECODERS]
    if unknown:
        raise HttpAbort(UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {clipped(', '.join(unknown))!r} is not supported; send the body "
                                                f"as {', '.join(DECODERS)}")  # fmt: skip
    if request.content_length is not None and request.content_length > limit:
        raise HttpAbort(PAYLOAD_TOO_LARGE, too_large(request.content_length, limit))
    return [encoding for encoding in encodings if encoding != "identity"]


def too_large(size: int | str, limit: int) -> str:
    return (f"request body has {size} bytes; the limit is {limit} bytes (max_message_bytes, set by nmt-serve --max-message-bytes); "
            "send fewer or shorter texts per request")  # fmt: skip


async def read_body(request: web.Request, limit: int, deadline: float) -> bytes:
    """The raw body, arrived by the monotonic `deadline`: aiohttp itself waits for a stalled body as long as the client
    keeps the connection open. A client that asked to be told to go on (Expect: 100-continue) is told only now, after
    every check that could refuse its call."""
    wait_s = deadline - time.monotonic()
    if wait_s <= 0:
        # Nothing was waited for: the deadline ran out on the server's side of the call (a busy loop, a deadline of a
        # millisecond), which gRPC also answers DEADLINE_EXCEEDED. REQUEST_TIMEOUT is kept for a body that was late.
        raise HttpAbort(grpc.StatusCode.DEADLINE_EXCEEDED.name, "the call's deadline passed before its request body was read")
    if request.headers.get("Expect", "").lower() == CONTINUE and request.version >= (1, 1):
        await request.writer.write(b"HTTP/%d.%d 100 Continue\r\n\r\n" % request.version)
    try:
        async with asyncio.timeout(wait_s):
            return await request.read()  # a chunked body stops at the app's client_max_size, the same limit
    except web.HTTPRequestEntityTooLarge:
        raise HttpAbort(PAYLOAD_TOO_LARGE, too_large(f"more than {limit}", limit)) from None
    except TimeoutError:
        raise HttpAbort(REQUEST_TIMEOUT, f"the request body did not arrive within {wait_s:.3g} s") from None
    except (web.RequestPayloadError, HttpProcessingError) as error:  # broken chunked framing, a body cut short
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT.name, f"the request body is malformed: {clipped(str(error))}") from None


async def parse_body(body: bytes, encodings: list[str], message_class: type[Message], limit: int) -> Message | Unparsable:
    """The body decoded and parsed; a large one off the event loop (server/models/preparation.py)."""
    return await prepare(lambda: from_json(decode(body, encodings, limit), message_class), len(body))


def decode(body: bytes, encodings: list[str], limit: int) -> bytes:
    """`body` with its content encodings undone (the last applied first), never more than `limit` bytes (a gzip bomb stops there)."""
    for encoding in reversed(encodings):
        wbits = DECODERS[encoding]
        if encoding == "deflate" and body and body[0] & 0x0F != 8:
            wbits = -zlib.MAX_WBITS  # raw deflate, without the zlib header, as some clients send it
        decoder = zlib.decompressobj(wbits)
        try:
            decoded = decoder.decompress(body, limit + 1)
            complete = decoder.eof and not decoder.unused_data
        except zlib.error as error:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT.name, f"the request body is not valid {encoding} data "
                                                                   f"(Content-Encoding: {encoding}): {error}") from None  # fmt: skip
        if len(decoded) > limit:
            raise HttpAbort(PAYLOAD_TOO_LARGE, too_large(f"more than {limit} decoded", limit))
        if not complete:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT.name, f"the request body is not valid {encoding} data "
                                                                   f"(Content-Encoding: {encoding}): cut short or followed by other bytes")  # fmt: skip
        body = decoded
    return body


def from_json(body: bytes, message_class: type[Message]) -> Message | Unparsable:
    """proto3 JSON to `message_class`; the body must be a JSON object whose message fields hold objects and whose repeated
    fields hold arrays (json_format takes `"options": []` as an empty message, and reads a string's characters as field names)."""
    name = message_class.DESCRIPTOR.name
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        return Unparsable(name, f"the body is not valid UTF-8 ({error})")
    except (ValueError, RecursionError) as error:
        return Unparsable(name, f"the body is not JSON ({clipped(str(error))})")
    problem = shape_problem(value, message_class.DESCRIPTOR, "the body")
    if problem is not None:
        return Unparsable(name, problem)
    try:
        return json_format.ParseDict(value, message_class())
    except json_format.ParseError as error:
        return Unparsable(name, clipped(str(error), 400))


def shape_problem(value: Any, descriptor: Descriptor, where: str) -> str | None:
    """The first place where `value` is not shaped as a `descriptor` message in proto3 JSON, or None."""
    if not isinstance(value, dict):
        return f"{where} must be a JSON object, got {json_kind(value)}"
    fields = {**{field.json_name: field for field in descriptor.fields}, **descriptor.fields_by_name}
    for key, item in value.items():
        field = fields.get(key)
        if field is None or item is None:
            continue  # unknown names are json_format's to refuse; null is a field's default
        path = f"{'' if where == 'the body' else where + '.'}{field.name}"
        items = item if field.is_repeated else [item]
        if field.is_repeated and not isinstance(item, list):
            return f"{path} must be a JSON array, got {json_kind(item)}"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for index, element in enumerate(items):
                problem = shape_problem(element, field.message_type, f"{path}[{index}]" if field.is_repeated else path)
                if problem is not None:
                    return problem
    return None


def json_kind(value: Any) -> str:
    kinds = ((type(None), "null"), (bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    return next(kind for python_type, kind in kinds if isinstance(value, python_type))
