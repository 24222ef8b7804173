"""What a front end may know of an engine: `ServedModel` (the model it reads requests for) and
`EngineClient`, the calls the server makes. `AsyncEngine` implements it over an `LLMEngine` or a
`DataParallelEngine` (both give `served_model` and `compile_grammar`), so the server reads
nothing else of the engine (vLLM's engine-core client plays this part). `RolloutControl` is
what a reinforcement-learning loop calls on either engine (docs/rl.md). The loop's refusals
(EngineOverloaded, EngineDead, EngineStalled) are the errors a front end maps to answers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Protocol

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer
from jaxserve.weights.pooling import PoolingSpec


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The model requests are read for: its name as loaded, tokenizer and limits."""
    name: str  # LoadConfig.model, as given
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    cache_salt: str | None  # the engine's prefix-cache salt (CacheConfig.cache_salt)
    lora_modules: tuple = ()  # LoRARequests served by name (LoRAConfig.lora_modules)
    pooling: PoolingSpec | None = None  # a pooling engine's (runner "pooling"); None: generates
    hidden_size: int = 0


class EngineOverloaded(Exception):
    """The waiting queue is at its configured limit (ServingConfig.max_waiting)."""


class EngineDead(Exception):
    """The engine loop has stopped."""


class EngineStalled(EngineDead):
    """The engine loop has not come round for stall_timeout seconds: a call on it would not
    answer now."""


class Observer(Protocol):
    def on_finished(self, output: RequestOutput) -> None: ...

    def on_aborted(self, prompt_tokens: int, generation_tokens: int) -> None: ...


class EngineClient(Protocol):
    """The server's view of the engine loop (engine/async_engine.py)."""
    served_model: ServedModel
    observers: list
    alive: bool
    last_error: BaseException | None
    compilations_pending: int

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def warm_up(self, full: bool = False, background: bool = True,
                **options) -> concurrent.futures.Future: ...

    def readiness(self) -> str | None: ...

    def drain(self, timeout: float) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def compile_grammar(self, spec: StructuredOutputsParams) -> Any: ...

    async def add(self, prompts: list[dict], params: SamplingParams,
                  cache_salt: str | None = None) -> Any: ...

    async def stats(self, kv_usage: bool = False) -> dict: ...


class RolloutControl(Protocol):
    """Weights replaced in place, steps held, memory given back (docs/rl.md): LLMEngine's, and
    DataParallelEngine's over every replica. Not thread-safe: AsyncEngine runs them on its loop
    thread."""

    @property
    def weights_version(self) -> int: ...

    @property
    def is_paused(self) -> bool: ...

    @property
    def is_sleeping(self) -> bool: ...

    def update_weights(self, weights, in_flight: str = "finish") -> list[RequestOutput]: ...

    def params_like(self) -> dict: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...
