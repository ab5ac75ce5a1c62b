"""nmt-parity: a model dir against its PyTorch checkpoint (--checkpoint), or against its stored reference on this host.

Without --checkpoint it needs no torch: the host self-check (runtime/self_check.py) runs on a
serving install and exits 1 when this host's results are beyond the model dir's bound.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from importlib.metadata import version

from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import SELF_CHECK_FILE, SelfCheckError, check_model_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-parity", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("model_dir", type=Path, help="exported model dir (manifest.json, encoder.onnx, decoder.onnx)")
    parser.add_argument("--checkpoint", type=Path,
                        help="the checkpoint dir it was exported from: full parity, written into manifest.json (needs the export extra)")
    parser.add_argument("--test", type=Path, help="with --checkpoint: TSV of German<TAB>English pairs (default: random sentences, no BLEU)")
    parser.add_argument("--limit", type=int, default=0, help="with --checkpoint: only the first N pairs (0 = all)")
    parser.add_argument("--threads", type=int, default=0, help="without --checkpoint: ONNX Runtime threads (0 = one per core)")
    return parser


def check_this_host(model_dir: Path, threads: int) -> int:
    step = OrtStep(model_dir, threads=threads)
    try:
        result = check_model_dir(model_dir, step.encode, step.cache, step.config)
    except SelfCheckError as error:
        logging.error("%s", error)
        return 1
    if result is None:
        logging.error("%s has no %s: export it again to get one", model_dir, SELF_CHECK_FILE)
        return 1
    sys.stdout.write(result.describe() + "\n")
    return 0 if result.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.checkpoint is None:
        return check_this_host(args.model_dir, args.threads)
    try:
        from nmt_serve.export.parity import run_parity
    except ModuleNotFoundError as error:
        logging.error("nmt-parity --checkpoint needs torch and sacrebleu: pip install 'nmt-serve[export]' (%s)", error)
        return 2
    run_parity(args.model_dir, args.checkpoint, args.test, args.limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
