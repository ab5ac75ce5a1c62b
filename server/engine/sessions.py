"""Runtime: ONNX Runtime sessions for a verified model dir (CUDA when present, else CPU), with warm-up."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmt_serve.model import search
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.runtime import float_mode, step_cache
from nmt_serve.runtime.manifest import Manifest, load_model_dir
from nmt_serve.runtime.native_kernels import resolve_native_kernels
from nmt_serve.runtime.ort_step import available_providers, make_session
from nmt_serve.runtime.self_check import SELF_CHECK_FILE, SelfCheckResult, check_model_dir
from nmt_serve.runtime.step_cache import StepCache

logger = logging.getLogger(__name__)


def host_work_description() -> str:
    """What the engine's host work runs on in this process, as the start-up log and the benchmark reports say it:
    beam search's choice, the cache moves and steady greedy and beam steps compiled or in Python and numpy, and whether the
    engine's calls flush denormals."""
    compiled = {"beam search's choice": search.native_beam_select, "cache moves": step_cache.native_cache_moves,
                "steady greedy steps": step_cache.native_greedy_step, "steady beam steps": step_cache.native_beam_step}  # fmt: skip
    parts = ", ".join(f"{what} {'compiled' if module else 'in Python (`make kernels` compiles it)'}" for what, module in compiled.items())
    flushing = ("flush denormal floats" if float_mode.native_float_mode is not None
                else "keep the thread's float mode (`make kernels` builds the switch)")
    return f"{parts}; its calls {flushing}"


@dataclass(frozen=True)
class RuntimeSettings:
    providers: tuple[str, ...] = ()  # empty = CUDA first when a driver is present, else CPU
    intra_op_threads: int = 0  # 0 = one per core
    warmup_rows: int = 64  # the largest decoder batch warm-up runs before the engine reports ready
    warmup_src_len: int = 64
    decoder_profile_prefix: str = ""  # ONNX Runtime's per-node profile of the decoder (bench/step_profile.py); empty = off
    # The decoder's attention and both graphs' row quantization on the native kernels (runtime/native_kernels.py): 'auto' =
    # when built, 'off', or a library path. Off by default here; the server's flag defaults to 'auto'.
    native_kernels: str = "off"


class Runtime:
    """The encoder and decoder sessions of one model dir; `encode` and `decode` are plain calls."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings = RuntimeSettings()) -> None:
        self.model_dir = Path(model_dir)
        self.manifest: Manifest = load_model_dir(self.model_dir)
        self.config: ModelConfig = self.manifest.config
        self.tokenizer = Tokenizer.load(self.model_dir)
        providers = list(settings.providers) or available_providers()
        # CPU kernels: on CUDA the library is not loaded at all.
        on_cpu = providers[0] == "CPUExecutionProvider"
        self.native_kernels = resolve_native_kernels(settings.native_kernels) if on_cpu else None
        library = self.native_kernels.path if self.native_kernels else None
        self.encoder = make_session(self.manifest.graph_path(self.model_dir, "encoder"), providers, settings.intra_op_threads,
                                    kernels_library=library)
        self.decoder = make_session(self.manifest.graph_path(self.model_dir, "decoder"), providers, settings.intra_op_threads,
                                    settings.decoder_profile_prefix, library)
        self.provider = self.decoder.get_providers()[0]
        self.kernels_in_use: list[str] = []  # the native kernels warm-up saw run (none where the library did not load)
        self.cross_names = list(self.manifest.output_names("encoder"))
        self.settings = settings
        self.ready = False
        self.host_check: SelfCheckResult | None = None  # set by self_check

    def encode(self, src_ids: np.ndarray, src_mask: np.ndarray) -> list[np.ndarray]:
        """(N, S) ids and mask -> cross K/V per layer, flat [key_0, value_0, key_1, ...], each (N, H, S, Dh)."""
        return self.encoder.run(self.cross_names, {"src_ids": src_ids, "src_mask": src_mask})

    def new_step_cache(self) -> StepCache:
        """Decoder rows and their caches, bound to this runtime's decoder session (runtime/step_cache.py)."""
        return StepCache(self.decoder, self.config, self.cross_names)

    def warm_up(self) -> float:
        """Run the largest configured shapes once, so the first request does not pay for allocation."""
        started = time.perf_counter()
        rows, src_len = self.settings.warmup_rows, min(self.settings.warmup_src_len, self.config.max_positions)
        src_ids = np.full((rows, src_len), self.config.eos_id, dtype=np.int64)
        src_mask = np.ones((rows, src_len), dtype=bool)
        calls_before = self.native_kernels.calls() if self.native_kernels else {}
        cross = self.encode(src_ids, src_mask)
        index = np.arange(rows, dtype=np.int64)
        tokens = np.full(rows, self.config.bos_id, dtype=np.int64)
        cache = self.new_step_cache()
        for parents in (np.full(rows, -1, dtype=np.int64), index):  # a first step, then one with a past
            cache.arrange(parents, tokens, index, index, cross, src_mask)
            cache.run()
        if self.native_kernels:
            self.kernels_in_use = [name for name, calls in self.native_kernels.calls().items() if calls > calls_before[name]]
            names = [name.replace("_", "-") for name in self.kernels_in_use]
            ran = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else (names[0] if names else "nothing")
            logger.info("native kernels (%s) ran the %s; ONNX Runtime's own kernels the rest", self.native_kernels.path, ran)
        logger.info("the engine's host work: %s", host_work_description())
        self.ready = True
        seconds = time.perf_counter() - started
        logger.info("warm-up on %s: %d rows x %d source tokens in %.2f s", self.provider, rows, src_len, seconds)
        return seconds

    def self_check(self) -> SelfCheckResult | None:
        """The model dir's stored reference through these sessions (runtime/self_check.py); None when the dir
        has none. Raises SelfCheckError, naming the file, when the reference is unusable."""
        self.host_check = check_model_dir(self.model_dir, self.encode, self.new_step_cache(), self.config)
        if self.host_check is None:
            logger.warning("%s has no %s: this host's results are not checked against the exporting host's", self.model_dir, SELF_CHECK_FILE)
        return self.host_check
