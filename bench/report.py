"""Benchmark results as committed markdown: a title, the exact command that produced them, the date, the sections."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def write_report(title: str, program: str, argv: Sequence[str] | None, sections: Sequence[str], out: Path) -> str:
    """Writes `out` and echoes it to stdout; `argv` None means this process's own arguments."""
    command = program + " " + " ".join(shlex.quote(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    report = f"# {title}\n\nProduced by `{command.strip()}` on {time.strftime('%Y-%m-%d')}.\n\n" + "\n\n".join(sections) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    sys.stdout.write(report)
    return report
