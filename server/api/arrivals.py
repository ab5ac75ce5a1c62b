"""When the last call reached a handler: the drain stops the gRPC server only once handlers have caught up."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable

import grpc

# The monotonic time the call being handled arrived (set for the call's task, on both ports): every deadline of the
# call is measured from it, so reading its request and decoding it share one maximum.
ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("arrived", default=None)


class ArrivalClock(grpc.aio.ServerInterceptor):
    """Records the monotonic time at which grpcio last handed a call to this process's handlers.

    Why: grpc core answers CANCELLED to calls it has received but not yet handed to a handler when the server
    stops (grpc/grpc#41785), where a retryable UNAVAILABLE is what a draining server means. Those calls exist
    only while the handlers lag behind arrivals, so the drain waits for a quiet moment before stopping.
    """

    def __init__(self) -> None:
        self.last_arrival = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last call reached a handler."""
        return time.monotonic() - self.last_arrival

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        self.last_arrival = time.monotonic()
        ARRIVED.set(self.last_arrival)
        return await continuation(details)
