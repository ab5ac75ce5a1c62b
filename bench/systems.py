"""The translators nmt-bench compares on the same weights: PyTorch, CTranslate2 (fp32/int8) and our engine (fp32/int8)."""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import EngineLimits, StepProfile
from nmt_serve.server.engine.scheduler import least_loaded
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from nmt_serve.server.models.metrics import Metrics


@dataclass(frozen=True)
class Cell:
    batch: int
    beam: int
    length: int  # forced output length (min = max), so every system produces the same number of tokens


def add_cell_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The timed cells' flags and how often each is timed, shared by every benchmark that times Cells."""
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--beams", default="1,4", help="comma-separated beam sizes (1 = greedy)")
    parser.add_argument("--length", type=int, default=32, help="forced output length")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs of every cell and system, interleaved")


def cells_from(args: argparse.Namespace) -> list[Cell]:
    """Every batch x beam of the parsed flags (add_cell_arguments), at the forced length."""
    return [Cell(int(batch), int(beam), args.length) for batch in args.batches.split(",") for beam in args.beams.split(",")]


class System(Protocol):
    name: str

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        """Translate `sources` under `cell`; returns the number of generated tokens of the best hypotheses."""


def forced_options(cell: Cell) -> SearchOptions:
    return SearchOptions(beam_size=cell.beam, min_output_tokens=cell.length, max_output_tokens=cell.length)


class TorchSystem:
    """Our PyTorch model through model/search.py (eager, KV cache)."""

    def __init__(self, checkpoint_dir: Path, threads: int, device: str = "cpu") -> None:
        torch.set_num_threads(threads)
        self.model = load_checkpoint(checkpoint_dir, device).model
        self.step = TorchStep(self.model)
        self.name = "pytorch fp32" + (f" ({device})" if device != "cpu" else "")

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        config = self.model.config
        results = generate(self.step, sources, forced_options(cell), config.bos_id, config.eos_id, config.max_positions)
        return sum(len(hypotheses[0].token_ids) for hypotheses in results)


class EngineSystem:
    """Our serving engine (continuous batching over ONNX Runtime): all sources submitted at once.

    With several engines (the server's `--engines`), each source goes to the least loaded engine, as
    the server's scheduler sends requests, and each engine steps in its own thread."""

    def __init__(self, model_dir: Path, threads: int, label: str, metrics: bool = False, engines: int = 1, decoder_profile_prefix: str = "",
                 target_prefix: tuple[int, ...] = (), native_kernels: str = "off") -> None:  # fmt: skip
        settings = RuntimeSettings(intra_op_threads=threads, warmup_rows=8, warmup_src_len=16,
                                   decoder_profile_prefix=decoder_profile_prefix, native_kernels=native_kernels)  # fmt: skip
        self.runtime = Runtime(model_dir, settings)
        self.runtime.warm_up()
        # With metrics, every observation the server makes per step and per request is made here too.
        self.metrics = Metrics() if metrics else None
        self.engines = [Engine(self.runtime, EngineLimits(max_rows=1024, max_cache_tokens=1 << 22), self.metrics) for _ in range(engines)]
        self.engine = self.engines[0]
        self.name = f"nmt-serve {label}"
        self.target_prefix = target_prefix  # a multilingual model's target-language token, forced first (counted in the length)
        self.cell_profiles: dict[Cell, StepProfile] = {}  # where step time went, per cell this system ran

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        before = [replace(engine.profile) for engine in self.engines]
        tokens = self._run(sources, cell)
        for engine, earlier in zip(self.engines, before, strict=True):
            self.cell_profiles[cell] = self.cell_profiles.get(cell, StepProfile()) + (engine.profile - earlier)
        return tokens

    def _run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        options = replace(forced_options(cell), target_prefix=self.target_prefix)
        started = time.perf_counter()
        jobs = [self.engines[least_loaded(self.engines)].submit(source, options) for source in sources]
        if len(self.engines) == 1:
            self.engine.run_until_idle()
        else:
            workers = [threading.Thread(target=engine.run_until_idle) for engine in self.engines]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        if self.metrics is not None:
            for job in jobs:
                self.metrics.finished_job(job.joined_at - job.submitted_at, job.first_token_at - job.submitted_at, len(job.src_ids),
                                          len(job.hypotheses[0].token_ids))  # fmt: skip
                self.metrics.answered("Translate", "OK", time.perf_counter() - started)
        return sum(len(job.hypotheses[0].token_ids) for job in jobs)


class CTranslate2System:
    """CTranslate2 on a model converted from our checkpoint (bench/ct2_convert.py). With several workers
    (its `inter_threads`, its documented setting for throughput) a batch is split among them."""

    def __init__(self, model_dir: Path, tokens: list[str], threads: int, label: str, workers: int = 1, target_prefix: Sequence[str] = ()) -> None:
        import ctranslate2

        self.translator = ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=threads, inter_threads=workers)
        self.tokens = tokens
        self.workers = workers
        self.target_prefix = list(target_prefix)  # a multilingual model's target-language token (part of the decoded length)
        self.name = f"ctranslate2 {label}"

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        batch = [[self.tokens[i] for i in source] for source in sources]
        split = 0 if self.workers == 1 else math.ceil(len(batch) / self.workers)  # 0: one batch, unsplit
        # CTranslate2 counts the length without BOS; min = max forces exactly `length` tokens.
        prefixes = [self.target_prefix] * len(batch) if self.target_prefix else None
        results = self.translator.translate_batch(
            batch, target_prefix=prefixes, beam_size=cell.beam, max_decoding_length=cell.length, min_decoding_length=cell.length, max_batch_size=split
        )
        return sum(len(result.hypotheses[0]) for result in results)
