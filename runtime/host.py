"""The facts about this host's CPU that int8 results depend on: vendor, model name and int8 instruction sets."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# /proc/cpuinfo flag names of the instruction sets ONNX Runtime's int8 kernels choose between.
INT8_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")


def cpu_facts(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """{"vendor", "model_name", "features"}: features lists those of INT8_FEATURES this CPU has."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if not line.strip():
            break  # the first processor's block describes them all
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "vendor": fields.get("vendor_id", "") or platform.machine(),
        "model_name": fields.get("model name", "") or platform.processor() or "unknown",
        "features": [feature for feature in INT8_FEATURES if feature in flags],
    }


def describe_cpu(facts: dict[str, Any]) -> str:
    """One line for reports and logs: 'AMD EPYC (AuthenticAMD; avx2)'."""
    features = ", ".join(facts.get("features") or []) or "no AVX2"
    return f"{facts.get('model_name', 'unknown')} ({facts.get('vendor', '')}; {features})"
