"""The models one server serves: their names checked, each loaded with its engines on one shared pool, found by name."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.server.engine.all_schedulers import Schedulers
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.engine_pool import EnginePool
from nmt_serve.server.engine.jobs import EngineLimits
from nmt_serve.server.engine.scheduler import QueueLimits, Scheduler
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from nmt_serve.server.engine.workers import WorkerPlan
from nmt_serve.server.models.metrics import Metrics
from nmt_serve.server.models.model_metrics import ModelMetrics
from nmt_serve.server.models.requests import ECHO_CHARS, UnknownModel, clipped
from nmt_serve.server.models.served_model import ServedModel
from nmt_serve.server.models.translation_cache import TranslationCache, model_cache
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger("nmt-serve")

# The known names a NOT_FOUND message lists: its whole message must stay short whatever the names are.
MAX_LISTED_CHARS = 4 * ECHO_CHARS


class ModelSetError(ValueError):
    """The model dirs cannot be served together: two share a name, or the default model is none of them."""


class HostCheckRefused(RuntimeError):
    """This host's results differ from the exporting host's beyond the model dir's bound."""


def check_this_host(runtime: Runtime, mode: str, metrics: ModelMetrics) -> None:
    """The start-up self-check (runtime/self_check.py) in `mode` (ServerSettings.self_check); raises
    HostCheckRefused, naming the file and the figures, when it fails under `refuse`."""
    if mode == "off":
        logger.warning("self-check off: this host's results are not compared with the exporting host's")
        return
    result = runtime.self_check()
    if result is None:
        return
    metrics.checked_host(result.max_log_prob_diff, result.bound)
    if not result.passed and mode == "refuse":
        raise HostCheckRefused(f"{result.describe()} (--self-check warn serves anyway)")
    if not result.passed:
        logger.warning("serving although the self-check failed (--self-check warn)")


def read_names(model_dirs: Sequence[Path]) -> dict[str, Path]:
    """Each dir's model name (its manifest's model_name), before any graph is loaded; two dirs of one name are an error."""
    names: dict[str, Path] = {}
    for model_dir in model_dirs:
        name = load_model_dir(model_dir, verify_hashes=False).model_name
        if name in names:
            raise ModelSetError(f"model dirs {names[name]} and {model_dir} both hold the model {clipped(name)!r}: requests choose "
                                f"a model by its manifest's model_name, so serve one of them or export the other under another name")
        names[name] = Path(model_dir)
    return names


class ModelRegistry:
    """The served models, the default first; `resolve` turns a request's model field into one."""

    def __init__(self, models: Sequence[ServedModel], default_name: str, schedulers: Schedulers) -> None:
        by_name = {model.name: model for model in models}
        self.default = by_name[default_name]
        self.models = [self.default, *(model for model in models if model is not self.default)]
        self._by_name = by_name
        self.schedulers = schedulers

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def names(self) -> list[str]:
        return [model.name for model in self.models]

    def resolve(self, name: str) -> ServedModel:
        """Empty: the default model. A name not served raises UnknownModel, quoting the name and the served ones, both capped."""
        if not name:
            return self.default
        if name not in self._by_name:
            raise UnknownModel(f"model {clipped(name)!r} is not served here; served models: {self.listing(self._by_name)}")
        return self._by_name[name]

    @staticmethod
    def listing(names: Iterable[str]) -> str:
        return clipped(", ".join(repr(clipped(name)) for name in names), MAX_LISTED_CHARS)


def load_models(settings: ServerSettings, plan: WorkerPlan, providers: tuple[str, ...], metrics: Metrics) -> ModelRegistry:
    """Every model dir of `settings`, each with `plan.engines` engines; one pool of `plan.engines` workers steps them all
    (server/engine/engine_pool.py), so the cores are shared the same way however many models there are."""
    names = read_names(settings.model_dirs)
    default_name = settings.default_model or next(iter(names))
    if default_name not in names:  # checked before any graph is loaded
        raise ModelSetError(f"default_model {clipped(default_name)!r} is not a served model; served: {ModelRegistry.listing(names)}")
    pool = EnginePool(plan.engines, settings.worker_niceness)
    limits = EngineLimits(max_rows=plan.max_rows, max_cache_tokens=settings.max_cache_tokens, join_wait_steps=settings.join_wait_steps,
                          join_group=settings.join_group)  # fmt: skip
    queue_limits = QueueLimits(max_requests=settings.max_queued_requests, max_tokens=settings.max_queued_tokens)
    runtime_settings = RuntimeSettings(providers=providers, intra_op_threads=plan.threads, warmup_rows=min(plan.max_rows, 64),
                                       native_kernels=settings.native_kernels)
    cache = TranslationCache(settings.cache_mb << 20) if settings.cache_mb else None
    models = []
    for name, model_dir in names.items():
        runtime = Runtime(model_dir, runtime_settings)
        view = metrics.for_model(name)
        check_this_host(runtime, settings.self_check, view)
        # A model's engines share its sessions (ONNX Runtime runs calls from several threads); each has its own caches.
        scheduler = Scheduler([Engine(runtime, limits, view) for _ in range(plan.engines)], queue_limits, view, pool)
        view.describe(runtime.manifest.model_version, runtime.manifest.precision, runtime.provider)
        view.watch_queue(lambda scheduler=scheduler: scheduler.queue_depth, lambda scheduler=scheduler: scheduler.running)
        models.append(ServedModel(runtime, scheduler, settings, model_cache(cache, name, model_dir, runtime.host_check, view)))
    schedulers = Schedulers([model.scheduler for model in models], pool)
    return ModelRegistry(models, default_name, schedulers)
