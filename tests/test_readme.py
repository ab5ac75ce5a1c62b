"""README's offline flows run as written, in a temp dir and without network: an OPUS-MT import tried on a random Marian
model, then several models in one server. The lines come from README's bash blocks; the servers take their ports from
NMT_ variables, as every flag does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmt_serve.bench.balancer import free_port
from tests.serving import wait_for

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section_blocks(title: str) -> list[list[str]]:
    """The bash blocks of one README section, each as its lines."""
    section = README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [[line for line in block.splitlines() if line.strip()] for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def command(line: str) -> str:
    """A README line without its comment."""
    return line.split("  #", 1)[0].strip()


class Shell:
    """README lines run by bash in one dir with this Python's commands first on PATH; an nmt-serve line runs in the
    background until the next one or stop(), and the lines after it wait until it is SERVING."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.port = free_port()
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "NMT_PORT": str(self.port),
                    "NMT_TARGET": f"127.0.0.1:{self.port}", "NMT_METRICS_PORT": "0", "NMT_HTTP_PORT": "0", "NMT_THREADS": "1"}  # fmt: skip
        self.server: subprocess.Popen | None = None

    def run_block(self, block: list[str]) -> list[str]:
        """Each line's stdout (an nmt-serve line's is empty)."""
        return [self.serve(line) if line.startswith("nmt-serve ") else self.run(line) for line in block]

    def run(self, line: str) -> str:
        result = subprocess.run(["bash", "-c", line], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def serve(self, line: str) -> str:
        self.stop()
        # Its log goes to a file: a pipe nobody reads fills with access lines and blocks the server.
        with (self.cwd / "nmt-serve.log").open("w", encoding="utf-8") as log:
            self.server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.cwd, env=self.env, stdout=log, stderr=log)
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                assert self.server is not None and self.server.poll() is None, f"{line} stopped:\n{(self.cwd / 'nmt-serve.log').read_text()}"
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return False

            assert wait_for(serving, 120), f"{line} is not SERVING"
        return ""

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(timeout=60)
        self.server = None


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    pytest.importorskip("transformers", reason="nmt-random-marian and nmt-import need the import extra (transformers, sentencepiece)")
    pytest.importorskip("sentencepiece", reason="nmt-random-marian and nmt-import need the import extra (transformers, sentencepiece)")
    cwd = tmp_path_factory.mktemp("readme")
    (cwd / "artifacts").symlink_to(ROOT / "artifacts")  # README's commands run from the repository root
    shell = Shell(cwd)
    yield shell
    shell.stop()


@pytest.fixture(scope="module")
def imported(shell: Shell) -> list[str]:
    """The offline block of "Serve an OPUS-MT model", run as written: make a random Marian dir, import it, serve it, translate."""
    _, offline = section_blocks("Serve an OPUS-MT model")
    outputs = shell.run_block(offline)
    shell.stop()
    return outputs


def test_readme_opus_mt_offline_block_runs_as_written(shell: Shell, imported: list[str]) -> None:
    assert imported[0].startswith("wrote a random Marian model (tiny shape, seed 0) to random-marian; ")
    assert (shell.cwd / "models" / "random-de-en" / "onnx-int8" / "manifest.json").is_file()
    assert imported[-1].strip(), "the imported model translated nothing"


def test_readme_opus_mt_hub_block_takes_the_offline_blocks_steps() -> None:
    """The hub block needs network; past its install line it is the offline block with the hub id and out dir in place."""
    hub, offline = section_blocks("Serve an OPUS-MT model")
    assert hub[0].startswith("pip install torch==2.13.0 && pip install -e '.[import]'")
    swapped = [command(line).replace("Helsinki-NLP/opus-mt-de-en", "random-marian").replace("opus-mt-de-en", "random-de-en")
               for line in hub[1:]]  # fmt: skip
    assert swapped == [command(line) for line in offline[1:]]


@pytest.mark.parametrize(("server_block", "default"), [(0, "de-en-small"), (1, "random-de-en")], ids=["model-dirs", "model-repo"])
def test_readme_several_models_blocks_run_as_written(shell: Shell, imported: list[str], server_block: int, default: str) -> None:
    *servers, clients = section_blocks("Several models in one server")
    shell.run_block(servers[server_block])
    listing, greeting, *_ = shell.run_block(clients)
    shell.stop()
    other = ({"de-en-small", "random-de-en"} - {default}).pop()
    assert sorted(line.split("\t")[0] for line in listing.splitlines()) == sorted([f"{default} (default)", other])
    assert greeting == "Good morning.\n"
