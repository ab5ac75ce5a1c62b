"""Regenerates the committed Python code for the .proto files (needs grpcio-tools, a dev dependency).

The generated modules are committed so that the `serve` extra needs no code generator;
tests/test_protos.py fails when they differ from what this produces.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # imports in generated code are relative to it: `protos.nmt...`
PROTO_FILES = ("protos/nmt/translation/v1/translation.proto",)

logger = logging.getLogger(__name__)


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under `out_dir`; returns their paths."""
    from grpc_tools import protoc  # only here: the serve extra does not ship it

    include = Path(protoc.__file__).parent / "_proto"  # the well-known types
    for proto in PROTO_FILES:
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", proto]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    stems = [proto.removesuffix(".proto") for proto in PROTO_FILES]
    return [out_dir / f"{stem}{suffix}" for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate():
        logger.info("wrote %s", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
