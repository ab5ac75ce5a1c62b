"""The first phase of a drain: stop accepting connections on the gRPC port while open connections keep being served."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from pathlib import Path

logger = logging.getLogger("nmt-serve")


def listening_sockets(port: int) -> list[int]:
    """This process's file descriptors that are TCP sockets listening on `port` (any address, IPv4 or IPv6)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:  # not a socket, or closed since the listing
            continue
        try:
            if probe.type == socket.SOCK_STREAM and probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and probe.getsockname()[1] == port:
                found.append(fd)
        except OSError:
            pass
        finally:
            probe.close()  # closes the duplicate only
    return found


def accept_queue(listener: socket.socket) -> int:
    """Connections the kernel has completed on a listening socket that nobody has accepted yet.

    For a listener, Linux reports this count in struct tcp_info's tcpi_unacked field (after 8 one-byte fields
    and 4 four-byte ones)."""
    info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 24)[0]


async def stop_accepting(port: int, wait_s: float = 1.0) -> int:
    """Makes the listening sockets on `port` refuse new connections; returns how many there were.

    Why: a balancer that opens a connection per call (deploy/nginx.conf) retries a refused connection on another
    replica, but passes to its client an UNAVAILABLE answered on an open one. grpcio stops a server only as a whole,
    and then ends CANCELLED the calls it holds unhanded (grpc/grpc#41785), so the listener is shut down underneath it:
    new connections are refused at once, and calls on open connections go on. A connection still in the accept queue
    would be reset after the balancer had sent its call on it, which nginx cannot retry (it streams gRPC request
    bodies), so each listener is shut down at a moment its queue is empty (waiting at most `wait_s`). grpc core then
    logs one "Failed accept4: Invalid argument" as its acceptor closes. Linux only (/proc, tcp_info); elsewhere
    nothing is closed and the drain refuses calls as before.
    """
    if not Path("/proc/self/fd").is_dir():
        logger.warning("cannot list this process's sockets: port %d keeps accepting connections until the server stops", port)
        return 0
    closed = 0
    for fd in listening_sockets(port):
        listener = socket.socket(fileno=os.dup(fd))
        try:
            deadline = time.monotonic() + wait_s
            while accept_queue(listener) and time.monotonic() < deadline:
                await asyncio.sleep(0.001)  # grpc core accepts on its own threads
            # On a listening socket, SHUT_RD stops the listen: new connections are refused.
            listener.shutdown(socket.SHUT_RD)
            closed += 1
        except OSError as error:
            logger.warning("could not stop listening on fd %d: %s", fd, error)
        finally:
            listener.close()
    return closed
