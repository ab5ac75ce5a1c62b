"""The CUDA path: the runtime picks CUDA when a GPU is present and decodes exactly what the CPU does (greedy).

Marked gpu; skipped with the reason on machines without an NVIDIA driver (CI never has one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt_serve.model.search import SearchOptions
from nmt_serve.runtime.ort_step import available_providers
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif("CUDAExecutionProvider" not in available_providers(), reason="no NVIDIA driver / CUDA execution provider here"),
]
SOURCES = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def run(runtime: Runtime, options: SearchOptions) -> list[tuple[int, ...]]:
    engine = Engine(runtime)
    jobs = [engine.submit(source, options) for source in SOURCES]
    engine.run_until_idle()
    return [job.hypotheses[0].token_ids for job in jobs]


def test_cuda_runtime_decodes_what_the_cpu_decodes(tiny_model_dir: Path) -> None:
    cuda = Runtime(tiny_model_dir)
    assert cuda.provider == "CUDAExecutionProvider"
    cuda.warm_up()
    cpu = Runtime(tiny_model_dir, RuntimeSettings(providers=("CPUExecutionProvider",)))
    options = SearchOptions(max_output_tokens=12)
    assert run(cuda, options) == run(cpu, options)
