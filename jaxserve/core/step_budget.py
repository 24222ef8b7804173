"""One step's token budget (max_num_batched_tokens) as its chunks spend it. A decode or
verification token counts one. With chunked prefill, every token of a prefill chunk attends the c
tokens before the chunk, so it counts 1 + c / keys_per_token (c within the window when every
layer is windowed): a chunk deep into a long prompt is shorter, and a step costs about what a
max_num_batched_tokens chunk at a prompt's start does, so the streams decoding beside a long
prompt keep their pace (SchedulerConfig.prefill_keys_per_token). Host-only."""

from __future__ import annotations


class StepBudget:
    def __init__(self, total: int, keys_per_token: int, window: int | None = None):
        """keys_per_token: 0 counts tokens alone."""
        self.total, self.keys_per_token, self.window = total, keys_per_token, window
        self.spent = 0.0

    def reset(self) -> None:
        """A new step: nothing spent."""
        self.spent = 0.0

    @property
    def left(self) -> float:
        return self.total - self.spent

    def token_cost(self, start: int) -> float:
        """What one token of a prefill chunk from `start` counts."""
        if not self.keys_per_token:
            return 1.0
        context = start if self.window is None else min(start, self.window)
        return 1.0 + context / self.keys_per_token

    def tokens_within(self, start: int, budget: float) -> int:
        """Tokens of a prefill chunk from `start` that `budget` pays for."""
        return int(budget / self.token_cost(start))

    def spend(self, start: int, num_tokens: int, prefill: bool) -> None:
        self.spent += num_tokens * self.token_cost(start) if prefill else num_tokens
