"""The access log: one line per finished call on the logger `nmt_serve.access`; never a text, only its count."""

from __future__ import annotations

import logging

logger = logging.getLogger("nmt_serve.access")


class AccessLog:
    """method, model (- when the call was answered before a served model was known), gRPC status, seconds from arrival
    to answer and the number of texts (- when the call had none, or was refused before its message was read)."""

    def record(self, method: str, code: str, seconds: float, texts: int | None = None, model: str = "") -> None:
        logger.info("%s model=%s code=%s seconds=%.4f texts=%s", method, model or "-", code, seconds, "-" if texts is None else texts)
