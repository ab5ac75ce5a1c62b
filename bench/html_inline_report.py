"""How often format "html" places an inline element's tags by a match in the block's translation, and how often by
its fallback (the element's relative place), with a real model: on hand-written German help sentences and on the HTML
documentation of installed Debian packages (English pages: the German model mostly copies or mangles them).

Each measured block is parsed as the server parses it (model/html_text.py); its flow text and its elements' own texts
go to a server process as plain texts (the placeholders of kept inline elements kept, as the server keeps them), and
the placements are computed from those translations as the server computes them (tests/test_html_serving.py checks
that this equals the server's own page). Only blocks with an element that needs a match are sent to the model; the
methods are those of model/inline_tags.py.

    python -m nmt_serve.bench.html_inline_report
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc

from nmt_serve.bench.load_report import ROOT, ServerProcess
from nmt_serve.bench.report import write_report
from nmt_serve.model.html_text import Flow, HtmlDocument, parse_html
from nmt_serve.model.inline_tags import MATCHED
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger("nmt-html-inline-report")
METHODS = (*MATCHED, "empty", "relative")
MAX_FLOW_CHARS = 1500  # longer blocks are left out (the server's default max_chars_per_text applies to a text)
# German help sentences with inline elements, written for this measure (held by no training set).
HELP_SENTENCES = (
    "<p>Klicken Sie auf <b>Datei</b>, um die Datei zu speichern.</p>",
    "<p>Wählen Sie <b>Format - Zeichen</b> und dann das Register <i>Schrift</i>.</p>",
    "<p>Die Änderungen werden erst nach einem <strong>Neustart</strong> wirksam.</p>",
    '<p>Weitere Informationen finden Sie in der <a href="hilfe.html">Online-Hilfe</a>.</p>',
    "<p>Drücken Sie <kbd>Strg+S</kbd>, um das <em>aktuelle Dokument</em> zu speichern.</p>",
    "<p>Mit dieser Funktion können Sie <em>mehrere Tabellen</em> gleichzeitig bearbeiten.</p>",
    '<p>Das Symbol <span class="icon">Speichern</span> befindet sich in der Standardleiste.</p>',
    "<p>Geben Sie den Befehl <code>make install</code> in einem <b>Terminal</b> ein.</p>",
    "<p>Diese Einstellung gilt nur für <u>neue</u> Dokumente.</p>",
    "<p>Die Formel E = mc<sup>2</sup> wird als Bild eingefügt.</p>",
    "<p>Öffnen Sie das Menü <b>Extras</b> und wählen Sie <b>Optionen</b>.</p>",
    '<p><a href="#pdf">Hier klicken</a>, um die <abbr title="Portable Document Format">PDF</abbr>-Datei zu öffnen.</p>',
    "<p>Markierte Zellen werden <mark>gelb</mark> hervorgehoben.</p>",
    "<p>Sie haben die Datei noch nicht <strong>gespeichert</strong>.</p>",
    '<p>Lesen Sie <a href="lizenz.html">die <em>vollständige</em> Lizenz</a>, bevor Sie das Programm installieren.</p>',
    "<p>Die Tabelle enthält <small>(optional)</small> eine Kopfzeile.</p>",
    "<p>Wenn Sie <b>Automatisch speichern</b> aktivieren, wird das Dokument regelmäßig gesichert.</p>",
    "<p>Klicken Sie mit der rechten Maustaste auf das Bild und wählen Sie <i>Bild ersetzen</i>.</p>",
    '<p>Der <span translate="no">LibreOffice</span>-Assistent führt Sie durch die <b>Installation</b>.</p>',
    "<p>Ziehen Sie die Datei in das Fenster oder klicken Sie auf <b>Öffnen</b>.</p>",
)


def debian_pages(limit: int) -> list[Path]:
    """The pages tests/test_html_text.py reads: the first `limit` HTML files of installed documentation, sorted."""
    paths = glob.glob("/usr/share/doc/*/html/*.html") + glob.glob("/usr/share/doc/*/*.html")
    return [Path(path) for path in sorted(path for path in paths if os.path.isfile(path))[:limit]]


def measured_flows(documents: list[HtmlDocument]) -> list[tuple[HtmlDocument, Flow]]:
    """Every flow with an element that needs the model to be placed (a probe), short enough to send."""
    return [(document, part) for document in documents for part in document.parts
            if isinstance(part, Flow) and any(tag.probe is not None for tag in part.tags) and len(part.text) <= MAX_FLOW_CHARS]  # fmt: skip


def evenly(items: list[tuple[HtmlDocument, Flow]], count: int) -> list[tuple[HtmlDocument, Flow]]:
    """`count` items spread evenly over the list (all when it holds fewer): every page region has its share."""
    if len(items) <= count:
        return items
    return [items[index * len(items) // count] for index in range(count)]


async def placements(target: str, flows: list[tuple[HtmlDocument, Flow]]) -> tuple[Counter[str], list[tuple[HtmlDocument, str]]]:
    """The methods that placed the flows' elements, and each flow rendered (its tags around the translation)."""
    methods: Counter[str] = Counter()
    rendered: list[tuple[HtmlDocument, str]] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        for document, flow in flows:
            indexes = [flow.index, *(tag.probe for tag in flow.tags if tag.probe is not None)]
            texts = [document.texts[index] for index in indexes]
            keep = [pb.KeepSpan(text=character) for character, _ in flow.markup]
            try:
                reply = await stub.Translate(pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(keep=keep)), timeout=300)
            except grpc.aio.AioRpcError as error:
                logger.warning("block left out (%s): %.80s", error.details(), flow.text)
                continue
            translations = list(document.texts)  # texts not sent (alt/title values) show as they were
            for index, translation in zip(indexes, reply.translations, strict=True):
                translations[index] = translation.hypotheses[0].text
            methods.update(placement.method for placement in flow.placements(translations))
            rendered.append((document, flow.render(translations)))
    return methods, rendered


def row(name: str, flows: int, methods: Counter[str]) -> str:
    elements = sum(methods.values())
    searched = elements - methods["whole"] - methods["empty"]
    found = sum(methods[method] for method in MATCHED) - methods["whole"]
    cells = " | ".join(str(methods[method]) for method in METHODS)
    return f"| {name} | {flows} | {elements} | {cells} | {found} of {searched} ({100 * found / max(searched, 1):.0f}%) |"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nmt_serve.bench.html_inline_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8")
    parser.add_argument("--pages", type=int, default=40, help="Debian HTML pages read (tests/test_html_text.py reads 40)")
    parser.add_argument("--flows", type=int, default=1000, help="blocks of those pages sent to the model, at most, spread evenly")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "html-inline.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    help_documents = [parse_html(page) for page in HELP_SENTENCES]
    pages = debian_pages(args.pages)
    parsed = [parse_html(path.read_text(encoding="utf-8", errors="replace")) for path in pages]
    debian = evenly(measured_flows(parsed), args.flows)
    # Whole and empty elements are placed without the model: counted on every flow of the pages, translations as sent.
    without_model = Counter(placement.method for document in parsed for placement in document.placements(document.texts))
    header = ["| set | blocks | inline elements | " + " | ".join(METHODS) + " | found by a match |", "|---" * (len(METHODS) + 4) + "|"]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(args.model_dir, Path(tmp), "--http-port", "0")
        try:
            help_methods, help_rendered = asyncio.run(placements(server.target, measured_flows(help_documents)))
            debian_methods, _ = asyncio.run(placements(server.target, debian))
        finally:
            server.stop()
    lines = [*header, row("German help sentences (hand-written)", len(help_rendered), help_methods),
             row(f"Debian HTML docs ({len(pages)} pages)", len(debian), debian_methods)]  # fmt: skip
    model = args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir
    notes = (f"Model dir: {model}, greedy, sentences split, detect_verbatim on. Methods: model/inline_tags.py (whole: the element "
             "holds all of its block's or parent's text, nothing to search; empty: an element without text). \"Found by a match\" "
             "counts exact, case, trimmed, stem and source among the elements that were searched for (all but whole and empty); the "
             "rest took the fallback, their relative place. The Debian pages are English, and a German model translates "
             "English text poorly: their row says how the method fares on text the model does not know, the German row on "
             "the text it is for. Neither figure depends on the machine's speed.")  # fmt: skip
    inventory = (f"The {len(pages)} Debian pages hold {sum(without_model.values())} inline elements in flows: {without_model['whole']} "
                 f"hold all of their block's or parent's text and {without_model['empty']} none (both placed without a search), the other "
                 f"{sum(without_model.values()) - without_model['whole'] - without_model['empty']} are searched for; the table's row holds the "
                 f"blocks with at least one of those, up to --flows (longer than {MAX_FLOW_CHARS} characters left out), spread evenly.")
    sources = {id(document): page for page, document in zip(HELP_SENTENCES, help_documents, strict=True)}
    sample = "\n".join(f"- `{sources[id(document)]}` → `{target}`" for document, target in help_rendered)
    write_report("Inline tags in format html: placed by a match or by the fallback", "python -m nmt_serve.bench.html_inline_report",
                 argv, ["\n".join(lines), notes, inventory, "The German sentences as they came back:\n\n" + sample], args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
