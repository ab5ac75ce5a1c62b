"""Hand-written HTTP/2 frames for calls no gRPC client would send (cut-short messages, a request that never comes)."""

from __future__ import annotations

import re
import socket
import struct
import time
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman coding (RFC 7541 section 6.2.2)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    assert len(name_bytes) < 127 and len(value_bytes) < 127, "one-byte lengths only"
    return b"\x00" + bytes([len(name_bytes)]) + name_bytes + bytes([len(value_bytes)]) + value_bytes


def request_headers(path: str, *extra: tuple[str, str]) -> bytes:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"), ("content-type", "application/grpc"),
              ("te", "trailers"), *extra]  # fmt: skip
    return b"".join(_literal(name, value) for name, value in fields)


def grpc_message(body: bytes, declared: int | None = None, compressed: bool = False) -> bytes:
    """A length-prefixed gRPC message; `declared` other than len(body) makes a message cut short."""
    return bytes([compressed]) + struct.pack(">I", len(body) if declared is None else declared) + body


@dataclass
class Ending:
    """How the server ended stream 1: grpc-status from its trailers, a reset, or the connection closing."""

    how: str  # "trailers", "reset", "goaway", "closed" or "nothing"
    seconds: float
    grpc_status: int | None = None
    trailers: bytes = b""


def call(port: int, *frames: bytes, wait_s: float) -> Ending:
    """Opens a connection, sends `frames` after the preface and settings, and reads until stream 1 ends or `wait_s` passes.

    Pings and settings are acknowledged, as a live client would: only the call itself is left hanging.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + b"".join(frames))
        started = time.monotonic()
        buffer = b""
        while True:
            remaining = wait_s - (time.monotonic() - started)
            if remaining <= 0:
                return Ending("nothing", time.monotonic() - started)
            sock.settimeout(remaining)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return Ending("nothing", time.monotonic() - started)
            except ConnectionResetError:
                data = b""
            if not data:
                return Ending("closed", time.monotonic() - started)
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                stream, payload, buffer = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF, buffer[9:9 + length], buffer[9 + length:]
                elapsed = time.monotonic() - started
                if kind == SETTINGS and not flags & ACK:
                    sock.sendall(frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    sock.sendall(frame(PING, ACK, 0, payload))
                elif kind == HEADERS and stream == 1 and flags & END_STREAM:
                    # grpc core writes grpc-status as a literal without Huffman coding: name, length byte, digits.
                    found = re.search(rb"grpc-status[\x01\x02](\d+)", payload)
                    return Ending("trailers", elapsed, int(found.group(1)) if found else None, payload)
                elif kind == RST_STREAM and stream == 1:
                    return Ending("reset", elapsed)
                elif kind == GOAWAY and int.from_bytes(payload[4:8], "big") != 0:  # an error code: the connection is over
                    return Ending("goaway", elapsed)
