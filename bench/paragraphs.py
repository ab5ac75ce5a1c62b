"""nmt-paragraphs: BLEU of paragraphs sent whole, paragraphs split into sentences by the server, and their sentences one by one.

Paragraphs are consecutive held-out sentence pairs, 2 to 5 at a time (seeded), German and English
each joined with a space. All three ways run through a real nmt-serve server on a loopback port (the
service's splitting and joining included) and are scored per paragraph with model/evaluate.py's
sacrebleu score, so they compare on the same references.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-paragraphs", "dev", ("torch", "sacrebleu"))

import grpc

from nmt_serve.bench.report import write_report
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.evaluate import score
from nmt_serve.model.sentences import split_spans
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from nmt_serve.server.main import Server
from nmt_serve.server.settings import DEFAULT_MODEL_DIR, ServerSettings

logger = logging.getLogger(__name__)

DEFAULT_TEST = Path("data/corpus/test.tsv")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "paragraphs.md"
TEXTS_PER_REQUEST = 64  # the server's default max_texts


@dataclasses.dataclass(frozen=True)
class Paragraph:
    sentences: tuple[str, ...]  # German
    reference: str  # the English references joined with a space

    @property
    def text(self) -> str:
        return " ".join(self.sentences)


def make_paragraphs(pairs: Sequence[tuple[str, str]], seed: int, fewest: int = 2, most: int = 5) -> list[Paragraph]:
    """Consecutive pairs in groups of `fewest` to `most` (at least `fewest` pairs in all)."""
    rng = random.Random(seed)
    paragraphs, start = [], 0
    while start < len(pairs):
        size, remaining = rng.randint(fewest, most), len(pairs) - start
        if 0 < remaining - size < fewest:  # never leave a remainder too short to be a paragraph
            size = remaining - fewest if remaining - fewest >= fewest else remaining
        group = pairs[start:start + size]
        paragraphs.append(Paragraph(tuple(german for german, _ in group), " ".join(english for _, english in group)))
        start += len(group)
    return paragraphs


def translate(stub: pb_grpc.TranslationServiceStub, texts: Sequence[str], options: pb.DecodingOptions) -> list[str]:
    """Best translations, in order, TEXTS_PER_REQUEST texts per call."""
    out: list[str] = []
    for start in range(0, len(texts), TEXTS_PER_REQUEST):
        request = pb.TranslateRequest(texts=list(texts[start:start + TEXTS_PER_REQUEST]), options=options)
        out += [translation.hypotheses[0].text for translation in stub.Translate(request, timeout=600).translations]
    return out


def measure(stub: pb_grpc.TranslationServiceStub, paragraphs: Sequence[Paragraph], beam: int) -> list[tuple[str, dict[str, float], float]]:
    """(way, scores, seconds) for paragraphs whole, split, and their sentences one by one."""
    references = [paragraph.reference for paragraph in paragraphs]
    results = []
    for way in ("whole", "split", "one by one"):
        options = pb.DecodingOptions(beam_size=beam, split_sentences=way == "split")
        started = time.perf_counter()
        if way == "one by one":
            sentences = [sentence for paragraph in paragraphs for sentence in paragraph.sentences]
            translated = iter(translate(stub, sentences, options))
            hypotheses = [" ".join(next(translated) for _ in paragraph.sentences) for paragraph in paragraphs]
        else:
            hypotheses = translate(stub, [paragraph.text for paragraph in paragraphs], options)
        seconds = time.perf_counter() - started
        results.append((way, score(hypotheses, references), seconds))
        logger.info("beam %d, %s: %s in %.1f s", beam, way, results[-1][1], seconds)
    return results


def boundaries_found(paragraphs: Sequence[Paragraph]) -> tuple[int, int]:
    """Paragraphs whose every corpus line starts a sentence span; paragraphs with more spans than lines."""
    found = extra = 0
    for paragraph in paragraphs:
        starts, offset = set(), 0
        for sentence in paragraph.sentences:
            starts.add(offset)
            offset += len(sentence) + 1
        spans = split_spans(paragraph.text)
        found += starts <= {start for start, _ in spans}
        extra += len(spans) > len(paragraph.sentences)
    return found, extra


class InProcessServer:
    """nmt-serve on a free loopback port in a thread of this process; queue limits wide enough for a whole request's sentences."""

    def __init__(self, model_dir: Path, engines: int, threads: int) -> None:
        settings = ServerSettings(model_dir=model_dir, port=0, metrics_port=-1, engines=engines, threads=threads,
                                  max_queued_requests=1 << 16, max_queued_tokens=1 << 22, default_deadline_s=600.0,
                                  max_deadline_s=600.0, cache_mb=0)  # fmt: skip
        # cache_mb=0: every way is timed on the model's work; the cache would answer the sentences one by one
        # from what the split way translated before.
        self.server = Server(settings)
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.run(install_signals=False)), daemon=True)

    def __enter__(self) -> pb_grpc.TranslationServiceStub:
        self._thread.start()
        if not self.server.serving.wait(300):
            raise RuntimeError("the server did not become ready")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        return pb_grpc.TranslationServiceStub(self._channel)

    def __exit__(self, *_: object) -> None:
        self._channel.close()
        self.server.request_stop()
        self._thread.join(60)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-paragraphs", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--test", type=Path, default=DEFAULT_TEST, help="TSV of German<TAB>English pairs, in order")
    parser.add_argument("--seed", type=int, default=0, help="seeds the paragraph sizes")
    parser.add_argument("--beams", default="1,4", help="comma-separated beam sizes (1 = greedy)")
    parser.add_argument("--engines", type=int, default=0, help="as nmt-serve --engines (0 = its default)")
    parser.add_argument("--threads", type=int, default=0, help="as nmt-serve --threads (0 = its default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pairs = read_tsv(str(args.test))
    paragraphs = make_paragraphs(pairs, args.seed)
    lines = ["| search | way | BLEU | chrF | seconds |", "|---|---|---|---|---|"]
    with InProcessServer(args.model_dir, args.engines, args.threads) as stub:
        for beam in (int(value) for value in args.beams.split(",")):
            for way, scores, seconds in measure(stub, paragraphs, beam):
                search = "greedy" if beam == 1 else f"beam {beam}"
                lines.append(f"| {search} | {way} | {scores['bleu']:.2f} | {scores['chrf']:.2f} | {seconds:.1f} |")
    sizes = [len(paragraph.sentences) for paragraph in paragraphs]
    found, extra = boundaries_found(paragraphs)
    model = args.model_dir.resolve()
    model = model.relative_to(Path.cwd()) if model.is_relative_to(Path.cwd()) else model
    intro = (f"{len(pairs)} held-out pairs of `{args.test}` in {len(paragraphs)} paragraphs of {min(sizes)} to {max(sizes)} "
             f"consecutive sentences (seed {args.seed}; mean {sum(sizes) / len(sizes):.2f}), model `{model}`. The splitter "
             f"(model/sentences.py) found every boundary between the corpus lines in {found} of the {len(paragraphs)} paragraphs, "
             f"and cut {extra} paragraphs inside a line as well (corpus lines holding two sentences, such as "
             "\"Halt! Ich komme nicht nach.\"). "
             "**whole**: each paragraph one input (`split_sentences` false); **split**: the server splits each paragraph "
             "into sentences and joins their translations (`split_sentences` on, the default); **one by one**: each "
             "reference sentence sent as its own text, the translations joined with a space. BLEU and chrF are "
             "sacrebleu's corpus scores over the paragraphs (model/evaluate.py's score), against the joined references. "
             "Seconds are wall time through a loopback gRPC server, requests of 64 texts one after another.")  # fmt: skip
    write_report("Paragraphs: whole, split into sentences, and one by one", "nmt-paragraphs", argv, [intro, "\n".join(lines)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
