"""nmt-serve's start-up failures: each one line on stderr naming the flag, the value and what to do; exit 2 for usage, 1 at run time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nmt_serve.server import main as server_main
from nmt_serve.server import settings as server_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def run_serve(*argv: str) -> tuple[int, str]:
    """The real server process; its stderr."""
    result = subprocess.run([sys.executable, "-m", "nmt_serve.server.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stderr


def call_main(argv: list[str]) -> int:
    """main()'s exit code, also where argparse exits for it."""
    try:
        return server_main.main(argv)
    except SystemExit as exit_info:
        return int(exit_info.code or 0)


def one_line(text: str) -> str:
    assert text.endswith("\n") and text.count("\n") == 1, text
    return text.strip()


@pytest.mark.parametrize(("flag", "hint"), [
    ("--port", "--port 0 picks a free port"),
    ("--metrics-port", "--metrics-port 0 picks a free port, -1 serves no /metrics"),
    ("--http-port", "--http-port 0 turns the HTTP API off"),
])  # fmt: skip
def test_startup_busy_port_is_one_line_naming_the_flag_exit_1(tiny_model_dir: Path, busy_port: int, flag: str, hint: str) -> None:
    ports = {"--port": "0", "--metrics-port": "0", "--http-port": "0", flag: str(busy_port)}
    code, stderr = run_serve(str(tiny_model_dir), *(item for pair in ports.items() for item in pair))
    assert code == 1
    assert one_line(stderr) == (f"nmt-serve: {flag} {busy_port}: 127.0.0.1:{busy_port} is already in use; stop what listens there, "
                                f"or choose another port ({hint})")  # fmt: skip


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_startup_port_taken_after_the_check_is_one_line_exit_1(tiny_model_dir: Path, busy_port: int, flag: str,
                                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A port taken between the check and the bind (the check let through): the bind's failure reads the same."""
    monkeypatch.setattr(server_main, "check_ports", lambda settings: None)
    ports = {"--port": "0", "--metrics-port": "0", "--http-port": "0", flag: str(busy_port)}
    assert server_main.main([str(tiny_model_dir), "--threads", "1", *(item for pair in ports.items() for item in pair)]) == 1
    assert one_line(capsys.readouterr().err).startswith(f"nmt-serve: {flag} {busy_port}: 127.0.0.1:{busy_port} is already in use; ")


def test_startup_two_listeners_on_one_port_exit_2(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main.main([str(tiny_model_dir), "--port", "8123", "--http-port", "8123"]) == 2
    assert one_line(capsys.readouterr().err) == "nmt-serve: --http-port 8123: the same port as --port; give each its own port"


@pytest.mark.parametrize(("argv", "environ", "line"), [
    (["--log-level", "LOUD"], {}, "invalid settings: --log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    (["--port", "abc"], {}, "argument --port: invalid int value: 'abc'; nmt-serve --help lists the flags"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag; nmt-serve --help lists the flags"),
    (["--max-texts", "0"], {}, "invalid settings: --max-texts must be at least 1, got 0"),
    ([], {"NMT_PORT": "abc"}, "NMT_PORT='abc': not an int (as --port takes)"),
    ([], {"NMT_GRACE_S": "soon"}, "NMT_GRACE_S='soon': not a number (as --grace-s takes)"),
    (["--host", "10.255.255.254"], {}, "--host 10.255.255.254: not an address of this host; use one of its addresses, such as 127.0.0.1 or 0.0.0.0"),
    (["--port", "0", "--metrics-port", "0", "--http-port", "8001", "--http-host", "no-such-host.invalid"], {},
     "--http-host no-such-host.invalid: not a known host name or address"),
])  # fmt: skip
def test_startup_bad_flag_value_is_one_line_exit_2(argv: list[str], environ: dict[str, str], line: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert call_main(argv) == 2
    assert one_line(capsys.readouterr().err).startswith(f"nmt-serve: {line}")


def test_startup_without_a_model_dir_where_none_is_shipped_says_one_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """An installed wheel holds no model: started without a model dir, nmt-serve says how to name one."""
    monkeypatch.setattr(server_settings, "DEFAULT_MODEL_DIR", tmp_path / "nmt_serve" / "artifacts" / "de-en-small" / "onnx-int8")
    monkeypatch.delenv("NMT_MODEL_DIR", raising=False)
    assert server_main.main([]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"nmt-serve: no model dir given, and no shipped model at {tmp_path}/nmt_serve/")
    assert "nmt-serve MODEL_DIR" in line and "NMT_MODEL_DIR=MODEL_DIR" in line and "--model-repo DIR" in line


def test_startup_missing_model_dir_is_one_line_exit_2(tmp_path: Path) -> None:
    code, stderr = run_serve(str(tmp_path / "nowhere"))
    assert code == 2
    assert one_line(stderr) == (f"nmt-serve: MODEL_DIR {tmp_path}/nowhere: does not exist; name a dir that nmt-export or nmt-import wrote "
                                "(one holding manifest.json)")  # fmt: skip


def test_startup_model_dir_that_is_a_file_or_holds_no_manifest_exit_2(tiny_model_dir: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert server_main.main([str(tiny_model_dir / "manifest.json")]) == 2
    assert one_line(capsys.readouterr().err).endswith("manifest.json: is not a directory; name the dir that holds manifest.json")
    (tmp_path / "onnx-int8").symlink_to(tiny_model_dir)  # a checkpoint dir: its model dirs are inside
    assert server_main.main([str(tmp_path)]) == 2
    assert one_line(capsys.readouterr().err) == (f"nmt-serve: MODEL_DIR {tmp_path}: holds no manifest.json; "
                                                 "name one of the model dirs inside it: onnx-int8")  # fmt: skip


def test_startup_unreadable_model_dir_is_one_line_exit_2(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # Root reads every dir whatever its mode, so the permission check is what this user is refused.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tiny_model_dir else real_access(path, mode))
    assert server_main.main([str(tiny_model_dir)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"nmt-serve: MODEL_DIR {tiny_model_dir}: not readable by this user (uid {os.getuid()}); ")
    assert "chmod -R a+rX" in line

