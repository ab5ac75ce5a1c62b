"""What stops nmt-serve before it serves, as one line: a model dir it cannot use (exit 2) or a port it cannot listen on (exit 1)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from nmt_serve.runtime.manifest import MANIFEST_FILE
from nmt_serve.server.settings import ServerSettings

USAGE_ERROR = 2  # the command line names something that cannot be used
RUNTIME_ERROR = 1  # the command line is right, but this host refuses it (a port in use)

# Each listening port: its flag, the settings fields of its host and port, and what the flag's special value does.
LISTENERS = (
    ("--port", "host", "port", "--port 0 picks a free port"),
    ("--metrics-port", "metrics_host", "metrics_port", "--metrics-port 0 picks a free port, -1 serves no /metrics"),
    ("--http-port", "http_host", "http_port", "--http-port 0 turns the HTTP API off"),
)


class StartupError(Exception):
    """Ends nmt-serve with `exit_code` and this one-line message."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_model_dirs(settings: ServerSettings) -> None:
    """Each model dir exists, is readable and holds a manifest; what is inside is checked when it loads."""
    for model_dir in settings.model_dirs:
        problem = model_dir_problem(Path(model_dir))
        if problem:
            raise StartupError(f"MODEL_DIR {model_dir}: {problem}", USAGE_ERROR)


def model_dir_problem(model_dir: Path) -> str:
    if not model_dir.exists():
        return "does not exist; name a dir that nmt-export or nmt-import wrote (one holding manifest.json)"
    if not model_dir.is_dir():
        return "is not a directory; name the dir that holds manifest.json"
    if not os.access(model_dir, os.R_OK | os.X_OK):
        return f"not readable by this user (uid {os.getuid()}); make it readable (chmod -R a+rX) or run as its owner"
    manifest = model_dir / MANIFEST_FILE
    if not manifest.is_file():
        inside = sorted(path.name for path in model_dir.iterdir() if (path / MANIFEST_FILE).is_file())
        hint = f"name one of the model dirs inside it: {', '.join(inside)}" if inside else "name a dir that nmt-export or nmt-import wrote"
        return f"holds no {MANIFEST_FILE}; {hint}"
    if not os.access(manifest, os.R_OK):
        return f"{MANIFEST_FILE} is not readable by this user (uid {os.getuid()}); make it readable (chmod -R a+rX) or run as its owner"
    return ""


def check_ports(settings: ServerSettings) -> None:
    """Every port nmt-serve will listen on is free, before any model loads: a busy port fails in a second, not after the load."""
    bound: dict[int, str] = {}
    for flag, host_field, port_field, _ in LISTENERS:
        port = getattr(settings, port_field)
        if port <= 0:  # any free port, or off
            continue
        if port in bound:
            raise StartupError(f"{flag} {port}: the same port as {bound[port]}; give each its own port", USAGE_ERROR)
        bound[port] = flag
        error = probe(getattr(settings, host_field), port)
        if error is not None:
            raise listen_error(flag, settings, error)


def probe(host: str, port: int) -> OSError | None:
    """Why (host, port) cannot be listened on, or None. The probe binds as grpcio, aiohttp and the metrics server do
    (SO_REUSEADDR: a port whose last connections are in TIME_WAIT is free), then lets go."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return error
    failures: list[OSError] = []
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return error
                failures.append(error)
    # A name with several addresses (localhost: 127.0.0.1 and ::1) is served where any of them binds.
    return failures[0] if failures and len(failures) == len(addresses) else None


def listen_error(flag: str, settings: ServerSettings, error: BaseException) -> StartupError:
    """The one line for a port that cannot be listened on: the flag, the address and what to do."""
    _, host_field, port_field, special = next(listener for listener in LISTENERS if listener[0] == flag)
    host, port = getattr(settings, host_field), getattr(settings, port_field)
    host_flag = flag.replace("port", "host")
    code = getattr(error, "errno", None)
    if isinstance(error, socket.gaierror):
        return StartupError(f"{host_flag} {host}: not a known host name or address ({error.strerror}); use an address of this host, "
                            "such as 127.0.0.1 or 0.0.0.0", USAGE_ERROR)  # fmt: skip
    if code == errno.EADDRNOTAVAIL:
        return StartupError(f"{host_flag} {host}: not an address of this host; use one of its addresses, such as 127.0.0.1 or 0.0.0.0",
                            USAGE_ERROR)  # fmt: skip
    if code == errno.EADDRINUSE:
        what = f"is already in use; stop what listens there, or choose another port ({special})"
    elif code == errno.EACCES:
        what = "needs privileges this user lacks (ports below 1024 need root); choose a port of 1024 or more"
    else:
        what = f"cannot be listened on ({error}); choose another port ({special})"
    return StartupError(f"{flag} {port}: {host}:{port} {what}", RUNTIME_ERROR)
