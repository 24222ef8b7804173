"""Draft proposals for speculative decoding, on the host.

`ngram_proposal` is prompt lookup: a sequence that copies, edits or summarises its prompt tends
to repeat runs of it, so the tokens that followed the latest earlier occurrence of its last n
tokens are a good guess at what comes next. A draft model's proposals come from the device: the
scheduler reserves their slots with PENDING tokens, which the engine replaces by the draft
model's (jaxserve/runtime/draft.py) before the step is built. Acceptance (Scheduler.update) compares each proposed
token with the target model's own sample at that position, so a proposal can only cost time,
never change an output.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.core.draft_kv import DraftKV
from jaxserve.core.sequence import Sequence
from jaxserve.core.step_plan import ScheduledChunk
from jaxserve.core.structured_output import matcher_of, valid_drafts

PENDING = -1  # a draft model's token, filled in by the engine before the step runs


def ngram_proposal(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following an earlier match of the last n tokens of token_ids, trying
    n = max_n down to min_n: the latest match that k tokens follow (recent text is the likelier
    source), else the earliest (in a repeating run the latest matches overlap the suffix and
    only the last token follows them); [] when nothing matches (or k < 1)."""
    total = len(token_ids)
    if k < 1 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # Windows starting at 0 .. total - n - 1: every occurrence before the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            whole = starts[starts + n + k <= total]
            follow = int(whole[-1] if whole.size else starts[0]) + n
            return tokens[follow:follow + k].tolist()
    return []


class Proposer:
    """Drafts for a decoding sequence's next step (`rows_to_apply` judges them)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, page_size: int = 16):
        self.config = config
        self.max_model_len = max_model_len
        # The draft method: what the draft model's KV holds of each sequence.
        self.draft_kv = DraftKV(page_size) if config.method == "draft" else None

    def drafts(self, seq: Sequence, tokens_left: int) -> list[int]:
        """Up to num_speculative_tokens drafts after seq's last token, within the step's
        `tokens_left` (beyond the decode token itself) and so that even all accepted plus the
        target's own next token stay within max_tokens and max_model_len."""
        c = self.config
        params = seq.sampling_params
        k = min(c.num_speculative_tokens, tokens_left, self.max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        return self.propose(seq, k) if k >= 1 else []

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k >= 1 tokens to follow seq's last token (a draft model's: k PENDING)."""
        c = self.config
        if c.method == "draft":
            return [PENDING] * k if self.draft_kv.can_draft(seq) else []
        drafts = ngram_proposal(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if seq.request.grammar is not None:  # only the drafts its grammar allows
            drafts = drafts[:valid_drafts(matcher_of(seq), drafts)]
        return drafts


def rows_to_apply(chunk: ScheduledChunk, sampled: list[int], eos_token_ids: frozenset) -> int:
    """How many of a verification chunk's sample rows (`sampled`, in order) give tokens: row i
    counts while the target's samples matched drafts 0 .. i-1 (row i then samples position
    start + i + 1 given only accepted tokens), and none after a row whose token ends the
    sequence (EOS or a stop token; max_tokens and max_model_len bound the drafts already)."""
    params = chunk.seq.sampling_params
    for i, token in enumerate(sampled):
        ends = (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if ends or i == len(chunk.draft_token_ids) or token != chunk.draft_token_ids[i]:
            return i + 1
    return len(sampled)
