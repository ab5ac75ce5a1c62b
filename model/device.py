"""Where training and PyTorch evaluation run: the device to use and whether it computes bfloat16 natively."""

from __future__ import annotations

from pathlib import Path

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# CPU flags of native bfloat16 arithmetic (x86 AVX512-BF16 / AMX, Arm BF16). Without them torch emulates bf16
# and autocast slows training down: measured on a Xeon with AVX-512 but no AVX512-BF16, one small-preset
# step of 8,000 target tokens took 19.8 s with bf16 against 10.7 s in fp32; on a Zen 5 with AVX512-BF16,
# bf16 was 1.36x faster than fp32.
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU. Asking for CUDA without one is an error, not a silent CPU run."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpuinfo_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's `name: value` lines of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block describes them all
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes in bfloat16 natively (the CPU default of nmt-train --bf16)."""
    fields = cpuinfo_fields(cpuinfo)
    return bool(NATIVE_BF16_FLAGS & set((fields.get("flags") or fields.get("Features", "")).split()))


def bf16_is_native(device: torch.device) -> bool:
    """The default of bfloat16 autocast on `device`: on where it is native (Ampere and later GPUs, CPUs with the flags)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return native_bf16()


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what train.json records for each leg)."""
    return cpuinfo_fields(cpuinfo).get("model name") or "unknown"
