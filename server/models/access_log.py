"""The access log: one line per finished call on the logger `nmt_serve.access`; never a text, only its count."""

from __future__ import annotations

import contextvars
import logging

logger = logging.getLogger("nmt_serve.access")

# The call's request id (server/api/request_ids.py sets it for the call's task), written on its access line and, with
# --log-format json, on every line logged while the call runs.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class AccessLog:
    """method, model (- when the call was answered before a served model was known), gRPC status, seconds from arrival
    to answer, the number of texts (- when the call had none, or was refused before its message was read) and the
    request id. The same values go with the record as its `request` fields (the JSON log format writes them)."""

    def record(self, method: str, code: str, seconds: float, texts: int | None = None, model: str = "", transport: str = "grpc") -> None:
        request_id = REQUEST_ID.get() or "-"
        fields = {"method": method, "model": model, "code": code, "seconds": round(seconds, 4), "texts": texts, "transport": transport,
                  "request_id": request_id}  # fmt: skip
        logger.info("%s model=%s code=%s seconds=%.4f texts=%s request_id=%s", method, model or "-", code, seconds, "-" if texts is None else texts,
                    request_id, extra={"request": fields})  # fmt: skip
