"""nmt-translate: translate texts given as arguments or as lines on stdin."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from client.client import DEFAULT_TARGET, Options, TranslationClient

logger = logging.getLogger("nmt-translate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-translate", description=__doc__)
    parser.add_argument("texts", nargs="*", help="German texts; none: one per line from stdin")
    parser.add_argument("--target", default=os.environ.get("NMT_TARGET", DEFAULT_TARGET), help="host:port (env NMT_TARGET)")
    parser.add_argument("--beam", type=int, default=None, help="beam size (server default: greedy)")
    parser.add_argument("--nbest", type=int, default=None, help="hypotheses per text")
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--stream", action="store_true", help="print text as it is decoded (greedy)")
    parser.add_argument("--json", action="store_true", help="one JSON object per text")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds")
    parser.add_argument("--token", default=os.environ.get("NMT_AUTH_TOKEN", ""), help="bearer token (env NMT_AUTH_TOKEN)")
    parser.add_argument("--batch", type=int, default=32, help="texts per request when reading stdin")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
    options = Options(beam_size=args.beam, num_hypotheses=args.nbest, max_output_tokens=args.max_output_tokens)
    out = sys.stdout
    try:
        with TranslationClient(args.target, token=args.token) as client:
            if args.stream:
                for text in texts:
                    for message in client.translate_stream(text, options, timeout=args.timeout):
                        if args.json and message.final:
                            out.write(json.dumps(MessageToDict(message, preserving_proto_field_name=True), ensure_ascii=False) + "\n")
                        elif not args.json:
                            out.write(message.text_delta)
                            out.flush()
                    if not args.json:
                        out.write("\n")
                return 0
            for start in range(0, len(texts), args.batch):
                chunk = texts[start : start + args.batch]
                for text, nbest in zip(chunk, client.translate(chunk, options, timeout=args.timeout), strict=True):
                    if args.json:
                        hypotheses = [MessageToDict(h, preserving_proto_field_name=True) for h in nbest]
                        out.write(json.dumps({"source": text, "hypotheses": hypotheses}, ensure_ascii=False) + "\n")
                    else:
                        out.write("\n".join(h.text for h in nbest) + "\n")
    except grpc.RpcError as error:
        logger.error("%s: %s", error.code().name, error.details())
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
