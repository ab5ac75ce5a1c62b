"""Regenerates the committed Python code for the .proto files (needs grpcio-tools, a dev dependency).

The generated modules are committed so that the `serve` extra needs no code generator;
tests/test_protos.py fails when they differ from what this produces.

protoc runs with the import root protos/, the one every other language compiles from, so the
descriptors register as `nmt/translation/v1/translation.proto`: a program that also compiles the
protos itself (same root) shares them instead of failing on duplicate symbols. protoc then names the
Python modules `nmt.translation.v1...`, while they live in the package `nmt_serve.protos`; the plugins have no
option for a package prefix, so `qualify` adds it to the two places that name a module.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"  # protoc's import root; also the Python package `nmt_serve.protos`
PACKAGE = "nmt_serve.protos"
PROTO_FILES = ("nmt/translation/v1/translation.proto",)  # relative to PROTO_ROOT

logger = logging.getLogger(__name__)


def replace_once(path: Path, old: str, new: str) -> None:
    """Fails loudly when a generator update changes the text, rather than leaving a module unqualified."""
    text = path.read_text(encoding="utf-8")
    if text.count(old) != 1:
        raise RuntimeError(f"{path}: expected exactly one {old!r}")
    path.write_text(text.replace(old, new), encoding="utf-8")


def qualify(out_dir: Path, stem: str) -> None:
    """Puts the package prefix on the module names protoc derived from the import root."""
    module = stem.replace("/", ".") + "_pb2"
    package, _, name = module.rpartition(".")
    # The message classes' __module__ (pickle finds the classes through it).
    replace_once(out_dir / f"{stem}_pb2.py", f"(DESCRIPTOR, '{module}', _globals)", f"(DESCRIPTOR, '{PACKAGE}.{module}', _globals)")
    # The service module's import of the messages.
    replace_once(out_dir / f"{stem}_pb2_grpc.py", f"from {package} import {name} as ", f"from {PACKAGE}.{package} import {name} as ")


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under `out_dir`; returns their paths."""
    from grpc_tools import protoc  # only here: the serve extra does not ship it

    include = Path(protoc.__file__).parent / "_proto"  # the well-known types
    for proto in PROTO_FILES:
        outputs = [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", *outputs, proto]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        qualify(out_dir, proto.removesuffix(".proto"))
    stems = [proto.removesuffix(".proto") for proto in PROTO_FILES]
    return [out_dir / f"{stem}{suffix}" for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate():
        logger.info("wrote %s", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
