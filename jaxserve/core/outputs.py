"""What the engine returns to users (vLLM's shape): RequestOutput holding CompletionOutputs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Per generated token: {token_id: logprob} holding the chosen token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """time.monotonic() timestamps; derived latencies in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # per output token, seq 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Prompt logprobs (echo scoring): None for the first token, then {token_id: logprob} per token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # set when this request failed on its own (finish_reason "error")
    # The engine's weights when its tokens were sampled: 0 as loaded, +1 per update_weights.
    weights_version: int = 0
    # A pooling engine's result once finished (engine/pooling.py): the embedding, or the class
    # logits of a classifier, float32 numpy.
    pooled: object = None
