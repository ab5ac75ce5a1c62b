"""The native kernels (runtime/kernels/): where the built library is, whether a setting asks for it, and how many
times its kernels ran, so the runtime can tell that ONNX Runtime really uses them.

The library registers CPU kernels for com.microsoft MultiHeadAttention (the decoder's cross-attention) and
GroupQueryAttention over an int8 cache (its self-attention); ONNX Runtime searches a session's custom kernels before
its own, so the graphs on disk keep stock operators and run unchanged wherever the library is absent. It also runs
the nodes of its own domain the runtime fuses blocks of stock nodes into, in memory, when it loads the library
(runtime/native_fusions.py). `nmt-build-kernels` builds it
(runtime/build_kernels.py).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
LIBRARY_NAME = "libnmt_kernels.so"
DEFAULT_LIBRARY = KERNELS_DIR / LIBRARY_NAME
SETTINGS = ("auto", "off")  # or a path to a built library
COUNTERS = {"cross_attention": "nmt_cross_attention_calls", "self_attention": "nmt_self_attention_calls",
            "grouped_cross_attention": "nmt_grouped_cross_attention_calls", "row_quantization": "nmt_row_quantize_calls",
            "quantized_matmul": "nmt_quantized_matmul_calls", "float_matmul": "nmt_float_matmul_calls",
            "candidate_top_k": "nmt_candidate_top_k_calls",
            "packed_self_attention": "nmt_packed_self_attention_calls", "head_layout": "nmt_head_layout_calls",
            "decoder_embedding": "nmt_decoder_embedding_calls", "decoder_lengths": "nmt_decoder_lengths_calls"}


class NativeKernelsError(ValueError):
    """A setting that names a library which is not there or cannot be loaded."""


@dataclass(frozen=True)
class NativeKernels:
    """A loaded library: its path, and its kernels' run counters (all sessions of this process)."""

    path: Path

    def calls(self) -> dict[str, int]:
        library = ctypes.CDLL(str(self.path))
        counts = {}
        for kernel, symbol in COUNTERS.items():
            counter = getattr(library, symbol)
            counter.restype = ctypes.c_uint64
            counts[kernel] = int(counter())
        return counts


def resolve_native_kernels(setting: str) -> NativeKernels | None:
    """'off' -> None; 'auto' -> the built library when there is one (else None, logged); a path -> that library, or
    NativeKernelsError when it is not a loadable file."""
    if setting == "off":
        return None
    path = DEFAULT_LIBRARY if setting == "auto" else Path(setting).expanduser()
    if not path.is_file():
        if setting == "auto":
            logger.info("native attention kernels not built (%s absent; `nmt-build-kernels` builds them): ONNX Runtime's own run", path)
            return None
        raise NativeKernelsError(
            f"native_kernels: {path} is not a file; build it with `nmt-build-kernels --out {path}`, or pass 'auto' or 'off'"
        )
    try:
        kernels = NativeKernels(path.resolve())
        kernels.calls()
    except (OSError, AttributeError) as error:
        message = f"native_kernels: {path} is not an nmt-serve kernels library ({error}); rebuild it with `nmt-build-kernels`"
        if setting == "auto":
            logger.warning("%s; ONNX Runtime's own kernels run", message)
            return None
        raise NativeKernelsError(message) from error
    return kernels
