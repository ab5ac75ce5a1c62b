"""server/engine/workers.py: how many engines and ONNX Runtime threads the server runs."""

from __future__ import annotations

import pytest

from nmt_serve.server.engine.workers import CPU_AUTO_ROWS, GPU_AUTO_ROWS, MAX_AUTO_ENGINES, WorkerPlan, plan_workers


@pytest.mark.parametrize(("engines", "threads", "on_gpu", "cores", "plan"), [
    (0, 0, False, 2, WorkerPlan(2, 1, CPU_AUTO_ROWS)),  # a CPU: one single-threaded engine per core
    (0, 0, False, 1, WorkerPlan(1, 1, CPU_AUTO_ROWS)),
    (0, 0, False, 16, WorkerPlan(MAX_AUTO_ENGINES, 16 // MAX_AUTO_ENGINES, CPU_AUTO_ROWS)),  # more cores go to threads
    (1, 0, False, 8, WorkerPlan(1, 8, CPU_AUTO_ROWS)),  # one engine given: it gets every core
    (3, 0, False, 2, WorkerPlan(3, 1, CPU_AUTO_ROWS)),  # more engines than cores: at least one thread each
    (0, 2, False, 8, WorkerPlan(4, 2, CPU_AUTO_ROWS)),  # threads given: the cores shared out as engines
    (0, 8, False, 4, WorkerPlan(1, 8, CPU_AUTO_ROWS)),
    (2, 3, False, 4, WorkerPlan(2, 3, CPU_AUTO_ROWS)),  # both given: as given (a warning says they time-share)
    (0, 0, True, 16, WorkerPlan(1, 0, GPU_AUTO_ROWS)),  # a GPU: one engine, ONNX Runtime's default threads, a larger batch
    (2, 0, True, 16, WorkerPlan(2, 0, GPU_AUTO_ROWS)),
])  # fmt: skip
def test_plan_workers(engines: int, threads: int, on_gpu: bool, cores: int, plan: WorkerPlan) -> None:
    assert plan_workers(engines, threads, on_gpu, cores) == plan


@pytest.mark.parametrize("on_gpu", [False, True])
def test_plan_workers_keeps_the_rows_given(on_gpu: bool) -> None:
    assert plan_workers(0, 0, on_gpu, cores=2, max_rows=7).max_rows == 7
