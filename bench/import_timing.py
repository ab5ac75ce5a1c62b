"""An imported model's way in, timed: `nmt-import FAMILY` (with its parity against transformers) and `nmt-export` per precision.

The benchmarks of imported shapes (nmt-marian-bench, nmt-nllb-bench) run both as subprocesses, as a
user would, so the import's peak RSS is that of its own process.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nmt_serve.model.corpus import write_tsv

PRECISIONS = ("fp32", "int8")


@dataclass
class ImportTimings:
    family: str
    parity_limit: int  # sentences the import compares with transformers
    export_parity: int  # sentences each export compares with PyTorch (greedy and beam 4)
    import_seconds: float = 0.0
    import_peak_rss_gb: float = 0.0
    export_seconds: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        lines = ["| step | wall seconds | peak RSS |", "|---|---|---|",
                 f"| nmt-import {self.family} (checkpoint, tokenizer files, parity with transformers on {self.parity_limit} sentences) | "
                 f"{self.import_seconds:.1f} | {self.import_peak_rss_gb:.2f} GB |"]  # fmt: skip
        lines += [f"| nmt-export --precision {precision} (with parity on {self.export_parity} sentences) | {seconds:.1f} | |"
                  for precision, seconds in self.export_seconds.items()]  # fmt: skip
        return "\n".join(lines)


def add_import_arguments(parser: argparse.ArgumentParser, parity_limit: int) -> None:
    """The flags every benchmark of an imported shape shares: threads per system and the import's parity sentences."""
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every system")
    parser.add_argument("--parity-limit", type=int, default=parity_limit, help="sentences the import compares with transformers")


def import_and_export(source_dir: Path, family: str, work: Path, parity_texts: Sequence[str], timings: ImportTimings,
                      calibration_texts: Sequence[str] = ()) -> Path:  # fmt: skip
    """Imports `source_dir` into work/imported and exports each precision into it; fills `timings`; returns the checkpoint dir.
    calibration_texts: the int8 dir keeps its self-attention cache in int8, scaled on them (nmt-export --cache-calibration)."""
    test = work / "parity-sentences.tsv"
    # One line per sentence: tabs and line breaks inside a text (the multilingual table has them) become spaces.
    write_tsv(str(test), [(" ".join(text.split()), "") for text in parity_texts])
    cache: list[str] = []  # the int8 export's arguments
    if calibration_texts:
        calibration = work / "calibration-sentences.tsv"
        write_tsv(str(calibration), [(" ".join(text.split()), "") for text in calibration_texts])
        cache = ["--cache-calibration", str(calibration)]
    checkpoint = work / "imported"
    started = time.perf_counter()
    run_quietly(["nmt_serve.importers.import_command", family, str(source_dir), "--out", str(checkpoint),
                 "--parity-limit", str(timings.parity_limit), "--parity-test", str(test)])  # fmt: skip
    timings.import_seconds = time.perf_counter() - started
    timings.import_peak_rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # ru_maxrss is in kB on Linux
    for precision in PRECISIONS:
        started = time.perf_counter()
        run_quietly(["nmt_serve.export.onnx_export", str(checkpoint), "--out", str(checkpoint / f"onnx-{precision}"), "--precision", precision,
                     "--parity-test", str(test), "--parity-limit", str(timings.export_parity),
                     *(cache if precision == "int8" else [])])  # fmt: skip
        timings.export_seconds[precision] = time.perf_counter() - started
    return checkpoint


def run_quietly(module_and_arguments: list[str]) -> None:
    subprocess.run([sys.executable, "-m", *module_and_arguments], check=True, stdout=subprocess.DEVNULL)
