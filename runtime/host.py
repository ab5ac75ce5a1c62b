"""The facts about this host's CPU that int8 results depend on: vendor, model name, family and model numbers and int8
instruction sets."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# /proc/cpuinfo flag names of the instruction sets ONNX Runtime's int8 kernels choose between.
INT8_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")


def cpu_facts(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """{"vendor", "model_name", "features"}, and "family" and "model" where /proc/cpuinfo gives them: features lists
    those of INT8_FEATURES this CPU has. Virtual machines often name only the brand ("AMD EPYC"); the family and model
    numbers tell its generations apart (AMD family 25 is Zen 3 and Zen 4, model 17 a Zen 4)."""
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
    facts: dict[str, Any] = {
        "vendor": fields.get("vendor_id", "") or platform.machine(),
        "model_name": fields.get("model name", "") or platform.processor() or "unknown",
        "features": [feature for feature in INT8_FEATURES if feature in flags],
    }
    for key, field in (("family", "cpu family"), ("model", "model")):
        if fields.get(field, "").isdigit():
            facts[key] = int(fields[field])
    return facts


def describe_cpu(facts: dict[str, Any]) -> str:
    """One line for reports and logs: 'AMD EPYC (AuthenticAMD family 25 model 17; avx2)' (facts recorded before the
    family and model were: 'AMD EPYC (AuthenticAMD; avx2)')."""
    features = ", ".join(facts.get("features") or []) or "no AVX2"
    numbers = f" family {facts['family']} model {facts['model']}" if "family" in facts and "model" in facts else ""
    return f"{facts.get('model_name', 'unknown')} ({facts.get('vendor', '')}{numbers}; {features})"
