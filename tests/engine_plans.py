"""Requests arriving at planned steps of one engine, one cancelled: the tests of the compiled steady steps run the same
plan with the compiled step and with the Python path and compare the jobs."""

from __future__ import annotations

from nmt_serve.model.search import SearchOptions
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import Job
from nmt_serve.server.engine.sessions import Runtime

# (arrival step, source, options) per request
Plan = list[tuple[int, list[int], SearchOptions]]


def run_plan(runtime: Runtime, plan: Plan, cancel_at: int, steps: int = 80) -> list[Job]:
    """Step a new engine `steps` times, submitting each request at its arrival step and cancelling the second at
    `cancel_at`; every request must be done by then."""
    engine = Engine(runtime)
    jobs: list[Job] = []
    for step in range(steps):
        jobs += [engine.submit(source, options) for arrival, source, options in plan if arrival == step]
        if step == cancel_at:
            engine.cancel(jobs[1])
        engine.step()
    assert not engine.has_work
    return jobs
