"""Applying a step's sampled tokens to the scheduler's sequences (the Scheduler's `update` and
what it decides with): which sample rows give tokens (rows of overtaken chunks do not; of a
speculative verification chunk, those up to the first sample that differs from its draft), stop
checks, stop strings, and the verdict on speculative drafts (counted, rolled-back lookahead
pages returned). A mixin of Scheduler, split out so each module reads in one sitting."""

from __future__ import annotations

import time
from collections import Counter

from jaxserve.core.sequence import Request, Sequence, SequenceStatus
from jaxserve.core.speculation import rows_to_apply
from jaxserve.core.structured_output import advance
from jaxserve.core.step_plan import ScheduledChunk, StepPlan


class StepResults:
    def accepted_rows(self, plan: StepPlan,
                      sampled_token_ids: list[int] | None = None) -> list[tuple[int, Sequence]]:
        """(row, sequence) of the sample rows whose tokens update(plan) will append, in order:
        those of sequences still running whose chunk was not overtaken (aborted, finished or
        preempted since schedule()), and of a verification chunk the rows `rows_to_apply`
        keeps (which needs the sampled tokens). Changes nothing."""
        return [(row, seq) for row, seq, _, _ in self._accepted(plan, sampled_token_ids)]

    def _accepted(self, plan: StepPlan, sampled) -> list[tuple[int, Sequence, ScheduledChunk, int]]:
        """accepted_rows with each row's chunk and token offset in it."""
        out, row = [], 0
        for chunk in plan.chunks:
            rows = chunk.sample_rows
            live = (chunk.seq.status is SequenceStatus.RUNNING
                    and chunk.seq.num_computed_tokens == chunk.start)
            keep = len(rows)
            if chunk.draft_token_ids and live:
                if sampled is None:
                    raise ValueError("a verification chunk's rows depend on the sampled tokens")
                keep = rows_to_apply(chunk, [int(t) for t in sampled[row:row + len(rows)]],
                                     self.eos_token_ids)
            for i, (offset, seq) in enumerate(rows):
                if live and i < keep and seq.status is SequenceStatus.RUNNING:
                    out.append((row + i, seq, chunk, offset))
            row += len(rows)
        return out

    def update(self, plan: StepPlan, sampled_token_ids: list[int],
               stop_strings: dict[int, str] | None = None) -> list[Request]:
        """Apply a plan's sampled tokens; returns the requests that progressed or finished.
        stop_strings {row: stop string} (the output processor's answer for accepted_rows: the
        rows whose token completed a stop string) finish their sequences after that token,
        unless an EOS, stop token or length finished them first."""
        stop_strings = stop_strings or {}
        if len(sampled_token_ids) != len(plan.sample_rows):
            raise ValueError(f"plan samples {len(plan.sample_rows)} tokens, "
                             f"got {len(sampled_token_ids)}")
        self._outstanding.pop(id(plan), None)
        # Before the chunks below advance their sequences.
        accepted = self._accepted(plan, sampled_token_ids)
        for chunk in plan.chunks:
            for seq_id in {chunk.seq.seq_id, *(s.seq_id for s in chunk.sample_seqs)}:
                self._in_flight[seq_id] -= 1
                if self._in_flight[seq_id] <= 0:
                    del self._in_flight[seq_id]
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == chunk.start \
                    and not chunk.draft_token_ids:  # a verification's computed tokens: below
                seq.num_computed_tokens += chunk.num_tokens
                self.kv.register_full_pages(seq)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for row, seq, chunk, offset in accepted:  # others were overtaken: their tokens dropped
            if seq.is_finished:  # a token before it in the same verification chunk ended it
                continue
            token = int(sampled_token_ids[row])
            seq.num_computed_tokens = chunk.start + offset + 1  # KV up to this row's input
            self.kv.register_full_pages(seq)
            seq.token_ids.append(token)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request.request_id] = request
            self._check_stop(seq, token)
            if seq.request.grammar is not None and not seq.is_finished:
                self._advance_grammar(seq, token)
            if row in stop_strings and not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED, stop_strings[row])
        self._settle_verifications(plan, accepted)
        for request in self._finished_unreported:
            touched.setdefault(request.request_id, request)
        self._finished_unreported = []
        self.kv.steps_applied([step for step, _ in self._outstanding.values()])
        return list(touched.values())

    def _settle_verifications(self, plan: StepPlan, accepted) -> None:
        """Count each verification's accepted drafts, and return the pages its rejected
        lookahead held wholly (the sequence keeps pages for its tokens, the last one included:
        the next step writes its KV); a step with any verification counts once in
        spec_verifying_steps."""
        kept = Counter(id(chunk) for _, _, chunk, _ in accepted)
        verified = [c for c in plan.chunks if c.draft_token_ids and kept[id(c)]]
        self.counters["spec_verifying_steps"] += bool(verified)
        for chunk in verified:
            drafted, taken = len(chunk.draft_token_ids), kept[id(chunk)] - 1
            self.counters["spec_steps"] += 1
            self.counters["spec_draft_tokens"] += drafted
            self.counters["spec_accepted_tokens"] += taken
            for i in range(taken):
                self.spec_accepted_at[i] += 1
            if chunk.seq.status is SequenceStatus.RUNNING:
                self.kv.trim(chunk.seq, chunk.seq.num_tokens)

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        """The token moves the sequence's matcher; a complete grammar finishes it ("stop")."""
        try:
            complete = advance(seq, token)
        except ValueError as e:
            seq.request.error = str(e)
            self._finish(seq, SequenceStatus.FINISHED_ERROR)
            return
        if complete:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif token in params.stop_token_ids:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, token)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
