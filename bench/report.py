"""Benchmark results as committed markdown: a title, the exact command that produced them, the date, the sections."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from nmt_serve.runtime.host import cpu_facts, describe_cpu

T = TypeVar("T")


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """`items` starting at index shift (modulo their count): interleaved runs take their contenders in a rotated order
    each round, so that a drift of the machine hits all of them alike."""
    start = shift % len(items)
    return [*items[start:], *items[:start]]


def write_report(title: str, program: str, argv: Sequence[str] | None, sections: Sequence[str], out: Path) -> str:
    """Writes `out` and echoes it to stdout; `argv` None means this process's own arguments."""
    command = program + " " + " ".join(shlex.quote(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    report = (f"# {title}\n\nProduced by `{command.strip()}` on {time.strftime('%Y-%m-%d')} at commit {commit()}, "
              f"on {describe_cpu(cpu_facts())}{describe_gpu()}.\n\n" + "\n\n".join(sections) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    sys.stdout.write(report)
    return report


def describe_gpu() -> str:
    """', GPU NVIDIA H100 80GB HBM3 (driver 580.159.04)' where nvidia-smi answers, else '': a result measured on
    CUDA names the card, one measured on the CPU names nothing more."""
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True,
                                check=True, timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    cards = [line.split(", ") for line in answer.splitlines() if line.strip()]
    return "".join(f", GPU {name} (driver {driver})" for name, driver in (card for card in cards if len(card) == 2))


def commit() -> str:
    """The checkout's commit (short hash, "+changes" when the tree differs from it), or "unknown" outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")
