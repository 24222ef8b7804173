"""Batching as requested (SchedulerConfig): what one step may hold, how prompts are split and
weighed, the policies, and the queue's limit."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import check_choices, option

SCHEDULING_POLICIES = ("iteration", "static")
PRIORITY_POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int | None = option(
        None, "Longest prompt + output; default: the model's context.")
    max_num_seqs: int = option(64, "Most sequences per step.")
    max_num_batched_tokens: int = option(512, "Most tokens per step.")
    enable_chunked_prefill: bool = option(True, "Split long prompts.")
    # Each token of a prefill chunk at context c (every one of its tokens attends the c before
    # it) counts 1 + c / prefill_keys_per_token, so a step costs about what a
    # max_num_batched_tokens chunk at a prompt's start does. The value is the keys whose
    # attention costs as much as one token's weight matmuls; None is resolved by the engine
    # (config/resolved.py). Decode rows count one each.
    prefill_keys_per_token: int | None = option(
        None, "A prefill chunk's token at context c counts 1 + c / this against "
        "--max_num_batched_tokens (deep chunks are shorter); default: from the model and "
        "attention backend; 0: tokens alone count.")
    scheduling: str = option("iteration", "iteration: continuous batching; static: "
                             "request-level batching (ablation).", choices=SCHEDULING_POLICIES)
    scheduling_policy: str = option("fcfs", "Queue order.", choices=PRIORITY_POLICIES)
    async_scheduling: bool = option(
        True, "Launch the next decode step before reading back this one's tokens.")

    def __post_init__(self):
        check_choices(self)
        checks = (
            (self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= self.max_num_seqs,
             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
             f"({self.max_num_seqs}) so every running sequence can decode each step"),
            (self.prefill_keys_per_token is None or self.prefill_keys_per_token >= 0,
             f"prefill_keys_per_token must be >= 0 or None, got {self.prefill_keys_per_token}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
