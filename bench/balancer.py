"""The deploy's nginx (deploy/nginx.conf) in front of nmt-serve replicas on loopback, as docker-compose runs it.

Used by nmt-workers-report (several replicas against one) and by tests/test_cluster.py. Needs the
Debian nginx binary (`apt-get install nginx`; .ci/run installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now that this process has not handed out before: the kernel can give a port just
    closed to the next bind, and two servers of one stack (a balancer's health and HTTP listeners, say) would then
    be set up on the same port."""
    for _ in range(1000):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no loopback port left that this process has not handed out")


# Where the HTTP upstream points when no replica's HTTP port is given: the discard port, closed on loopback, so the
# balancer's HTTP port answers 502.
NO_HTTP_PORT = 9


def upstream_lines(name: str, ports: list[int] | tuple[int, ...], text: str) -> str:
    """`text` with its one "server NAME ...;" upstream line replaced by one line per loopback port."""
    upstream = "\n        ".join(f"server 127.0.0.1:{port} max_fails=1 fail_timeout=5s;" for port in ports)
    text, replaced = re.subn(rf"server {name} [^;]*;", upstream, text)
    if replaced != 1:
        raise ValueError(f"deploy/nginx.conf no longer has the one 'server {name}' upstream line this rewrites")
    return text


def nginx_config(work: Path, grpc_ports: list[int], listen: int, health: int, http_ports: list[int] | None = None,
                 http_listen: int | None = None) -> Path:
    """deploy/nginx.conf with the upstreams on loopback replicas (gRPC ports, HTTP API ports) and the listen ports free
    ones (the HTTP one chosen here unless given)."""
    text = (ROOT / "deploy" / "nginx.conf").read_text(encoding="utf-8")
    text = upstream_lines("translator:50051", grpc_ports, text)
    text = upstream_lines("translator:8000", http_ports or (NO_HTTP_PORT,), text)
    text = text.replace("listen 8080 http2;", f"listen 127.0.0.1:{listen} http2;").replace("listen 8081;", f"listen 127.0.0.1:{health};")
    text = text.replace("listen 8000;", f"listen 127.0.0.1:{http_listen or free_port()};")
    text = text.replace("/tmp/nginx", str(work / "nginx"))
    if os.geteuid() == 0:  # workers would switch to "nobody", who cannot write the caller's temp dirs
        text = "user root;\n" + text
    path = work / "nginx.conf"
    path.write_text(text, encoding="utf-8")
    return path


def http_ok(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


class Balancer:
    """nginx on free loopback ports in front of `targets` (host:port each) and the replicas' HTTP API ports
    `http_targets`; `target` is where gRPC clients call, `http_target` where HTTP clients do."""

    def __init__(self, targets: list[str], work: Path, http_targets: list[str] | None = None) -> None:
        if NGINX is None:
            raise RuntimeError("nginx not installed (apt-get install nginx)")
        work.mkdir(parents=True, exist_ok=True)
        listen, self.health, http_listen = free_port(), free_port(), free_port()
        config = nginx_config(work, [int(target.rsplit(":", 1)[1]) for target in targets], listen, self.health,
                              [int(target.rsplit(":", 1)[1]) for target in http_targets or ()], http_listen)  # fmt: skip
        self.http_target = f"127.0.0.1:{http_listen}"
        self.log = work / "nginx.log"
        self.process = subprocess.Popen([NGINX, "-c", str(config), "-p", str(work), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                                        stderr=self.log.open("w"))  # fmt: skip
        self.target = f"127.0.0.1:{listen}"
        deadline = time.monotonic() + 20
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.health}/healthz")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
