"""Decoder calls for comparing two runtimes of one model dir bit for bit: sources of both source groups, a beam that
reorders and a call that leaves the wide group empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nmt_serve.runtime import native_fusions
from nmt_serve.runtime.native_kernels import NativeKernels
from nmt_serve.runtime.onnx_proto import add_attribute
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings

SOURCE_LENGTHS = (5, 30, 12)  # short, long, short: the long one in the wide group, the others in the narrow one
# Each call: the rows' parents in the call before (-1: a new row) and the source each row reads. The second call
# reorders a beam; the third reads only short sources, so the wide group holds no source.
CALLS = [([-1, -1, -1, -1, -1, -1], [0, 0, 0, 1, 1, 2]), ([0, 0, 1, 3, 4, 5], [0, 0, 0, 1, 1, 2]), ([0, 1, 5], [0, 0, 2])]


def run_calls(runtime: Runtime, candidates: int = 0) -> list[np.ndarray]:
    """CALLS through the runtime's decoder over SOURCE_LENGTHS' encoded sources; each call's log-probs, and with
    `candidates` each call's best `candidates` log-probs and token ids of every other row too (the graph's TopK)."""
    config = runtime.config
    rng = np.random.default_rng(5)
    width = 32
    ids = np.full((len(SOURCE_LENGTHS), width), config.pad_id, dtype=np.int64)
    mask = np.zeros((len(SOURCE_LENGTHS), width), dtype=bool)
    for source, length in enumerate(SOURCE_LENGTHS):
        ids[source, : length - 1] = rng.integers(4, config.vocab_size, length - 1)
        ids[source, length - 1] = config.eos_id
        mask[source, :length] = True
    cross = runtime.encode(ids, mask)
    cache = runtime.new_step_cache()
    results = []
    for parents, sources in CALLS:
        tokens = rng.integers(4, config.vocab_size, len(parents)).astype(np.int64)
        picked = np.arange(0, len(parents), 2) if candidates else None
        cache.arrange(np.array(parents), tokens, np.array(sources), np.array(sources), cross, mask, picked, candidates)
        results.append(cache.run().copy())
        if candidates:
            results += [found.copy() for found in cache.candidates()]
    return results


def model_dir_for(model: str, request: pytest.FixtureRequest, fixtures: dict[str, str]) -> Path:
    """The int8 dir a comparison names: 'imported Marian int8' (post-norm, swish), 'imported NLLB int8' (pre-norm), or
    one of `fixtures` (name -> fixture)."""
    if model.startswith("imported"):
        return request.getfixturevalue("imported_marian" if "Marian" in model else "imported_nllb") / "onnx-int8"
    return request.getfixturevalue(fixtures[model])


def with_and_without(model_dir: Path, library: Path, fusion: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Runtime, Runtime]:
    """Runtimes of `model_dir` on the native kernels with every fusion, and with all but `fusion` (a FUSIONS name)."""
    settings = RuntimeSettings(warmup_rows=4, warmup_src_len=8, native_kernels=str(library))
    fused = Runtime(model_dir, settings)
    with monkeypatch.context() as patch:
        patch.delitem(native_fusions.FUSIONS, fusion)
        return fused, Runtime(model_dir, settings)


def fused_and_stock_calls(model_dir: Path, library: Path, fusion: str, kernel: str, monkeypatch: pytest.MonkeyPatch,
                          candidates: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """run_calls (with `candidates`) through `model_dir` with every fusion and without `fusion`, paired result by result;
    asserts that the fused runtime ran its `kernel` (a NativeKernels counter) once per call."""
    fused, stock = with_and_without(model_dir, library, fusion, monkeypatch)
    counters = NativeKernels(library)
    before = counters.calls()[kernel]
    fused_results = run_calls(fused, candidates)
    assert counters.calls()[kernel] - before == len(CALLS)
    return list(zip(fused_results, run_calls(stock, candidates), strict=True))


def fused_and_stock_products(model_dir: Path, library: Path, fusion: str, kernel: str,
                              monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:  # fmt: skip
    """run_calls through `model_dir` with every fusion and without `fusion`, then one encoder call of each (3 sources of
    24 positions, the last one 7 long), paired result by result; and how often the fused runtime's run_calls ran its
    `kernel` (a NativeKernels counter). Asserts that the stock runtime ran it never."""
    fused, stock = with_and_without(model_dir, library, fusion, monkeypatch)
    counters = NativeKernels(library)
    before = counters.calls()[kernel]
    fused_results = run_calls(fused)
    middle = counters.calls()[kernel]
    stock_results = run_calls(stock)
    assert counters.calls()[kernel] == middle
    ids = np.random.default_rng(6).integers(4, fused.config.vocab_size, (3, 24)).astype(np.int64)
    mask = np.ones((3, 24), dtype=bool)
    mask[2, 7:] = False
    fused_results += fused.encode(ids, mask)
    stock_results += stock.encode(ids, mask)
    return list(zip(fused_results, stock_results, strict=True)), middle - before


def set_attribute(node, name: str, value: int) -> None:  # a NodeProto of runtime/onnx_proto.py
    """Set an int attribute of a parsed node, adding it where the node leaves it at its default."""
    existing = [found for found in node.attribute if found.name == name]
    if existing:
        existing[0].i = value
    else:
        add_attribute(node, name, value)
