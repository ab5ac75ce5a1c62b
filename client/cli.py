"""nmt-translate: translate texts given as arguments or as lines on stdin."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from typing import TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from nmt_serve.client.client import DEFAULT_TARGET, Options, TranslationClient
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

logger = logging.getLogger("nmt-translate")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default unless its help already states one: unset options the server decides, and the token."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-translate", description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("texts", nargs="*", help="German texts (default: one per line from stdin)")
    parser.add_argument("--target", default=os.environ.get("NMT_TARGET", DEFAULT_TARGET), help="host:port, env NMT_TARGET")
    parser.add_argument("--model", default="", help="served model to use, by name (default: the server's default model)")
    parser.add_argument("--source-language", default="", help="language of the texts, BCP 47 or the model's code (default: the model's)")
    parser.add_argument("--target-language", default="", help="language to translate into, as --source-language (default: the model's)")
    parser.add_argument("--list-models", action="store_true", help="print the served models (name, languages, version, precision) instead of translating; "
                        "the first is the one used without --model")
    parser.add_argument("--beam", type=int, default=None, help="beam size (default: the server's, greedy)")
    parser.add_argument("--nbest", type=int, default=None, help="hypotheses per text, at most --beam (default: 1)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="output tokens per hypothesis (default: 1.5 x source tokens + 10)")  # fmt: skip
    parser.add_argument("--whole", action="store_true",
                        help="send each text to the model whole instead of sentence by sentence (split_sentences off)")
    parser.add_argument("--html", action="store_true", help="each text is HTML: its markup comes back unchanged, its text nodes translated")
    parser.add_argument("--keep", action="append", default=[], metavar="TEXT",
                        help="return every occurrence of TEXT unchanged (repeat for several)")  # fmt: skip
    parser.add_argument("--no-detect-verbatim", action="store_true",
                        help="translate URLs, paths, code, placeholders and key combinations too, instead of returning them unchanged")
    parser.add_argument("--stream", action="store_true", help="print text as it is decoded (greedy; beam search prints when done)")
    parser.add_argument("--json", action="store_true", help="one JSON object per text: source and hypotheses")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    # The token's value is never echoed by --help.
    parser.add_argument("--token", default=os.environ.get("NMT_AUTH_TOKEN", ""),
                        help="bearer token (default: env NMT_AUTH_TOKEN, else none)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=32, help="texts per request (the server's --max-texts is the most it takes)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """n-best comes from beam search: catch a missing or small --beam here instead of a server error."""
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.nbest is not None and args.nbest > 1:
        if args.beam is None:
            parser.error(f"--nbest {args.nbest} needs --beam {args.nbest} or more (n-best hypotheses come from beam search)")
        if args.beam < args.nbest:
            parser.error(f"--nbest {args.nbest} needs --beam {args.nbest} or more, got --beam {args.beam}")


def write_translation(out: TextIO, source: str, hypotheses: Sequence[pb.Hypothesis], as_json: bool, numbered: bool) -> None:
    """One text's result; the unary and the streaming paths both end here, so they print alike."""
    if as_json:
        listed = [MessageToDict(h, preserving_proto_field_name=True) for h in hypotheses]
        out.write(json.dumps({"source": source, "hypotheses": listed}, ensure_ascii=False) + "\n")
    elif numbered:  # a numbered block per text, a blank line after it, so texts and hypotheses stay apart
        out.write("".join(f"{rank}. {h.text}\n" for rank, h in enumerate(hypotheses, start=1)) + "\n")
    else:
        out.write(hypotheses[0].text + "\n")


def write_models(out: TextIO, listing: pb.ListModelsResponse, as_json: bool) -> None:
    """One line per served model, the default first."""
    for info in listing.models:
        if as_json:
            out.write(json.dumps(MessageToDict(info, preserving_proto_field_name=True), ensure_ascii=False) + "\n")
        else:
            default = " (default)" if info.name == listing.default_model else ""
            out.write(f"{info.name}{default}\t{info.source_language}->{info.target_language}\t{info.version}\t{info.precision}\n")


def read_stdin(stdin: TextIO) -> list[str]:
    """One text per line; at a terminal, a line on stderr says so first, instead of a silent wait."""
    if stdin.isatty():
        sys.stderr.write("nmt-translate: reading German text from stdin, one text per line; Ctrl-D to end (or give texts as arguments)\n")
    return [line.rstrip("\n") for line in stdin]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    numbered = args.nbest is not None and args.nbest > 1
    texts = [] if args.list_models else args.texts or read_stdin(sys.stdin)
    options = Options(beam_size=args.beam, num_hypotheses=args.nbest, max_output_tokens=args.max_output_tokens,
                      split_sentences=False if args.whole else None, keep=tuple(args.keep),
                      detect_verbatim=False if args.no_detect_verbatim else None, format="html" if args.html else None)  # fmt: skip
    out = sys.stdout
    try:
        languages = (args.source_language, args.target_language)
        with TranslationClient(args.target, token=args.token, model=args.model, languages=languages) as client:
            if args.list_models:
                write_models(out, client.list_models(timeout=args.timeout), args.json)
                return 0
            if args.stream:
                live = not args.json and not numbered  # only a single plain text can be shown as it grows
                for text in texts:
                    for message in client.translate_stream(text, options, timeout=args.timeout):
                        if live:
                            out.write(message.text_delta + ("\n" if message.final else ""))
                            out.flush()
                        elif message.final:
                            write_translation(out, text, message.hypotheses, args.json, numbered)
                return 0
            for start in range(0, len(texts), args.batch):
                chunk = texts[start : start + args.batch]
                for text, nbest in zip(chunk, client.translate(chunk, options, timeout=args.timeout), strict=True):
                    write_translation(out, text, nbest, args.json, numbered)
    except grpc.RpcError as error:
        logger.error("%s: %s", error.code().name, error.details())
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
