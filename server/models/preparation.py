"""Request preparation (parsing a body, splitting sentences, tokenizing) on a thread of its own once a request is large.

Why: preparing the largest request the limits admit (64 texts of 2,000 characters) is tens of milliseconds of
Python; on the event loop it delays every other call's answer and every health probe by as much, each time it runs.
Small requests, almost all of them, stay on the loop: a thread hop costs more than their preparation.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Prepared = TypeVar("Prepared")

# Bytes of a request (its protobuf message, or its JSON body) up to which a request is prepared on the event loop: about 1 ms of work.
INLINE_BYTES = 1000
# One thread: preparation is Python holding the GIL, so a second thread would not prepare faster, and the event
# loop shares the GIL with one thread only.
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-prepare")
# How long a thread holding the GIL keeps it while the event loop waits for it (Python's default is 5 ms). With four
# clients looping on the largest request the limits admit (64 texts of 1,000 lines), health p99 measured 58 ms (gRPC
# Check) and 36 ms (/healthz) at 5 ms, 35 ms and 24 ms at 1 ms, on a shared 2-core machine.
GIL_SWITCH_S = 0.001


def share_the_gil() -> None:
    """Sets the interpreter's switch interval to GIL_SWITCH_S (the server calls it once, at start)."""
    sys.setswitchinterval(GIL_SWITCH_S)


async def prepare(work: Callable[[], Prepared], size: int) -> Prepared:
    """`work()`, on the event loop when `size` (bytes) is at most INLINE_BYTES, else on the preparation thread (the call's
    context variables, its request id among them, go with it)."""
    if size <= INLINE_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_executor, contextvars.copy_context().run, work)
