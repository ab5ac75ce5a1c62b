"""TranslationClient and the CLIs: the published retry policy, n-best and streaming output, argument errors, help."""

from __future__ import annotations

import io
import json
import re
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from nmt_serve.client import cli, health
from nmt_serve.client.client import CHANNEL_OPTIONS, Options, TranslationClient
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import RunningServer, server_settings

SERVICE_CONFIG = Path(pb.__file__).with_name("service_config.json")
TEXTS = ["Ich sehe den Hund.", "Wir mag Kaffee."]


class RefusingServicer(pb_grpc.TranslationServiceServicer):
    """Answers every Translate with `code` and counts the attempts that reach it."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.attempts = 0

    def Translate(self, request: pb.TranslateRequest, context: grpc.ServicerContext) -> pb.TranslateResponse:
        self.attempts += 1
        context.abort(self.code, "refused by the test server")


@pytest.fixture(scope="module")
def refusing() -> Iterator[tuple[str, RefusingServicer]]:
    servicer = RefusingServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TranslationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        yield server


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def help_entries(text: str) -> dict[str, str]:
    """--help's entries by their first word ('--timeout', 'texts'), each with its wrapped description joined."""
    entries: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        start = re.match(r"^  (\S+)", line)
        if start:
            key = start.group(1).rstrip(",")
            entries[key] = line
        elif key and line.startswith("   "):
            entries[key] += line
        else:
            key = ""
    return {name: " ".join(entry.split()) for name, entry in entries.items()}


def test_client_retries_unavailable_until_the_server_is_warm(tiny_model_dir: Path) -> None:
    running = RunningServer(server_settings(tiny_model_dir), hold_warm_up=True)
    with running:
        threading.Timer(0.3, running.release_warm_up).start()  # UNAVAILABLE ("warming up") for the first 0.3 s
        with TranslationClient(running.target) as client:
            nbest = client.translate(["Ich sehe den Hund."], timeout=30)
            assert len(nbest) == 1 and nbest[0][0].token_count > 0
            with pytest.raises(grpc.RpcError) as caught:  # INVALID_ARGUMENT is final: no retry hides it
                client.translate(["Hund"], Options(beam_size=0), timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_client_channel_carries_the_published_service_config() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.enable_retries"] == 1
    assert json.loads(options["grpc.service_config"]) == json.loads(SERVICE_CONFIG.read_text(encoding="utf-8"))


class CountingServicer(pb_grpc.TranslationServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    def Translate(self, request: pb.TranslateRequest, context: grpc.ServicerContext) -> pb.TranslateResponse:  # noqa: N802 (gRPC's name)
        self.calls += 1
        return pb.TranslateResponse()


def test_client_spreads_calls_over_every_address_of_its_target() -> None:
    servers, servicers, ports = [], [], []
    for _ in range(2):
        server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), CountingServicer()
        pb_grpc.add_TranslationServiceServicer_to_server(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
        servicers.append(servicer)
    try:
        # One target naming two replicas, as a DNS name of a headless Service resolves to several pods.
        with TranslationClient(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}") as client:
            # round_robin picks among the connections that are ready: until both are, the first may take every call,
            # however fast the host. Then the counts start from zero.
            for _ in range(200):
                if all(servicer.calls for servicer in servicers):
                    break
                client.translate(["Hund"], timeout=10)
            assert all(servicer.calls for servicer in servicers), [servicer.calls for servicer in servicers]
            for servicer in servicers:
                servicer.calls = 0
            for _ in range(20):
                client.translate(["Hund"], timeout=10)
    finally:
        for server in servers:
            server.stop(None)
    assert sum(servicer.calls for servicer in servicers) == 20
    assert all(servicer.calls >= 5 for servicer in servicers), [servicer.calls for servicer in servicers]
    assert [servicer.calls for servicer in servicers] == [10, 10]  # both ready: the calls alternate


@pytest.mark.parametrize("code", [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK], ids=lambda code: code.name)
def test_client_retries_the_published_codes_the_published_number_of_times(
    refusing: tuple[str, RefusingServicer], code: grpc.StatusCode
) -> None:
    target, servicer = refusing
    [method] = json.loads(SERVICE_CONFIG.read_text(encoding="utf-8"))["methodConfig"]
    policy = method["retryPolicy"]
    servicer.code, servicer.attempts = code, 0
    with TranslationClient(target) as client, pytest.raises(grpc.RpcError, match=code.name) as caught:
        client.translate(["Hund"], timeout=30)
    assert caught.value.code() is code
    assert servicer.attempts == (policy["maxAttempts"] if code.name in policy["retryableStatusCodes"] else 1)


def test_cli_plain_nbest_numbers_hypotheses_and_separates_texts(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    with TranslationClient(served.target) as client:
        expected = client.translate(TEXTS, Options(beam_size=3, num_hypotheses=3), timeout=30)
    output = run_cli(capsys, "--target", served.target, "--beam", "3", "--nbest", "3", *TEXTS)
    blocks = output.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == len(TEXTS) + 1, output
    for block, nbest in zip(blocks, expected, strict=False):
        assert block.split("\n") == [f"{rank}. {h.text}" for rank, h in enumerate(nbest, start=1)]


def test_cli_plain_single_best_prints_one_line_per_text(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    with TranslationClient(served.target) as client:
        expected = client.translate(TEXTS, timeout=30)
    assert run_cli(capsys, "--target", served.target, *TEXTS) == "".join(nbest[0].text + "\n" for nbest in expected)


def test_cli_whole_sends_each_text_unsplit(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    paragraph = "Ich sehe den Hund. Wir mag Kaffee heute."
    with TranslationClient(served.target) as client:
        whole = client.translate([paragraph], Options(split_sentences=False), timeout=30)[0][0].text
        split = client.translate([paragraph], timeout=30)[0][0].text
    assert whole != split  # the server's default splits; the option reaches it
    assert run_cli(capsys, "--target", served.target, "--whole", paragraph) == whole + "\n"
    assert run_cli(capsys, "--target", served.target, paragraph) == split + "\n"


def test_cli_keep_and_no_detect_verbatim_reach_the_server(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    text = "Ich sehe Bello in /etc/fstab."
    kept = run_cli(capsys, "--target", served.target, "--keep", "Bello", text)
    assert "Bello" in kept and "/etc/fstab" in kept
    translated = run_cli(capsys, "--target", served.target, "--no-detect-verbatim", text)
    assert "Bello" not in translated and "/etc/fstab" not in translated


def test_cli_html_sends_each_text_as_a_page(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    page = "<p>Ich sehe <b>den Hund</b>.</p>"
    with TranslationClient(served.target) as client:
        expected = client.translate([page], Options(format="html"), timeout=30)[0][0].text
    assert expected.startswith("<p>") and "<b>" in expected
    assert run_cli(capsys, "--target", served.target, "--html", page) == expected + "\n"


@pytest.mark.parametrize("flags", [["--json", "--beam", "3", "--nbest", "2"], ["--beam", "3", "--nbest", "2"], ["--json"], []],
                         ids=["json-nbest", "plain-nbest", "json-greedy", "plain-greedy"])  # fmt: skip
def test_cli_stream_prints_what_the_unary_call_prints(served: RunningServer, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    for text in TEXTS:  # one text a call: a batch's padding must not make the two paths' scores differ
        unary = run_cli(capsys, "--target", served.target, *flags, text)
        assert run_cli(capsys, "--target", served.target, "--stream", *flags, text) == unary
    if "--json" in flags:
        result = json.loads(unary)
        assert result["source"] == TEXTS[-1] and len(result["hypotheses"]) == (2 if "--nbest" in flags else 1)


@pytest.mark.parametrize("argv", [["--nbest", "2"], ["--nbest", "2", "--stream"], ["--nbest", "3", "--beam", "2"]])
def test_cli_nbest_without_enough_beam_exits_2_naming_both_flags(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        cli.main([*argv, "Hund"])
    error = capsys.readouterr().err
    assert "--nbest" in error and "--beam" in error


class TerminalInput(io.StringIO):
    """stdin as a person at a terminal gives it."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stdin", "hint"), [(TerminalInput(""), True), (io.StringIO(""), False)], ids=["terminal", "pipe"])
def test_cli_without_texts_at_a_terminal_says_it_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                             stdin: io.StringIO, hint: bool) -> None:  # fmt: skip
    monkeypatch.setattr("sys.stdin", stdin)
    assert cli.main(["--target", "127.0.0.1:1"]) == 0  # nothing typed, nothing sent
    expected = "nmt-translate: reading German text from stdin, one text per line; Ctrl-D to end (or give texts as arguments)\n"
    assert capsys.readouterr().err == (expected if hint else "")


def test_cli_batch_below_1_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        cli.main(["--batch", "0", "Hund"])
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err


def test_cli_help_shows_every_default_but_not_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_AUTH_TOKEN", "secret-token-value")
    text = cli.build_parser().format_help()
    entries = help_entries(text)
    assert {"texts", "--target", "--beam", "--nbest", "--stream", "--json", "--timeout", "--token", "--batch"} <= set(entries)
    assert [name for name, entry in entries.items() if name not in ("-h", "--version") and "(default:" not in entry] == []
    assert "secret-token-value" not in text


def test_health_help_describes_and_defaults_every_flag() -> None:
    entries = help_entries(health.build_parser().format_help())
    assert set(entries) == {"-h", "--version", "--target", "--service", "--timeout"}
    for name in ("--target", "--service", "--timeout"):
        flag, _, description = entries[name].partition(f" {name.lstrip('-').upper()} ")
        assert flag == name and "(default:" in description and len(description.split()) > 4, entries[name]
