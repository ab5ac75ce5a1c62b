"""The model-dir manifest: what export writes and what the server verifies before it loads a graph. Torch- and onnx-free."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from nmt_serve.model.config import IMPORT_FIELDS, ModelConfig
from nmt_serve.model.file_hash import sha256_file
from nmt_serve.model.tokenizer import TOKENIZER_FILE

logger = logging.getLogger(__name__)

# 2: the decoder step keeps a per-row cache updated in place (export/decoder_graph.py); 1 had past_mask/cache_index.
# 3: the decoder step also returns beam-search candidates (TopK of the rows asked for).
# 4: cross-attention per source (cross K/V and src_mask once per source; source_queries, row_queries).
# 5: sources in two groups, each its own width (narrow_src_mask, narrow_source_queries, narrow_cross_*).
FORMAT_VERSION = 5
MANIFEST_FILE = "manifest.json"
# One closed tuple: nmt-export's --precision choices and manifest validation both read it.
PRECISIONS = ("fp32", "fp16", "int8")
# Numpy spellings, so the server can allocate IO-binding buffers with np.dtype(spec.dtype).
DTYPES = ("float32", "float16", "int64", "int32", "int8", "uint8", "bool")
REQUIRED_GRAPHS = ("encoder", "decoder")
SPECIAL_IDS = ("pad", "bos", "eos", "unk")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A tuple is an array: write_manifest validates to_dict()'s output, where ModelConfig keeps id lists as tuples.
_JSON_KINDS = {dict: "object", list: "array", tuple: "array", str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null"}  # fmt: skip


class ModelDirError(ValueError):
    """A model dir the server must refuse; `problems` holds one 'file: problem' line each."""

    def __init__(self, model_dir: Path, problems: Sequence[str]) -> None:
        self.model_dir = Path(model_dir)
        self.problems = tuple(problems)
        # One line, so it reads whole in a log line, a health message or a container's exit reason.
        super().__init__(f"model dir {self.model_dir}: " + "; ".join(self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.model_dir, self.problems)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # one of DTYPES
    shape: tuple[str | int, ...]  # ints are fixed dims, strings symbolic ones ("batch", "src_len")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphSpec:
    file: str  # relative to the model dir; must be listed in Manifest.files
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    model_name: str
    model_version: str
    config: ModelConfig
    precision: str  # one of PRECISIONS
    opset: int
    graphs: dict[str, GraphSpec]  # holds at least REQUIRED_GRAPHS
    files: dict[str, str] = field(default_factory=dict)  # relative file name -> sha256 hex; filled by write_manifest
    parity: dict[str, Any] = field(default_factory=dict)  # free-form JSON report from export/parity.py
    created_by: dict[str, Any] = field(default_factory=dict)  # tool versions, free-form
    source_language: str = "de"
    target_language: str = "en"
    format_version: int = FORMAT_VERSION

    @property
    def special_ids(self) -> dict[str, int]:
        return {name: getattr(self.config, f"{name}_id") for name in SPECIAL_IDS}

    def graph(self, name: str) -> GraphSpec:
        if name not in self.graphs:
            raise KeyError(f"no graph {name!r} in manifest (has {', '.join(sorted(self.graphs))})")
        return self.graphs[name]

    def graph_path(self, model_dir: Path, name: str) -> Path:
        return Path(model_dir) / self.graph(name).file

    def input_names(self, name: str) -> tuple[str, ...]:
        return tuple(t.name for t in self.graph(name).inputs)

    def output_names(self, name: str) -> tuple[str, ...]:
        return tuple(t.name for t in self.graph(name).outputs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model_name": self.model_name,
            "model_version": self.model_version,
            "source_language": self.source_language,
            "target_language": self.target_language,
            "precision": self.precision,
            "opset": self.opset,
            "config": self.config.to_dict(),
            # Redundant with config on purpose: readers that do not parse ModelConfig still need them.
            "special_ids": self.special_ids,
            "graphs": {name: graph.to_dict() for name, graph in self.graphs.items()},
            "files": dict(sorted(self.files.items())),
            "parity": self.parity,
            "created_by": self.created_by,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Manifest:
        """Parse a manifest's JSON object; raise one ValueError naming every bad field."""
        manifest, _, problems = _parse_manifest(values)
        if manifest is None:
            raise ValueError("invalid manifest: " + "; ".join(problems))
        return manifest


def write_manifest(model_dir: Path, manifest_without_hashes: Manifest, files: Sequence[str]) -> Manifest:
    """Hash `files` (names relative to model_dir), write manifest.json atomically, and return what a reader will load."""
    model_dir = Path(model_dir)
    hashes: dict[str, str] = {}
    problems: list[str] = []
    for name in files:
        # Checked before hashing so a bad name never makes us read outside the model dir.
        if (problem := _file_name_problem(name)) is not None:
            problems.append(f"files: {name!r} {problem}")
        elif not (model_dir / name).is_file():
            problems.append(f"{name}: missing")
        else:
            hashes[name] = sha256_file(model_dir / name)
    manifest = dataclasses.replace(manifest_without_hashes, files=hashes)
    if not problems:
        # Validate with the reader's own checks: export must never write a model dir the server refuses.
        problems = [f"{MANIFEST_FILE}: {p}" for p in _parse_manifest(manifest.to_dict())[2]]
    if problems:
        raise ModelDirError(model_dir, problems)
    written = _save(model_dir, manifest)
    logger.info("wrote %s for %s %s (%s, %d files)", model_dir / MANIFEST_FILE, manifest.model_name, manifest.model_version,
                manifest.precision, len(hashes))  # fmt: skip
    return written


def update_parity(model_dir: Path, parity: Mapping[str, Any]) -> Manifest:
    """Replace only the parity report; the hashed files are untouched, so their hashes stay valid."""
    # Presence is checked but the (large) graphs are not rehashed: parity only reads them.
    manifest = load_model_dir(model_dir, verify_hashes=False)
    written = _save(Path(model_dir), dataclasses.replace(manifest, parity=dict(parity)))
    logger.info("updated parity report in %s", Path(model_dir) / MANIFEST_FILE)
    return written


def load_model_dir(model_dir: Path, verify_hashes: bool = True) -> Manifest:
    """Read and verify a model dir; raise one ModelDirError listing every problem found."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelDirError(model_dir, ["does not exist"])
    if not model_dir.is_dir():
        raise ModelDirError(model_dir, ["not a directory"])
    raw, problem = _read_json(model_dir / MANIFEST_FILE)
    if problem is not None:
        # Without a manifest there is no list of files to check, so this is the only problem to report.
        raise ModelDirError(model_dir, [f"{MANIFEST_FILE}: {problem}"])
    manifest, files, problems = _parse_manifest(raw)
    problems = [f"{MANIFEST_FILE}: {p}" for p in problems]
    # Files are checked even when another field is bad, so one start-up attempt shows everything to fix.
    problems += _file_problems(model_dir, files, verify_hashes)
    if problems or manifest is None:
        raise ModelDirError(model_dir, problems)
    logger.info("model dir %s: %s %s (%s, opset %d), %d files %s", model_dir, manifest.model_name, manifest.model_version,
                manifest.precision, manifest.opset, len(files), "verified" if verify_hashes else "present (hashes not checked)")  # fmt: skip
    return manifest


def _save(model_dir: Path, manifest: Manifest) -> Manifest:
    try:
        # allow_nan=False: NaN is not JSON, and non-Python readers of the manifest would choke on it.
        text = json.dumps(manifest.to_dict(), indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest for {model_dir} is not JSON-serialisable: {e}") from e
    _write_atomic(model_dir / MANIFEST_FILE, text)
    # Return the parsed text, so the caller holds exactly what the server will load (lists, not tuples, in parity).
    return Manifest.from_dict(json.loads(text))


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same dir and os.replace, so a reader sees the old manifest or the new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> tuple[Any, str | None]:
    if not path.exists():
        return None, "missing"
    if not path.is_file():
        return None, "not a regular file"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"


def _file_problems(model_dir: Path, files: Mapping[str, str], verify_hashes: bool) -> list[str]:
    problems = []
    for name, expected in sorted(files.items()):
        path = model_dir / name
        if not path.exists():
            problems.append(f"{name}: missing")
        elif not path.is_file():
            problems.append(f"{name}: not a regular file")
        elif verify_hashes:
            try:
                actual = sha256_file(path)
            except OSError as e:
                problems.append(f"{name}: unreadable ({e.strerror or e})")
                continue
            if actual != expected:
                problems.append(f"{name}: sha256 mismatch (manifest {expected[:12]}..., file {actual[:12]}...)")
    return problems


# ---- parsing: every helper appends 'field.path: problem' lines instead of raising, so all problems surface at once.


def _parse_manifest(raw: Any) -> tuple[Manifest | None, dict[str, str], list[str]]:
    """The manifest (None if any problem), its well-formed file entries (checked on disk even when others are bad), problems."""
    if not isinstance(raw, Mapping):
        return None, {}, [f"top level: expected object, got {_kind(raw)}"]
    problems: list[str] = []
    version = _take(raw, "format_version", "integer", problems, "")
    if problems or version != FORMAT_VERSION:
        # Another version may give every other field another meaning: report this alone.
        return None, {}, problems or [f"format_version {version} not supported (this server reads {FORMAT_VERSION}); "
                                      "write the model dir again with nmt-export from its checkpoint"]
    _reject_unknown(raw, {f.name for f in dataclasses.fields(Manifest)} | {"special_ids"}, "", problems)
    texts = {key: _take_text(raw, key, problems) for key in ("model_name", "model_version", "source_language", "target_language")}
    precision = _take(raw, "precision", "string", problems, "")
    if precision is not None and precision not in PRECISIONS:
        problems.append(f"precision {precision!r} not one of {', '.join(PRECISIONS)}")
    opset = _take(raw, "opset", "integer", problems, "")
    if opset is not None and opset < 1:
        problems.append(f"opset must be >= 1, got {opset}")
    config_raw = _take(raw, "config", "object", problems, "")
    config = _parse_config(config_raw, problems) if config_raw is not None else None
    _check_special_ids(raw, config, problems)
    graphs = _parse_graphs(raw, problems)
    files = _parse_files(raw, problems)
    parity = _take(raw, "parity", "object", problems, "")
    created_by = _take(raw, "created_by", "object", problems, "")
    if files is not None:
        for name, graph in (graphs or {}).items():
            if graph.file not in files:
                problems.append(f"graphs.{name}.file {graph.file!r} not listed in files")
        if TOKENIZER_FILE not in files:
            problems.append(f"files: {TOKENIZER_FILE} not listed")
    if problems:
        return None, files or {}, problems
    manifest = Manifest(format_version=version, config=config, precision=precision, opset=opset, graphs=graphs, files=files,
                        parity=dict(parity), created_by=dict(created_by), **texts)  # fmt: skip
    return manifest, files, problems


def _parse_config(raw: Mapping[str, Any], problems: list[str]) -> ModelConfig | None:
    before = len(problems)
    kinds = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "tuple[int, ...]": "array"}
    known = set()
    for f in dataclasses.fields(ModelConfig):
        known.add(f.name)
        # Every size field required: a missing one would silently take a default and mis-size the model.
        if f.name in raw or f.name not in IMPORT_FIELDS:
            value = _take(raw, f.name, kinds.get(str(f.type), "any"), problems, "config")
            # Id lists item by item: ModelConfig's int(...) raises TypeError on a null, which names no field.
            if str(f.type) == "tuple[int, ...]" and value is not None:
                for index, item in enumerate(value):
                    _expect(item, "integer", f"config.{f.name}[{index}]", problems)
    _reject_unknown(raw, known, "config", problems)
    if len(problems) > before:
        return None
    try:
        return ModelConfig.from_dict(dict(raw))
    except ValueError as e:
        problems.append(f"config: {e}")
        return None


def _check_special_ids(raw: Mapping[str, Any], config: ModelConfig | None, problems: list[str]) -> None:
    special = _take(raw, "special_ids", "object", problems, "")
    if special is None:
        return
    _reject_unknown(special, set(SPECIAL_IDS), "special_ids", problems)
    for name in SPECIAL_IDS:
        value = _take(special, name, "integer", problems, "special_ids")
        if value is not None and config is not None and value != getattr(config, f"{name}_id"):
            problems.append(f"special_ids.{name} {value} does not match config.{name}_id {getattr(config, f'{name}_id')}")


def _parse_graphs(raw: Mapping[str, Any], problems: list[str]) -> dict[str, GraphSpec] | None:
    graphs_raw = _take(raw, "graphs", "object", problems, "")
    if graphs_raw is None:
        return None
    before = len(problems)
    problems.extend(f"graphs.{name} missing" for name in REQUIRED_GRAPHS if name not in graphs_raw)
    graphs = {name: _parse_graph(value, f"graphs.{name}", problems) for name, value in graphs_raw.items()}
    if len(problems) > before:
        return {name: graph for name, graph in graphs.items() if graph is not None}
    return graphs  # type: ignore[return-value]  # no problems means no None


def _parse_graph(raw: Any, where: str, problems: list[str]) -> GraphSpec | None:
    if not _expect(raw, "object", where, problems):
        return None
    before = len(problems)
    _reject_unknown(raw, {"file", "inputs", "outputs"}, where, problems)
    file = _take(raw, "file", "string", problems, where)
    if file is not None and (problem := _file_name_problem(file)) is not None:
        problems.append(f"{where}.file {file!r} {problem}")
    inputs = _parse_tensors(raw, "inputs", where, problems)
    outputs = _parse_tensors(raw, "outputs", where, problems)
    if len(problems) > before:
        return None
    return GraphSpec(file=file, inputs=inputs, outputs=outputs)


def _parse_tensors(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> tuple[TensorSpec, ...]:
    items = _take(raw, key, "array", problems, where)
    if items is None:
        return ()
    at = f"{where}.{key}"
    if not items:
        problems.append(f"{at}: must not be empty")
    specs, seen = [], set()
    for i, item in enumerate(items):
        spec = _parse_tensor(item, f"{at}[{i}]", problems)
        if spec is not None:
            if spec.name in seen:
                problems.append(f"{at}[{i}].name {spec.name!r} repeated")
            seen.add(spec.name)
            specs.append(spec)
    return tuple(specs)


def _parse_tensor(raw: Any, where: str, problems: list[str]) -> TensorSpec | None:
    if not _expect(raw, "object", where, problems):
        return None
    before = len(problems)
    _reject_unknown(raw, {"name", "dtype", "shape"}, where, problems)
    name = _take_text(raw, "name", problems, where)
    dtype = _take(raw, "dtype", "string", problems, where)
    if dtype is not None and dtype not in DTYPES:
        problems.append(f"{where}.dtype {dtype!r} not one of {', '.join(DTYPES)}")
    shape = _take(raw, "shape", "array", problems, where) or []
    for i, dim in enumerate(shape):
        if not ((_is(dim, "integer") and dim >= 0) or (isinstance(dim, str) and dim)):
            problems.append(f"{where}.shape[{i}]: expected a non-negative integer or a dim name, got {dim!r}")
    if len(problems) > before:
        return None
    return TensorSpec(name=name, dtype=dtype, shape=tuple(shape))


def _parse_files(raw: Mapping[str, Any], problems: list[str]) -> dict[str, str] | None:
    files_raw = _take(raw, "files", "object", problems, "")
    if files_raw is None:
        return None
    files = {}
    for name, digest in files_raw.items():
        if (problem := _file_name_problem(name)) is not None:
            problems.append(f"files: {name!r} {problem}")
        elif not (isinstance(digest, str) and _SHA256_HEX.fullmatch(digest)):
            problems.append(f"files.{name}: expected a lowercase sha256 hex digest, got {digest!r}")
        else:
            files[name] = digest
    return files


def _file_name_problem(name: str) -> str | None:
    if name == MANIFEST_FILE:
        return "must not be listed (the manifest cannot hash itself)"
    path = PurePosixPath(name)
    # Names come from a file anyone can edit: keep them inside the model dir and in one canonical spelling.
    if not name or "\\" in name or path.is_absolute() or ".." in path.parts or str(path) != name:
        return "is not a plain relative path inside the model dir"
    return None


def _take(raw: Mapping[str, Any], key: str, kind: str, problems: list[str], where: str) -> Any:
    """raw[key] if present and of the JSON kind; otherwise None and a problem naming the field."""
    at = f"{where}.{key}" if where else key
    if key not in raw:
        problems.append(f"{at} missing")
        return None
    return raw[key] if _expect(raw[key], kind, at, problems) else None


def _take_text(raw: Mapping[str, Any], key: str, problems: list[str], where: str = "") -> str | None:
    value = _take(raw, key, "string", problems, where)
    if value == "":
        problems.append(f"{where + '.' if where else ''}{key} must not be empty")
    return value


def _expect(value: Any, kind: str, at: str, problems: list[str]) -> bool:
    if _is(value, kind):
        return True
    problems.append(f"{at}: expected {kind}, got {_kind(value)}")
    return False


def _is(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return _kind(value) == kind


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _reject_unknown(raw: Mapping[str, Any], known: set[str], where: str, problems: list[str]) -> None:
    # Unknown keys are refused, not ignored: a typo must not silently fall back to a default.
    for key in sorted(set(raw) - known):
        problems.append(f"{where + '.' if where else ''}{key}: unknown field")
