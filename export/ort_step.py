"""OrtStep: the Step protocol of model/search.py over the exported ONNX graphs (plain; the server has the fast one). Torch-free."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from export.manifest import Manifest, load_model_dir
from model.padding import pad_sources

logger = logging.getLogger(__name__)


def available_providers() -> list[str]:
    """CUDA first when this onnxruntime build has it and an NVIDIA driver is loaded, CPU always last.

    onnxruntime-gpu lists CUDAExecutionProvider even on machines without a GPU (and then logs
    errors when a session asks for it), so the driver is checked too; the session reports
    the provider that really runs.
    """
    has_driver = Path("/proc/driver/nvidia/version").exists()
    cuda = ["CUDAExecutionProvider"] if has_driver and "CUDAExecutionProvider" in ort.get_available_providers() else []
    return [*cuda, "CPUExecutionProvider"]


def make_session(path: Path, providers: Sequence[str] | None = None, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    try:
        session = ort.InferenceSession(str(path), options, providers=list(providers or available_providers()))
    except Exception as error:  # ORT raises several private exception types; all mean "unusable file"
        raise ValueError(f"{Path(path).name}: onnxruntime cannot load it: {error}") from error
    logger.info("%s runs on %s", Path(path).name, session.get_providers()[0])
    return session


class OrtStep:
    """Rows at different positions share one decoder.onnx call; reorders happen inside the graph."""

    def __init__(self, model_dir: Path, providers: Sequence[str] | None = None, threads: int = 0) -> None:
        self.manifest: Manifest = load_model_dir(model_dir)
        config = self.manifest.config
        self.config = config
        self.vocab_size = config.vocab_size
        self.encoder = make_session(self.manifest.graph_path(model_dir, "encoder"), providers, threads)
        self.decoder = make_session(self.manifest.graph_path(model_dir, "decoder"), providers, threads)
        self.cross_names = self.manifest.output_names("encoder")
        self.present_names = self.manifest.output_names("decoder")[1:]
        self.past_names = [name.replace("present_", "past_") for name in self.present_names]
        self.cross: list[np.ndarray] = []
        self.src_mask = np.zeros((0, 0), dtype=bool)
        self.reset_rows()

    def reset_rows(self) -> None:
        shape = (1, self.config.n_heads, 0, self.config.head_dim)
        self.past = [np.zeros(shape, dtype=np.float32) for _ in self.past_names]
        self.past_mask = np.zeros((0, 0), dtype=bool)  # (R, P)
        self.positions = np.zeros(0, dtype=np.int64)  # (R,) position of the next token

    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        ids, self.src_mask = pad_sources(src_ids, self.config.pad_id, self.config.eos_id)
        self.cross = self.encoder.run(self.cross_names, {"src_ids": ids, "src_mask": self.src_mask})
        self.reset_rows()

    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        parents = np.asarray(parent_rows, dtype=np.int64)
        is_new = parents < 0
        cache_index = np.maximum(parents, 0)
        if len(self.positions) == 0:
            past_mask = np.zeros((len(parents), 0), dtype=bool)
            positions = np.zeros(len(parents), dtype=np.int64)
        else:
            past_mask = self.past_mask[cache_index] & ~is_new[:, None]
            positions = np.where(is_new, 0, self.positions[cache_index])
        feeds = {
            "tgt_ids": np.asarray(tgt_ids, dtype=np.int64)[:, None],
            "positions": positions,
            "cache_index": cache_index,
            "past_mask": past_mask,
            "source_index": np.asarray(source_index, dtype=np.int64),
            "src_mask": self.src_mask,
            **dict(zip(self.past_names, self.past, strict=True)),
            **dict(zip(self.cross_names, self.cross, strict=True)),
        }
        log_probs, *self.past = self.decoder.run(None, feeds)
        self.past_mask = np.concatenate([past_mask, np.ones((len(parents), 1), dtype=bool)], axis=1)
        self.positions = positions + 1
        return log_probs
