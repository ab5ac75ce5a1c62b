"""Server settings: one dataclass; every field is a command-line flag and an NMT_ environment variable."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn

from nmt_serve.runtime.manifest import MANIFEST_FILE
from nmt_serve.runtime.native_kernels import SETTINGS as NATIVE_KERNEL_SETTINGS
from nmt_serve.server.engine.engine_pool import DEFAULT_WORKER_NICENESS

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "de-en-small" / "onnx-int8"
ENV_PREFIX = "NMT_"
SELF_CHECK_MODES = ("refuse", "warn", "off")
LOG_FORMATS = ("text", "json")  # server/models/log_format.py
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class ServerSettings:
    model_dir: Path = DEFAULT_MODEL_DIR  # the first model dir served (the shipped model when none is named)
    # Further model dirs served beside model_dir: the other positional dirs, then --model-repo's (see from_arguments).
    more_model_dirs: tuple[Path, ...] = ()
    model_repo: str = ""  # a directory whose subdirectories holding a manifest.json are each served
    default_model: str = ""  # the model that requests naming none get; empty = the first served
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (logged, and written to --port-file)
    port_file: str = ""  # where the bound port is written once serving (tests, scripts)
    metrics_host: str = "127.0.0.1"  # the Prometheus /metrics endpoint (0.0.0.0 in containers)
    metrics_port: int = 9300  # 0 = any free port (logged); -1 = no endpoint
    http_host: str = "127.0.0.1"  # the HTTP/JSON API and its page (0.0.0.0 in containers)
    http_port: int = 8000  # 0 = no HTTP API
    # Host names the HTTP API answers /v1 calls for, besides addresses, localhost and --http-host (against DNS rebinding).
    http_allowed_hosts: str = ""
    http_cors_origin: str = ""  # origins whose pages may call the HTTP API (CORS); empty = none, * = any
    # Request limits (reported by GetModelInfo).
    max_texts: int = 64
    max_chars_per_text: int = 2000
    max_beam_size: int = 8
    # Sentences in one text when split_sentences is on: each is its own engine job, so this bounds one text's share of the queue.
    max_sentences_per_text: int = 64
    max_message_bytes: int = 1 << 20  # larger request messages get RESOURCE_EXHAUSTED (server/api/service.py, transport_receive_limit)
    # Admission and engine.
    max_queued_requests: int = 256  # texts waiting or running; beyond: RESOURCE_EXHAUSTED
    max_queued_tokens: int = 64 * 1024  # source tokens waiting or running
    # While calls arrive at burst rate and this share of max_queued_requests is taken, a newly admitted call waits for the
    # burst to end, holding its place, so that the burst's refusals go out first (server/api/burst_hold.py); 0 = never.
    burst_hold_share: float = 0.25
    # 1 = from the moment a burst is seen until it is over (at most 0.5 s) the engines start no step, so the event loop
    # refusing the burst has the interpreter to itself (server/api/burst_hold.py); 0 = the engines never pause.
    burst_pause: int = 1
    max_rows: int = 0  # rows (beams included) in one decoder call, per engine; 0 = 32 on a CPU, 128 on a GPU (server/engine/workers.py)
    max_cache_tokens: int = 128 * 256  # rows x past length held as K/V, per engine
    # A busy batch takes newcomers once join_group are waiting or the oldest has waited join_wait_steps
    # steps (0 = every step). Open loop, int8, one core (bench/results/join_policy.md): p99 0.273 -> 0.253 s
    # at 90 requests/s and 0.330 -> 0.279 s at 110, p50 within a few ms.
    join_wait_steps: int = 4
    join_group: int = 4
    default_deadline_s: float = 30.0  # applied when the client sets no deadline
    # The longest any call lives, whatever the client sends: longer client deadlines are cut to it, and a request
    # message that has not arrived by then (a stalled or cut-short stream) is answered DEADLINE_EXCEEDED.
    max_deadline_s: float = 60.0
    # Engines stepping their own batches in parallel; 0 = one per core on a CPU (up to 4), one on a GPU (server/engine/workers.py).
    engines: int = 0
    threads: int = 0  # ONNX Runtime intra-op threads per session; 0 = the cores shared out among the engines
    # Added to the engine worker threads' nice value, so that the event loop taking calls in and answering them wins the
    # cores from the compute when both want them (server/engine/engine_pool.py); 0 = the server's own priority.
    worker_niceness: int = DEFAULT_WORKER_NICENESS
    providers: str = ""  # comma-separated ONNX Runtime providers; empty = CUDA when a GPU is present, else CPU
    # The decoder's attention on the native kernels (runtime/native_kernels.py): 'auto' = when `nmt-build-kernels` has
    # built them, 'off' = ONNX Runtime's own, or the path of a built library. CPU only.
    native_kernels: str = "auto"
    # Lifecycle and security.
    grace_s: float = 20.0  # SIGTERM: in-flight calls get this long to finish
    # SIGTERM: after health NOT_SERVING and the port stops accepting connections, calls on open connections are still
    # served this long before new ones are refused, so that a balancer moves to other replicas first (server/api/drain.py).
    drain_settle_s: float = 0.0
    # A connection older than this gets GOAWAY (gRPC's max connection age, +-10% jitter) and the client reconnects,
    # re-resolving the server's name: long-lived clients then reach replicas added since. 0 = connections live on.
    max_connection_age_s: float = 0.0
    tls_cert: str = ""  # PEM certificate chain; with tls_key, the port speaks TLS only
    tls_key: str = ""
    auth_token: str = ""  # when set, calls need "authorization: Bearer <token>"
    log_level: str = "INFO"
    log_format: str = "text"  # text: "time level logger: message" lines; json: one object per line, with the request's fields
    # At start, this host's log-probs of the model dir's self_check.json against the exporting host's
    # (runtime/self_check.py): refuse = exit 1 beyond the precision's bound, warn = serve anyway, off = skip.
    self_check: str = "refuse"
    # The translation cache's budget in MiB, shared by the served models (server/models/translation_cache.py); 0 = off.
    cache_mb: int = 64
    access_log: int = 1  # 1 = one INFO line per finished call on the logger nmt_serve.access (never a text); 0 = none

    @property
    def model_dirs(self) -> tuple[Path, ...]:
        """Every model dir to serve, in order."""
        return (Path(self.model_dir), *self.more_model_dirs)

    def validate(self) -> None:
        """Every bad value at once, each named by its flag, in one ValueError."""
        problems = []
        for name in ("max_texts", "max_chars_per_text", "max_beam_size", "max_sentences_per_text", "max_message_bytes",
                     "max_queued_requests", "max_queued_tokens", "max_cache_tokens", "join_group"):  # fmt: skip
            if getattr(self, name) < 1:
                problems.append(f"{flag_name(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("max_rows", "join_wait_steps", "engines", "threads", "cache_mb"):
            if getattr(self, name) < 0:
                problems.append(f"{flag_name(name)} must be at least 0, got {getattr(self, name)}")
        if not 0 <= self.burst_hold_share <= 1:
            problems.append(f"--burst-hold-share must be between 0 (never) and 1, got {self.burst_hold_share:g}")
        if self.native_kernels not in NATIVE_KERNEL_SETTINGS and not Path(self.native_kernels).is_file():
            problems.append(f"--native-kernels must be 'auto', 'off' or the path of a built library, got {self.native_kernels!r} "
                            "(no such file; `nmt-build-kernels --out PATH` builds one)")
        if not 0 <= self.worker_niceness <= 19:
            problems.append(f"--worker-niceness must be between 0 and 19, got {self.worker_niceness}")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be between 0 and 65535, got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be between -1 (off) and 65535, got {self.metrics_port}")
        if not 0 <= self.http_port <= 65535:
            problems.append(f"--http-port must be between 0 (off) and 65535, got {self.http_port}")
        if self.default_deadline_s <= 0:
            problems.append(f"--default-deadline-s must be more than 0, got {self.default_deadline_s:g}")
        for name in ("grace_s", "drain_settle_s", "max_connection_age_s"):
            if getattr(self, name) < 0:
                problems.append(f"{flag_name(name)} must be at least 0, got {getattr(self, name):g}")
        if self.max_deadline_s < self.default_deadline_s:
            problems.append(f"--max-deadline-s must be at least --default-deadline-s ({self.default_deadline_s:g}), got {self.max_deadline_s:g}")
        for name in ("burst_pause", "access_log"):  # on/off switches
            if getattr(self, name) not in (0, 1):
                problems.append(f"{flag_name(name)} must be 0 (off) or 1 (on), got {getattr(self, name)}")
        if self.self_check not in SELF_CHECK_MODES:
            problems.append(f"--self-check must be one of {', '.join(SELF_CHECK_MODES)}, got {self.self_check!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("--tls-cert and --tls-key must be given together")
        if problems:
            raise ValueError("invalid settings: " + "; ".join(problems))


# What a flag's special values mean, shown by --help after its default (the field comments above say the same).
MEANINGS = {
    "port": "0 = any free port (logged, and written to --port-file)",
    "metrics_port": "0 = any free port (logged); -1 = no endpoint",
    "http_port": "the HTTP/JSON API (docs/http.md) and its page at /; 0 = off",
    "http_allowed_hosts": "comma-separated Host names the HTTP API answers /v1 calls for, besides IP addresses, localhost and "
                          "--http-host; '.example.com' = the domain and its subdomains; * = any name",
    "http_cors_origin": "comma-separated origins (https://app.example.com) whose pages may call the HTTP API; empty = none (CORS off), "
                        "* = any",
    "model_repo": "a directory whose subdirectories holding a manifest.json are each one served model, in name order",
    "default_model": "the model name requests with an empty model field get; empty = the first model served",
    "max_rows": "rows (beams included) in one decoder call, per engine; 0 = 32 on a CPU, 128 on a GPU",
    "max_sentences_per_text": "sentences in one text when split_sentences is on; each is its own engine job",
    "burst_hold_share": "while calls arrive at burst rate (64 within 100 ms) and this share of --max-queued-requests is taken, a "
                        "newly admitted call waits for the burst to end (at most 0.5 s), holding its place, so that the burst's "
                        "refusals go out first; 0 = never",
    "burst_pause": "1 = while calls arrive at burst rate the engines start no step (until the burst is over, at most 0.5 s, "
                   "at most once a second), so the burst's refusals go out first; 0 = the engines never pause",
    "join_wait_steps": "a busy batch takes newcomers once join_group wait or the oldest waited this many steps; 0 = every step",
    "default_deadline_s": "applied when the client sets no deadline",
    "max_deadline_s": "the longest any call lives: longer client deadlines are cut to it, a request not arrived by then is DEADLINE_EXCEEDED",
    "engines": "engines stepping their own batches in parallel; 0 = one per core on a CPU (up to 4), one on a GPU",
    "threads": "ONNX Runtime intra-op threads per session; 0 = the cores shared out among the engines",
    "worker_niceness": "added to the engine worker threads' nice value, so the event loop taking calls in wins the cores "
                       "from the compute; 0 = the server's own priority",
    "providers": "comma-separated ONNX Runtime providers; empty = CUDA when a GPU is present, else CPU",
    "native_kernels": "the decoder's attention on the native kernels on a CPU: 'auto' = when `nmt-build-kernels` has built them, "
                      "'off' = ONNX Runtime's own, or the path of a built library",
    "grace_s": "SIGTERM: in-flight calls get this long to finish",
    "drain_settle_s": "SIGTERM: calls on open connections are still served this long after health NOT_SERVING and the port closing, "
                      "before new calls are refused; 0 = refuse at once",
    "max_connection_age_s": "connections older than this are closed gracefully (GOAWAY; calls on them finish) and clients "
                            "reconnect, reaching replicas added since; 0 = never",
    "auth_token": "when set, calls need 'authorization: Bearer <token>'; empty = no check",
    "access_log": "1 = one INFO line per finished call (method, model, status, seconds, texts; never a text) on the logger "
                  "nmt_serve.access; 0 = none",
    "log_format": "text = 'time level logger: message' lines; json = one JSON object per line (time, level, logger, message, "
                  "and the request's fields: request_id, and method, model, code, seconds, texts, transport on access lines)",
    "cache_mb": "the translation cache's budget in MiB, shared by the models: each sentence's answer kept under its model, options "
                "and exact text; used for a model whose self-check found its answers independent of the batch; 0 = off",
    "self_check": "this host's log-probs of the model dir's self_check.json against the exporting host's, at start: "
                  "refuse = exit 1 beyond the precision's bound, warn = serve anyway, off = skip",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line on stderr, exit 2: the usage of some forty flags would bury it (--help shows them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; {self.prog} --help lists the flags\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; its default is the NMT_ variable when set, else the field default."""
    for item in dataclasses.fields(ServerSettings):
        if item.name == "more_model_dirs":  # the positional model_dir takes them
            continue
        if item.name == "model_dir":
            parser.add_argument("model_dir", nargs="*", type=Path, default=None,
                                help=f"model dirs, one model each (env {env_name(item.name)}, several separated by '{os.pathsep}'; "
                                     f"default: the shipped model unless --model-repo is given)")  # fmt: skip
            continue
        kind = type(item.default)
        meaning = f"; {MEANINGS[item.name]}" if item.name in MEANINGS else ""
        parser.add_argument(flag_name(item.name), type=kind, default=None,
                            help=f"env {env_name(item.name)}, default {item.default!r}{meaning}".replace("%", "%%"))  # fmt: skip


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerSettings:
    """Flag, else environment variable, else default; validated."""
    values: dict[str, object] = {}
    for item in dataclasses.fields(ServerSettings):
        flag = getattr(args, item.name, None)
        if item.name in ("model_dir", "more_model_dirs"):
            continue
        if flag is not None:
            values[item.name] = flag
        elif env_name(item.name) in environ:
            raw = environ[env_name(item.name)]
            try:
                values[item.name] = type(item.default)(raw)
            except ValueError:
                raise ValueError(f"{env_name(item.name)}={raw!r}: not {'an' if kind_name(item.default) == 'int' else 'a'} "
                                 f"{kind_name(item.default)} (as {flag_name(item.name)} takes)") from None
    named = list(args.model_dir or ()) or [Path(part) for part in environ.get(env_name("model_dir"), "").split(os.pathsep) if part]
    dirs = named + find_model_dirs(Path(str(values["model_repo"]))) if values.get("model_repo") else named
    if dirs:
        values["model_dir"], values["more_model_dirs"] = dirs[0], tuple(dirs[1:])
    elif not DEFAULT_MODEL_DIR.is_dir():  # an installed wheel holds no model
        raise ValueError(f"no model dir given, and no shipped model at {DEFAULT_MODEL_DIR}: name one, as nmt-serve MODEL_DIR "
                         f"(a dir holding manifest.json, written by nmt-export or nmt-import), {env_name('model_dir')}=MODEL_DIR "
                         "or --model-repo DIR")  # fmt: skip
    settings = ServerSettings(**values)
    settings.validate()
    return settings


def find_model_dirs(repo: Path) -> list[Path]:
    """The subdirectories of a model repository that hold a manifest.json, in name order; a repo without one is an error."""
    if not repo.is_dir():
        raise ValueError(f"--model-repo {str(repo)!r} is not a directory")
    found = sorted(path for path in repo.iterdir() if (path / MANIFEST_FILE).is_file())
    if not found:
        raise ValueError(f"--model-repo {str(repo)!r} holds no model dir (a subdirectory with a {MANIFEST_FILE})")
    return found


def kind_name(default: object) -> str:
    return {int: "int", float: "number", str: "string"}.get(type(default), type(default).__name__)


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> ServerSettings:
    parser = OneLineParser(prog="nmt-serve", description="Serve a model dir over gRPC.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv), environ)
