"""The committed generated gRPC code matches the .proto files, and the API follows the style rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.generate import PROTO_FILES, ROOT, generate


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    stale = []
    for fresh in generate(tmp_path):
        committed = ROOT / fresh.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(committed.relative_to(ROOT)))
    assert not stale, f"stale generated code, run `make protos`: {', '.join(stale)}"


def test_every_field_enum_value_and_rpc_has_a_comment() -> None:
    for proto in PROTO_FILES:
        lines = (ROOT / proto).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            code = line.strip()
            declares = code.endswith(";") and ("=" in code or code.startswith("rpc ")) and not code.startswith(("syntax", "package", "option"))
            if declares:
                assert lines[number - 1].strip().startswith("//"), f"{proto}:{number + 1} has no comment: {code}"


def test_enum_zero_values_end_in_unspecified() -> None:
    from protos.nmt.translation.v1 import translation_pb2 as pb

    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
