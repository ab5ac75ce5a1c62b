"""OrtStep: the Step protocol of model/search.py over the exported ONNX graphs, for parity and evaluation. Torch-free."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from nmt_serve.model.padding import pad_sources
from nmt_serve.runtime import float_mode
from nmt_serve.runtime.manifest import Manifest, load_model_dir
from nmt_serve.runtime.native_fusions import fused_model_bytes
from nmt_serve.runtime.step_cache import StepCache

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


def make_session(path: Path, providers: Sequence[str] | None = None, threads: int = 0, profile_prefix: str = "",
                 kernels_library: Path | None = None, fuse: bool = True) -> ort.InferenceSession:  # fmt: skip
    """profile_prefix: where ONNX Runtime writes its per-node profile (PREFIX_<date>.json, at end_profiling); empty = off.
    kernels_library: a custom-op library (runtime/native_kernels.py) loaded on the CPU provider, the graph's per-row
    activation quantization and cross-attention fused in memory (runtime/native_fusions.py); if the session cannot be
    made so, it is made without the fusion, then without the library, and the reason logged. fuse=False: the library
    runs only the graph's own attention nodes."""
    chosen = list(providers or available_providers())
    if kernels_library is not None and chosen[0] == "CPUExecutionProvider":
        try:
            fused = fused_model_bytes(path) if fuse else None
            if fused is not None:
                return _make_session(path, chosen, threads, profile_prefix, kernels_library, fused)
        except ValueError as error:
            logger.warning("%s: not loadable with its nodes fused, loaded as it is: %s", Path(path).name, error)
        try:
            return _make_session(path, chosen, threads, profile_prefix, kernels_library)
        except ValueError as error:
            logger.warning("%s: not loadable with the native kernels, loaded without them: %s", Path(path).name, error)
    return _make_session(path, chosen, threads, profile_prefix, None)


def _make_session(path: Path, chosen: list[str], threads: int, profile_prefix: str, kernels_library: Path | None,
                  model_bytes: bytes | None = None) -> ort.InferenceSession:  # fmt: skip
    """The session of the graph at `path`, or of `model_bytes` (the same graph rewritten in memory) when given."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    if model_bytes is not None:  # the weights stay in the external data file beside the graph on disk
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(path).parent))
    if kernels_library is not None:
        try:
            options.register_custom_ops_library(str(kernels_library))
        except Exception as error:  # a library ONNX Runtime cannot open or register
            raise ValueError(f"{kernels_library}: onnxruntime cannot register it: {error}") from error
    # Its pool threads flush denormal floats to zero, as the engine's own thread does around its calls
    # (runtime/kernels/float_mode.c): a log-softmax over widely spread logits gives the same bits, much faster. ONNX
    # Runtime sets the flush on the thread that makes the session as well, for good; that thread's mode is put back
    # below, so the option is set only where the switch that puts it back is built.
    switch = float_mode.native_float_mode if chosen[0] == "CPUExecutionProvider" else None
    if switch is not None:
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    # ONNX Runtime's CPU SkipLayerNormalization kernel is ~4x slower per row than the Add + LayerNormalization
    # it replaces (measured: encoder int8 6.1 -> 4.4 ms at 8 x 20 tokens without the fusion, outputs equal).
    disabled = ["SkipLayerNormFusion"] if chosen[0] == "CPUExecutionProvider" else []
    # CUDA multiplies fp32 matrices in TF32 (10-bit mantissas) by default: the default model's log-probs then moved
    # by up to 4.2e-3 from the CPU's, past the fp32 self-check's bound of 1e-3. fp32 means fp32 here.
    with_options: list[str | tuple[str, dict[str, str]]] = [(name, {"use_tf32": "0"}) if name == "CUDAExecutionProvider" else name for name in chosen]
    thread_mode = switch.mode() if switch is not None else None
    try:
        session = ort.InferenceSession(model_bytes or str(path), options, providers=with_options, disabled_optimizers=disabled)
    except Exception as error:  # ORT raises several private exception types; all mean "unusable file"
        raise ValueError(f"{Path(path).name}: onnxruntime cannot load it: {error}") from error
    finally:
        if switch is not None:
            switch.restore(thread_mode)
    logger.info("%s runs on %s", Path(path).name, session.get_providers()[0])
    return session


class OrtStep:
    """The Step protocol over a StepCache: rows at different positions share one decoder.onnx call."""

    def __init__(self, model_dir: Path, providers: Sequence[str] | None = None, threads: int = 0) -> None:
        self.model_dir = model_dir
        self.manifest: Manifest = load_model_dir(model_dir)
        config = self.manifest.config
        self.config = config
        self.vocab_size = config.vocab_size
        self.encoder = make_session(self.manifest.graph_path(model_dir, "encoder"), providers, threads)
        self.decoder = make_session(self.manifest.graph_path(model_dir, "decoder"), providers, threads)
        self.cross_names = self.manifest.output_names("encoder")
        self.cache = StepCache(self.decoder, config, self.cross_names)
        self.cross: list[np.ndarray] = []
        self.src_mask = np.zeros((0, 0), dtype=bool)

    def encode(self, src_ids: np.ndarray, src_mask: np.ndarray) -> list[np.ndarray]:
        """(N, S) ids and mask -> cross K/V per layer, flat [key_0, value_0, key_1, ...]."""
        return self.encoder.run(self.cross_names, {"src_ids": src_ids, "src_mask": src_mask})

    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        ids, self.src_mask = pad_sources(src_ids, self.config.pad_id, self.config.eos_id)
        self.cross = self.encode(ids, self.src_mask)
        self.cache.reset()

    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        sources = np.asarray(source_index, dtype=np.int64)
        self.cache.arrange(np.asarray(parent_rows, dtype=np.int64), np.asarray(tgt_ids, dtype=np.int64), sources, sources, self.cross, self.src_mask)
        return self.cache.run().copy()
