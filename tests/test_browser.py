"""The page at / in a real browser (Debian's chromium, headless, driven over the Chrome DevTools protocol): a sentence typed
in streams to the same English as the gRPC API gives for the same text and options."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.settings import DEFAULT_MODEL_DIR
from tests.serving import RunningServer, server_settings
from tests.test_http import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)")]
SENTENCE = "Ich sehe den Hund im Garten."
BEAM = 2
# Where the page's screenshot goes besides the test's tmp dir (docs/http-page.png is made this way).
SCREENSHOT_ENV = "NMT_PAGE_SCREENSHOT"


class DevTools:
    """One page target of a browser over the DevTools protocol: send a command, wait for its answer."""

    def __init__(self, url: str) -> None:
        import websocket  # websocket-client, a dev dependency

        self._socket = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        self._socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == number:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"page never satisfied {expression}"
            time.sleep(0.05)
        return value

    def click(self, selector: str) -> None:
        box = self.evaluate(f"JSON.stringify(document.querySelector({selector!r}).getBoundingClientRect())")
        x, y = (lambda rect: (rect["x"] + rect["width"] / 2, rect["y"] + rect["height"] / 2))(json.loads(box))
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self) -> None:
        self._socket.close()


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[DevTools]:
    port = free_port()
    process = subprocess.Popen([str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
                                f"--user-data-dir={tmp_path / 'profile'}", "--window-size=900,700", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        import urllib.request

        deadline = time.monotonic() + 30
        while True:
            try:
                targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2).read())
                page = next(target for target in targets if target["type"] == "page")
                break
            except (OSError, StopIteration):
                assert time.monotonic() < deadline, "chromium did not open its DevTools port"
                time.sleep(0.1)
        tools = DevTools(page["webSocketDebuggerUrl"])
        yield tools
        tools.close()
    finally:
        process.terminate()
        process.wait(10)


def test_browser_page_streams_the_grpc_translation(browser: DevTools, tmp_path: Path) -> None:
    with RunningServer(server_settings(DEFAULT_MODEL_DIR, http_port=free_port())) as server:
        channel, stub = server.stub()
        with channel:
            request = pb.TranslateStreamRequest(text=SENTENCE, options=pb.DecodingOptions(beam_size=BEAM))
            expected = list(stub.TranslateStream(request, timeout=30))[-1].hypotheses[0].text
        browser.send("Page.enable")
        browser.send("Page.navigate", url=f"http://127.0.0.1:{server.server.http.port}/")
        browser.wait_for("document.getElementById('model').options.length > 0")
        assert browser.evaluate("document.getElementById('model').value") == server.server.models.default.name
        browser.evaluate(f"document.getElementById('beam').value = '{BEAM}'")
        browser.evaluate("document.getElementById('source').focus()")
        browser.send("Input.insertText", text=SENTENCE)  # typed, as a keyboard's IME commits text
        browser.click("#translate")
        browser.wait_for("document.body.dataset.done === 'true'")
        assert browser.evaluate("document.getElementById('target').textContent") == expected
        assert browser.evaluate("document.getElementById('error').hidden")
        shot = base64.b64decode(browser.send("Page.captureScreenshot", format="png")["data"])
        (tmp_path / "http-page.png").write_bytes(shot)
        if os.environ.get(SCREENSHOT_ENV):
            Path(os.environ[SCREENSHOT_ENV]).write_bytes(shot)


def test_browser_page_translates_html_and_previews_it_without_scripts(browser: DevTools) -> None:
    """HTML format: the translated markup is shown as text, and rendered in a frame with every sandbox restriction
    (sandbox="": no scripts, no forms, an opaque origin the page cannot reach into)."""
    page = "<p>Guten <b>Morgen</b>!</p><script>document.title = 'ran'</script>"
    with RunningServer(server_settings(DEFAULT_MODEL_DIR, http_port=free_port())) as server:
        channel, stub = server.stub()
        with channel:
            request = pb.TranslateStreamRequest(text=page, options=pb.DecodingOptions(format="html"))
            expected = list(stub.TranslateStream(request, timeout=30))[-1].hypotheses[0].text
        browser.send("Page.navigate", url=f"http://127.0.0.1:{server.server.http.port}/")
        browser.wait_for("document.getElementById('model').options.length > 0")
        browser.evaluate("document.getElementById('format').value = 'html'")
        browser.evaluate("document.getElementById('beam').value = '1'")
        browser.evaluate("document.getElementById('source').focus()")
        browser.send("Input.insertText", text=page)
        browser.click("#translate")
        browser.wait_for("document.body.dataset.done === 'true'")
        assert "<b>" in expected and "<script>" in expected
        assert browser.evaluate("document.getElementById('target').textContent") == expected
        assert browser.evaluate("document.getElementById('preview').srcdoc") == expected
        assert browser.evaluate("document.getElementById('preview').getAttribute('sandbox')") == ""
        assert not browser.evaluate("document.getElementById('preview').hidden")
        # An opaque origin: the page itself cannot read the frame's document.
        assert browser.evaluate("document.getElementById('preview').contentDocument") is None


def test_browser_page_shows_an_error_in_words(browser: DevTools) -> None:
    with RunningServer(server_settings(DEFAULT_MODEL_DIR, http_port=free_port(), max_chars_per_text=10)) as server:
        browser.send("Page.navigate", url=f"http://127.0.0.1:{server.server.http.port}/")
        browser.wait_for("document.getElementById('model').options.length > 0")
        browser.evaluate("document.getElementById('source').focus()")
        browser.send("Input.insertText", text=SENTENCE)
        browser.click("#translate")
        message = browser.wait_for("!document.getElementById('error').hidden && document.getElementById('error').textContent")
        assert "text has 28 characters; the limit is 10 (max_chars_per_text, set by nmt-serve --max-chars-per-text)" in message and "INVALID_ARGUMENT, HTTP 400" in message
