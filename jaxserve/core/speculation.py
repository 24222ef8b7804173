"""Speculation: the one owner of speculative decoding's state, on the host (no JAX).

It holds k (the drafts per sequence of the next step planned: fixed, or chosen by the cost model
`SpeculationControl` from measured step costs), the counters (decodes that could have speculated,
drafts verified and accepted per position, verifications), the proposer and, for the draft
method, what the draft model's KV holds of each sequence (`DraftKV`). Nothing else writes them.

The scheduler calls it through a narrow interface:
- `drafts(seq, tokens_left)` -> `Drafts`, when it schedules a decode: prompt lookup's tokens
  (`ngram_proposal`, only those a grammar allows), or for the draft method a count of drafts that
  the draft model proposes on the device once the step is planned (engine/speculator.py drives
  runtime/draft.py and returns the plan with them: `StepPlan.with_drafts`);
- `scheduled(chunk)`, `rows_to_apply(chunk, sampled, eos)` (the verdict: the target's sample at
  each position against its draft, so a proposal can only cost time, never change an output),
  `settle(kept)` (counts the verdicts; returns the sequences whose rejected lookahead pages the
  scheduler returns) and `forget(seq)` (a preempted sequence's pages went back).
The engine's side (engine/speculator.py) calls `choose` before planning and `observe` after each
step; `k` and `stats` are read-only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.core.draft_kv import DraftKV
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.speculation_control import SpeculationControl
from jaxserve.core.step_plan import ScheduledChunk
from jaxserve.core.structured_output import matcher_of, valid_drafts


@dataclasses.dataclass(frozen=True)
class Drafts:
    """A decode's drafts: `count` tokens to verify after its last token; `token_ids` the
    proposer's, or () where the draft model proposes them after planning (method "draft")."""

    count: int = 0
    token_ids: tuple[int, ...] = ()


NO_DRAFTS = Drafts()


def ngram_proposal(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: up to k tokens following an earlier match of the last n tokens of
    token_ids (a sequence that copies, edits or summarises its prompt tends to repeat runs of
    it), trying n = max_n down to min_n: the latest match that k tokens follow (recent text is
    the likelier source), else the earliest (in a repeating run the latest matches overlap the
    suffix and only the last token follows them); [] when nothing matches (or k < 1)."""
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


class NgramProposer:
    """Prompt lookup's proposals (`propose(seq, k)`: up to k tokens after seq's last one)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return ngram_proposal(seq.token_ids, k, self.min_n, self.max_n)


class Speculation:
    def __init__(self, config: SpeculativeConfig | None, *, max_model_len: int, page_size: int,
                 token_buckets: tuple[int, ...] = (), proposer=None):
        """config None: no speculation (k stays 0). token_buckets: the step's token buckets,
        which the cost model times (adaptive; without them k stays fixed). proposer: what
        proposes tokens (default prompt lookup; method "draft" proposes on the device)."""
        self.config = config
        self.max_model_len = max_model_len
        max_k = config.num_speculative_tokens if config else 0
        self._k = max_k
        draft = config is not None and config.method == "draft"
        self.draft_kv = DraftKV(page_size) if draft else None
        self.proposer = proposer or (NgramProposer(config) if config and not draft else None)
        self.control = (SpeculationControl(max_k, token_buckets)
                        if config and config.adaptive and token_buckets else None)
        # Per draft position (1st, 2nd, ...): drafts verified there and accepted there, and the
        # decodes that could have speculated (the cost model reads them).
        self.drafted_at, self.accepted_at = [0] * max_k, [0] * max_k
        self.opportunities = 0
        self.counters = dict(spec_steps=0, spec_verifying_steps=0, spec_draft_tokens=0,
                             spec_accepted_tokens=0)

    @property
    def k(self) -> int:
        """Drafts per sequence at most in the next step planned."""
        return self._k

    # ---- the engine's side
    def choose(self, running: list[Sequence], waiting: bool) -> int:
        """k for the next step planned, from the cost model, in steps that only decode (prompt
        work, of waiting or still prefilling sequences, takes the budget first); fixed when not
        adaptive. 0 lets async scheduling plan that step ahead."""
        if self.control is None:
            return self._k
        decoding = sum(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in running)
        if waiting or decoding < len(running):
            self._k = 0
        else:
            self._k = self.control.choose(decoding, self.opportunities, self.drafted_at,
                                          self.accepted_at)
        return self._k

    def observe(self, num_tokens: int, seconds: float, verifying: bool) -> None:
        """A step's cost for the cost model (SpeculationControl.observe)."""
        if self.control is not None:
            self.control.observe(num_tokens, seconds, verifying)

    # ---- the scheduler's side
    def drafts(self, seq: Sequence, tokens_left: int) -> Drafts:
        """Up to k drafts after decoding seq's last token, within the step's `tokens_left`
        (beyond the decode token itself) and so that even all accepted plus the target's own
        next token stay within max_tokens and max_model_len. Penalised rows are not speculated:
        their drafts' rows would need the counts with each earlier draft (a grammar's masks
        follow the drafts: fill_masks)."""
        params = seq.sampling_params
        if not self._k or params.has_penalties:
            return NO_DRAFTS
        self.opportunities += 1
        k = min(self._k, tokens_left, self.max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        if k < 1:
            return NO_DRAFTS
        if self.draft_kv is not None:
            return Drafts(k) if self.draft_kv.can_draft(seq) else NO_DRAFTS
        tokens = self.proposer.propose(seq, k)
        if seq.request.grammar is not None:  # only the drafts its grammar allows
            tokens = tokens[:valid_drafts(matcher_of(seq), tokens)]
        return Drafts(len(tokens), tuple(tokens))

    def scheduled(self, chunk: ScheduledChunk) -> None:
        """A verification chunk went into a plan: its drafts are counted per position."""
        for position in range(chunk.num_drafts):
            self.drafted_at[position] += 1

    @staticmethod
    def rows_to_apply(chunk: ScheduledChunk, sampled: list[int], eos_token_ids) -> int:
        """How many of a verification chunk's sample rows (`sampled`, in order) give tokens:
        row i counts while the target's samples matched drafts 0 .. i-1 (row i then samples
        position start + i + 1 given only accepted tokens), and none after a row whose token
        ends the sequence (EOS or a stop token; max_tokens and max_model_len bound the drafts
        already)."""
        params, drafts = chunk.seq.sampling_params, chunk.draft_token_ids
        for i, token in enumerate(sampled):
            ends = (token in eos_token_ids and not params.ignore_eos) \
                or token in params.stop_token_ids
            if ends or i == len(drafts) or token != drafts[i]:
                return i + 1
        return len(sampled)

    def settle(self, verified: list[ScheduledChunk]) -> list[Sequence]:
        """A step's verdicts, each verification chunk once per sample row it applied: counts
        the drafts accepted (a step with any verification counts once in spec_verifying_steps)
        and returns the sequences still running, whose pages past their tokens the caller
        returns (the last token's included: the next step writes its KV)."""
        rows = Counter(id(chunk) for chunk in verified)
        chunks = {id(chunk): chunk for chunk in verified}.values()
        self.counters["spec_verifying_steps"] += bool(rows)
        trim = []
        for chunk in chunks:
            taken = rows[id(chunk)] - 1
            self.counters["spec_steps"] += 1
            self.counters["spec_draft_tokens"] += chunk.num_drafts
            self.counters["spec_accepted_tokens"] += taken
            for i in range(taken):
                self.accepted_at[i] += 1
            if chunk.seq.status is SequenceStatus.RUNNING:
                trim.append(chunk.seq)
        return trim

    def forget(self, seq: Sequence) -> None:
        """seq's pages went back (preemption): what the draft model wrote there went too."""
        if self.draft_kv is not None:
            self.draft_kv.forget(seq)

    def stats(self) -> dict:
        return dict(spec_accepted_per_position=list(self.accepted_at),
                    spec_drafted_per_position=list(self.drafted_at), spec_k=self._k,
                    **self.counters)
