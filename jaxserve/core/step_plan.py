"""StepPlan: what the scheduler decided for one step. A plain dataclass, the only thing that crosses
from the scheduler to the batch builder."""

from __future__ import annotations

import dataclasses

from jaxserve.core.sequence import Sequence


@dataclasses.dataclass
class ScheduledChunk:
    """Compute tokens seq.token_ids[start : start + num_tokens] this step (their KV is written to
    the sequence's pages). When the chunk reaches the end of the sequence (start + num_tokens ==
    seq.num_tokens) the logits of its last token are sampled once per entry of `sample_seqs`:
    normally just [seq]; at the end of the prompt of a request with n > 1 it is [seq] plus the
    n - 1 forks that share its pages."""

    seq: Sequence
    start: int
    num_tokens: int
    sample_seqs: list[Sequence] = dataclasses.field(default_factory=list)
    # >= 0: a decode scheduled while the previous step is still running: its input token is not
    # on the host yet but is the token that step samples at this row (the device feeds it in).
    feed_row: int = -1
    # Speculative decoding: a decode that also computes num_drafts proposed next tokens
    # (positions start + 1 ...; num_tokens = 1 + num_drafts) and samples at every token, to
    # verify them. draft_token_ids: those tokens, the proposer's; empty while the draft model's
    # are still to be proposed (StepPlan.with_drafts gives the plan with them).
    num_drafts: int = 0
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    lora_slot: int = 0  # the device slot of the sequence's LoRA adapter (0: the base model)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start >= self.seq.num_prompt_tokens

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this chunk computes (a verification chunk's drafts are not in seq yet)."""
        if self.num_drafts:
            if len(self.draft_token_ids) != self.num_drafts:
                raise ValueError("a verification chunk's drafts are not proposed yet")
            return [self.seq.token_ids[self.start]] + self.draft_token_ids
        return self.seq.token_ids[self.start:self.start + self.num_tokens]

    @property
    def sample_rows(self) -> list[tuple[int, Sequence]]:
        """(token offset in the chunk, sequence) per sampled token: the last token once per entry
        of sample_seqs, or every token of a verification chunk."""
        if self.num_drafts:
            return [(i, self.seq) for i in range(self.num_tokens)]
        return [(self.num_tokens - 1, s) for s in self.sample_seqs]


@dataclasses.dataclass
class StepPlan:
    """One iteration. Decode chunks (one token each) come first, then prefill chunks. `copies` are
    copy-on-write page copies (src, dst) applied on device before the step writes any KV."""

    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    step: int = 0  # the scheduler's number for a plan that went out (0: empty, not tracked)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sample_rows(self) -> list[tuple[ScheduledChunk, Sequence]]:
        """(chunk, sequence) per sampled token, in the order the runner returns them."""
        return [(c, s) for c in self.chunks for _, s in c.sample_rows]

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def with_drafts(self, proposed: list[tuple[ScheduledChunk, list[int]]]) -> StepPlan:
        """This plan with the draft model's tokens in the verification chunks given (each as
        many as it counts), a new value: the same step to the scheduler."""
        tokens = {id(chunk): drafts for chunk, drafts in proposed}
        for chunk, drafts in proposed:
            if len(drafts) != chunk.num_drafts:
                raise ValueError(f"{chunk.num_drafts} drafts planned, {len(drafts)} proposed")
        chunks = [dataclasses.replace(c, draft_token_ids=list(tokens[id(c)]))
                  if id(c) in tokens else c for c in self.chunks]
        return dataclasses.replace(self, chunks=chunks)
