"""Host-side request state: a Sequence is one token stream with its own page table; a Request groups
the n sequences sampled from one prompt. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed (Request.error says why)

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclasses.dataclass(eq=False)
class Sequence:
    """One token stream. `page_ids` is its page table on the host; the KV of token i lives in page
    page_ids[i // page_size] at offset i % page_size. Tokens [0, num_computed_tokens) have KV in the
    pool. A model of several layer groups (core/kv_groups.py) gives it one page table per
    group: page_ids is group 0's, group_page_ids the others' (empty for a model of one group)."""

    seq_id: int
    request: "Request"
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    fork_index: int = 0  # which of the request's n samples this is
    status: SequenceStatus = SequenceStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)
    group_page_ids: list[list[int]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    stop_reason: int | str | None = None
    output_logprobs: list = dataclasses.field(default_factory=list)
    # Structured output: the grammar's state after the output tokens (structured_output.matcher_of)
    matcher: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and its n sampled sequences. Sequence 0 prefills the prompt; the other n-1 are
    forked from it when the prompt's last token is computed (they share its pages)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    # (salt, LoRA adapter's fingerprint) under an adapter: its pages are its own (PrefixCache)
    cache_salt: str | tuple[str | None, str] | None = None
    lora_int_id: int = 0  # the LoRA adapter it runs under (core/lora.py); 0: the base model
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    error: str | None = None  # why the request failed (its sequences are FINISHED_ERROR)
    grammar: Any = None  # structured output: the compiled grammar (GrammarCompiler.compile)
    # Timestamps (time.monotonic) for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return bool(self.sequences) and all(s.is_finished for s in self.sequences)
