"""What a front end may know of an engine: `ServedModel` (the model it reads requests for) and
`EngineClient`, the calls the server makes. `AsyncEngine` implements it over an `LLMEngine` or a
`DataParallelEngine` (both give `served_model` and `compile_grammar`), so the server reads
nothing else of the engine (vLLM's engine-core client plays this part)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Protocol

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
    pooling: PoolingSpec | None = None  # a pooling engine's (runner "pooling"); None: generates
    hidden_size: int = 0


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
