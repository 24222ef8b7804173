"""DraftKV: which positions of each sequence the draft model's KV pool holds (speculative method
"draft"), on the host: Speculation's record (core/speculation.py, its owner), which the draft
model's runner updates as it proposes. The pool itself is the runtime's (runtime/draft.py):
indexed by the target's page ids, so a sequence's draft KV sits in its own pages beside its
target KV.

A proposal computes the tokens of a sequence the draft has not seen (its prompt at the first
proposal; later the target's own token and at most one accepted draft) and writes the draft's
own tokens at the lookahead slots. Those stay valid as far as the target accepts them, on the
pages the sequence still holds there. Draft KV only shapes proposals and the target verifies
every one, so a stale entry could cost acceptance, never change an output.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.sequence import Sequence

# How far behind its sequence the draft may be and still propose: a proposal first computes
# what the draft has not seen (a few tokens after a pause in speculation). A sequence further
# behind (speculation was off for long) decodes plainly to its end: catching up its history
# would cost a draft prefill of it, which plain decoding never pays (at a large batch, where
# speculation is off, that would be a second model's work for every token). A sequence the
# draft never saw is taken while its output is this short (its prompt: the draft's prefill).
LAG_LIMIT = 32


@dataclasses.dataclass
class _Written:
    seq: Sequence
    length: int  # positions [0, length) hold the draft KV of seq.token_ids[:length]
    tail: list[int]  # then these drafts, valid as far as they are the sequence's tokens
    page_ids: list[int]  # the sequence's pages when they were written

    def valid(self, page_size: int) -> int:
        tokens, n = self.seq.token_ids, self.length
        for t in self.tail:
            if n >= len(tokens) or tokens[n] != t:
                break
            n += 1
        pages = -(-n // page_size)
        # A page replaced (copy-on-write) holds nothing. One released before a sliding window
        # (its entry now the scratch page 0) is never read again by the draft either
        # (runtime/draft.check_draft_window): what follows it stays valid.
        held = self.seq.page_ids[:pages]
        moved = [i for i, (a, b) in enumerate(zip(held + [-1], self.page_ids)) if a not in (b, 0)]
        if moved:
            n = min(n, moved[0] * page_size)
        return n


class DraftKV:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._written: dict[int, _Written] = {}

    def computed(self, seq: Sequence) -> int:
        """How many leading positions of seq hold its draft KV."""
        written = self._written.get(seq.seq_id)
        return written.valid(self.page_size) if written is not None else 0

    def can_draft(self, seq: Sequence) -> bool:
        """Whether the draft is near enough (LAG_LIMIT) to propose for seq's next step."""
        if seq.seq_id not in self._written:
            return seq.num_output_tokens <= LAG_LIMIT
        return seq.num_tokens - 1 - self.computed(seq) <= LAG_LIMIT

    def wrote(self, seq: Sequence, last: int, drafts: list[int]) -> None:
        """A proposal computed seq's tokens up to position `last` (its last token) and then
        drafts[:-1] (each the input of the next)."""
        self._written[seq.seq_id] = _Written(seq, last + 1, drafts[:-1], list(seq.page_ids))

    def forget(self, seq: Sequence) -> None:
        """seq's pages went back (preemption): what the draft wrote there went with them."""
        self._written.pop(seq.seq_id, None)

    def clear(self) -> None:
        self._written.clear()

    def prune(self) -> None:
        """Drop finished sequences."""
        self._written = {i: w for i, w in self._written.items() if not w.seq.is_finished}
