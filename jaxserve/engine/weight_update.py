"""WeightUpdates: the engine's weights replaced in place and its memory given back, for
reinforcement-learning loops (docs/rl.md). It owns the order of things around the runner's
update_params / release / reset_pool: the requests in flight finished or failed first, no
step on the device, the prefix cache forgotten (its pages hold KV of the old weights), and
whether the engine is paused or asleep. Outputs carry the runner's weights_version."""

from __future__ import annotations

from typing import Mapping

from jaxserve.config import ModelConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.requests import RequestTable
from jaxserve.engine.step_pipeline import StepPipeline
from jaxserve.runtime.param_update import check_tree
from jaxserve.runtime.runner import ModelRunner
from jaxserve.weights import numpy_dtype
from jaxserve.weights.named_update import NamedUpdate, convert_named

IN_FLIGHT = ("finish", "abort")
ABORTED = "aborted by update_weights(in_flight='abort'): the weights changed"


def as_update(weights, like: dict, model: ModelConfig, dtype):
    """What the runner's update_params takes: a tree like `like` (params_like(); checked), a
    NamedUpdate as it is, or (name, array) pairs in the checkpoint's names converted as the
    loaders convert (dtype: the loaders' numpy dtype). Raises before anything changes."""
    if isinstance(weights, Mapping) and set(weights) == set(like):
        check_tree(weights, like)
        return weights
    if isinstance(weights, NamedUpdate):
        return weights
    return convert_named(model, weights, dtype)


class EngineAsleep(RuntimeError):
    """A request reached an engine whose pool or weights sleep() released."""


class WeightUpdates:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, requests: RequestTable,
                 pipeline: StepPipeline, model: ModelConfig, dtype: str):
        self.runner, self.scheduler, self.requests, self.pipeline = (runner, scheduler,
                                                                     requests, pipeline)
        self.model, self.dtype = model, numpy_dtype(dtype)  # the loaders' dtype
        self.paused = False  # pause(): no new step starts
        self.pool_released = self.weights_released = False
        cache = scheduler.cache
        self._fingerprint = cache.model_fingerprint if cache is not None else None

    def pause(self, paused: bool) -> None:
        self.paused = paused

    @property
    def asleep(self) -> bool:
        """Whether sleep() released the pool or the weights, and they are not back yet."""
        return self.pool_released or self.weights_released

    def check_awake(self) -> None:
        """EngineAsleep, naming what to call, when the pool or the weights are released."""
        if self.weights_released:
            raise EngineAsleep("the weights were released by sleep(level=2): call "
                               "update_weights(...) and wake_up() before generating")
        if self.pool_released:
            raise EngineAsleep("the engine is asleep (sleep()): call wake_up() before generating")

    def update(self, weights, in_flight: str = "finish") -> list[RequestOutput]:
        """Replace the weights: (name, array) pairs (or a mapping) in the checkpoint's Hugging
        Face names and layout, a NamedUpdate already converted (a data-parallel front converts
        once for its replicas), or a tree like the runner's params_like(). The requests in the
        engine first finish under the old weights (in_flight="finish") or fail
        ("abort"); returns the outputs that produced, under the old version."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
        # checked and converted before the requests in flight are settled
        update = as_update(weights, self.runner.params_like(), self.model, self.dtype)
        outputs = self._settle(in_flight)
        self.runner.update_params(update)
        self.weights_released = False
        self.forget_prefixes()
        return outputs

    def _settle(self, in_flight: str) -> list[RequestOutput]:
        """No request left in the engine and no step on the device."""
        outputs = []
        if self.scheduler.has_unfinished() and in_flight == "finish":
            if self.paused:
                raise ValueError(f"paused with {self._num_unfinished()} requests unfinished: "
                                 "resume() first, or update with in_flight='abort'")
            while self.scheduler.has_unfinished():
                outputs += self.pipeline.step()
        elif self.scheduler.has_unfinished():
            for seq in list(self.scheduler.live.sequences()):
                self.requests.fail(seq.request.request_id, ABORTED)
        self.pipeline.drain()
        return outputs + self.pipeline.take_failed()

    def _num_unfinished(self) -> int:
        return len({s.request.request_id for s in self.scheduler.live.sequences()})

    def forget_prefixes(self) -> None:
        """No page cached before is found again: the keys chain from a fingerprint of this
        version, and every unreferenced cached page is evicted."""
        if self._fingerprint is not None:
            self.scheduler.cache.reset(f"{self._fingerprint}:v{self.runner.weights_version}")

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2), with nothing in flight."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV pool) or 2 (and weights), got {level}")
        if self.scheduler.has_unfinished():
            raise ValueError(f"sleep with {self._num_unfinished()} requests unfinished: let "
                             "them finish or abort them first")
        self.pipeline.drain()
        self.runner.release(weights=level == 2)
        self.pool_released = True
        self.weights_released |= level == 2
        self.forget_prefixes()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate what sleep freed: tags "kv_cache" (a zeroed pool of the same shape, so
        nothing compiles) and "weights" (released weights come back by update_weights only)."""
        unknown = set(tags or ()) - {"kv_cache", "weights"}
        if unknown:
            raise ValueError(f"wake_up tags are 'kv_cache' and 'weights', got {sorted(unknown)}")
        if (tags is None or "kv_cache" in tags) and self.pool_released:
            self.runner.reset_pool()
            self.pool_released = False
