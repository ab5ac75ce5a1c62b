"""Alertmanager's webhook receiver in the compose stack: each alert of each notification as one JSON line on stdout.

Run by docker-compose.yml's alert-receiver service (`python3 -u alert-receiver.py`, port 9095, NMT_ALERT_RECEIVER_PORT);
stdlib only. A line: {"receiver", "status" (firing or resolved), "labels", "annotations", "startsAt", "endsAt"}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Notifications arrive on threads of their own; print() writes a line and its end separately, so two at once
# could share a line. Each line is written whole, under this lock.
OUTPUT_LOCK = threading.Lock()


class Notification(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            alerts = body["alerts"]
        except (ValueError, KeyError) as error:
            self.send_error(400, f"not an Alertmanager webhook notification: {error}")
            return
        lines = [json.dumps({"receiver": body.get("receiver"), **{key: alert.get(key) for key in ("status", "labels", "annotations", "startsAt", "endsAt")}},
                            sort_keys=True) + "\n" for alert in alerts]  # fmt: skip
        with OUTPUT_LOCK:
            sys.stdout.write("".join(lines))
            sys.stdout.flush()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        pass  # the notifications are the log


def main() -> int:
    port = int(os.environ.get("NMT_ALERT_RECEIVER_PORT", "9095"))
    print(f"alert-receiver: listening on port {port}", file=sys.stderr, flush=True)
    ThreadingHTTPServer(("0.0.0.0", port), Notification).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
