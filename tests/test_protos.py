"""The committed generated gRPC code matches the .proto files, coexists with code users generate, and the API follows the style rules."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from nmt_serve.protos.generate import PROTO_FILES, PROTO_ROOT, ROOT, generate

TRANSLATION_PROTO = "nmt/translation/v1/translation.proto"


def compile_protos(out_dir: Path, *outputs: str) -> None:
    """protoc as a user runs it: import root protos/, so the file is known as nmt/translation/v1/translation.proto."""
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is a dev dependency")
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", *outputs, TRANSLATION_PROTO]) == 0


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    stale = []
    for fresh in generate(tmp_path):
        committed = PROTO_ROOT / fresh.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(committed.relative_to(ROOT)))
    assert not stale, f"stale generated code, run `make protos`: {', '.join(stale)}"


def test_every_field_enum_value_and_rpc_has_a_comment() -> None:
    for proto in PROTO_FILES:
        lines = (PROTO_ROOT / proto).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            code = line.strip()
            declares = code.endswith(";") and ("=" in code or code.startswith("rpc ")) and not code.startswith(("syntax", "package", "option"))
            if declares:
                assert lines[number - 1].strip().startswith("//"), f"{proto}:{number + 1} has no comment: {code}"


def test_enum_zero_values_end_in_unspecified() -> None:
    from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name


def test_generated_code_registers_the_proto_under_its_import_root_path() -> None:
    from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

    assert pb.DESCRIPTOR.name == TRANSLATION_PROTO


@pytest.mark.parametrize("first", ["theirs", "ours"])
def test_generated_code_imports_beside_code_a_user_compiled(tmp_path: Path, first: str) -> None:
    """A program that compiles the protos itself and also imports this package shares one descriptor, in either import order."""
    compile_protos(tmp_path, f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}")
    imports = {"theirs": "from nmt.translation.v1 import translation_pb2 as theirs, translation_pb2_grpc",
               "ours": "from protos.nmt.translation.v1 import translation_pb2 as ours, translation_pb2_grpc"}  # fmt: skip
    second = "ours" if first == "theirs" else "theirs"
    code = "\n".join([f"import sys; sys.path.insert(0, {str(tmp_path)!r})", imports[first], imports[second],
                      "assert ours.DESCRIPTOR is theirs.DESCRIPTOR",
                      "print(ours.FinishReason.Name(theirs.FINISH_REASON_EOS))"])  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "FINISH_REASON_EOS"


def test_generated_messages_pickle_through_the_package_module() -> None:
    # multiprocessing and caches pickle messages; unpickling imports the class by its __module__.
    from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

    assert pb.Hypothesis.__module__ == "nmt_serve.protos.nmt.translation.v1.translation_pb2"
    hypothesis = pb.Hypothesis(text="the dog", score=-0.5, token_count=3, finish_reason=pb.FINISH_REASON_EOS)
    assert pickle.loads(pickle.dumps(hypothesis)) == hypothesis


def test_proto_sets_the_options_other_languages_need(tmp_path: Path) -> None:
    descriptor_set = tmp_path / "translation.binpb"
    compile_protos(tmp_path, f"--descriptor_set_out={descriptor_set}")
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    options = next(file for file in files if file.name == TRANSLATION_PROTO).options
    assert options.go_package == "nmt-serve/gen/go/nmt/translation/v1;translationv1"
    assert options.java_multiple_files and options.java_outer_classname == "TranslationProto"
    assert options.java_package == "nmt.translation.v1"
    assert options.csharp_namespace == "Nmt.Translation.V1"
    assert options.objc_class_prefix == "NTX"
    assert options.php_namespace == "Nmt\\Translation\\V1" and options.ruby_package == "Nmt::Translation::V1"


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf is not installed (pip install buf-bin)")
def test_protos_pass_buf_lint() -> None:
    result = subprocess.run(["buf", "lint"], cwd=PROTO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
