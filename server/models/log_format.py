"""The server's log lines: `text` (time level logger: message) or `json`, one object per line with the request's fields."""

from __future__ import annotations

import datetime
import json
import logging
import sys

from nmt_serve.server.models.access_log import REQUEST_ID

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC, milliseconds), level, logger, message; the access log's request
    fields (method, model, code, seconds, texts, transport, request_id) on its lines, the request id on any other line
    logged while a call runs, and the traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}  # fmt: skip
        request_id = REQUEST_ID.get()
        if request_id:
            line["request_id"] = request_id
        line |= getattr(record, "request", {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger writes to stderr at `level` in `log_format` (server/settings.py LOG_FORMATS)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
