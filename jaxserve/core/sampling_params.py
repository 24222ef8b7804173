"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's shape)."""

from __future__ import annotations

import dataclasses
import math
import numbers

from jaxserve.tokenizer import check_unicode

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 1e4  # beyond it every distribution is uniform to float32



@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (echo scoring)
    priority: int = 0  # lower runs first under scheduling_policy="priority"

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """ValueError unless every field is of its type and in range: integers that reach int32
        arrays fit them, floats are finite (NaN and infinities are refused)."""
        def integer(name, lo, hi=INT32_MAX, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")

        def real(name, lo, hi, lo_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or not (lo < value if lo_open else lo <= value) \
                    or value > hi:
                interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")

        integer("n", 1)
        real("temperature", 0.0, MAX_TEMPERATURE)
        real("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", 0)
        real("min_p", 0.0, 1.0)
        integer("max_tokens", 1, optional=True)
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("seed", -2**63, 2**64 - 1, optional=True)  # any 64-bit seed; hashed to 32 bits
        integer("priority", -INT32_MAX, INT32_MAX)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for s in self.stop:
            check_unicode(s, "a stop string")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                   and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
