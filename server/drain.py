"""The first phase of a drain: stop accepting connections on the gRPC port while open connections keep being served."""

from __future__ import annotations

import logging
import os
import socket
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


def stop_accepting(port: int) -> int:
    """Makes the listening sockets on `port` refuse new connections; returns how many there were.

    Why: a balancer that opens a connection per call (deploy/nginx.conf) retries a refused connection on another
    replica, but passes to its client an UNAVAILABLE answered on an open one. grpcio stops a server only as a whole,
    and then ends CANCELLED the calls it holds unhanded (grpc/grpc#41785), so the listener is shut down underneath it:
    new connections are refused at once, those still in the accept queue are reset (the balancer retries them too),
    and calls on open connections go on. grpc core then logs one "Failed accept4: Invalid argument" as its acceptor
    closes. Linux only (/proc); elsewhere nothing is closed and the drain refuses calls as before.
    """
    if not Path("/proc/self/fd").is_dir():
        logger.warning("cannot list this process's sockets: port %d keeps accepting connections until the server stops", port)
        return 0
    closed = 0
    for fd in listening_sockets(port):
        listener = socket.socket(fileno=os.dup(fd))
        try:
            # On a listening socket, SHUT_RD stops the listen: pending and new connections are refused.
            listener.shutdown(socket.SHUT_RD)
            closed += 1
        except OSError as error:
            logger.warning("could not stop listening on fd %d: %s", fd, error)
        finally:
            listener.close()
    return closed
