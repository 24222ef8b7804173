"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's shape)."""

from __future__ import annotations

import dataclasses


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
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n}")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        check(self.logprobs is None or 0 <= self.logprobs <= 20,
              f"logprobs must be in [0, 20], got {self.logprobs}")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
              f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be non-negative integers")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
