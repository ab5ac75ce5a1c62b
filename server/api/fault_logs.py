"""Client and transport faults logged as one WARNING line without a traceback, at most one a RATE_S per logger.

Why: aiohttp logs every request it cannot parse, and grpcio every stream the drain cuts off at the end of the grace
period, as an ERROR with a full traceback: a client sending garbage filled the log with tracebacks that say nothing
about the server. Faults of other kinds keep their level and traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

# The loggers whose ERROR records of FAULTS are client or transport faults: aiohttp's request handling, grpcio's servicer calls.
LOGGERS = ("aiohttp.server", "grpc._cython.cygrpc")
FAULTS = (HttpProcessingError, ConnectionError, asyncio.CancelledError)
RATE_S = 10.0


class OneLineFaults(logging.Filter):
    """Rewrites a fault record to one WARNING line; drops the ones that follow within RATE_S, and names their count on
    the next line let through."""

    def __init__(self, rate_s: float = RATE_S) -> None:
        super().__init__()
        self.rate_s = rate_s
        self._last = -float("inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or not isinstance(error, FAULTS):
            return True
        now = time.monotonic()
        if now - self._last < self.rate_s:
            self._dropped += 1
            return False
        detail = " ".join(str(error).split())[:200]
        record.msg = f"{record.getMessage()}: {type(error).__name__}{': ' + detail if detail else ''}" + (
            f" ({self._dropped} more like it in the last {now - self._last:.0f} s not logged)" if self._dropped else "")
        record.args, record.exc_info, record.exc_text = None, None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        self._last, self._dropped = now, 0
        return True


def quiet_transport_faults() -> None:
    """Puts a OneLineFaults on each of LOGGERS, once per process."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, OneLineFaults) for existing in logger.filters):
            logger.addFilter(OneLineFaults())
