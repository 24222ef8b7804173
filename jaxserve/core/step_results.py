"""What a step's sampled tokens decide, as values for the scheduler to act on (it owns the
sequences, queues and pages, and applies a step in Scheduler.update):
- `accepted`: which sample rows give tokens. Rows of a chunk overtaken since planning (aborted,
  finished or preempted) give none; of a verification chunk, those Speculation's verdict keeps
  (`Speculation.rows_to_apply`: up to the first sample that differs from its draft).
- `stop_after`: whether a token just appended ends its sequence, and how: EOS, a stop token,
  max_tokens, max_model_len, or its grammar completed or broken.
Host-only, no JAX; nothing here changes the scheduler's state (`stop_after` moves the sequence's
grammar matcher by the token, which is that token's effect on it).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.speculation import Speculation
from jaxserve.core.step_plan import ScheduledChunk, StepPlan
from jaxserve.core.structured_output import advance


@dataclasses.dataclass(frozen=True)
class AcceptedRow:
    """A sample row whose token its sequence takes: the row, the sequence, the row's chunk and
    the token's offset in it."""

    row: int
    seq: Sequence
    chunk: ScheduledChunk
    offset: int


@dataclasses.dataclass(frozen=True)
class Stop:
    """How a token ends its sequence: the status, the stop reason (a stop token), and for a
    broken grammar the request's error."""

    status: SequenceStatus
    reason: int | str | None = None
    error: str | None = None


def accepted(plan: StepPlan, sampled: list[int] | None, speculation: Speculation,
             eos_token_ids: frozenset) -> list[AcceptedRow]:
    """The rows of `plan` whose tokens its sequences take, in order: of sequences still running
    whose chunk was not overtaken, and of a verification chunk the rows Speculation keeps (which
    needs the sampled tokens; ValueError without them)."""
    out, row = [], 0
    for chunk in plan.chunks:
        rows = chunk.sample_rows
        live = (chunk.seq.status is SequenceStatus.RUNNING
                and chunk.seq.num_computed_tokens == chunk.start)
        keep = len(rows)
        if chunk.num_drafts and live:
            if sampled is None:
                raise ValueError("a verification chunk's rows depend on the sampled tokens")
            keep = speculation.rows_to_apply(
                chunk, [int(t) for t in sampled[row:row + len(rows)]], eos_token_ids)
        for i, (offset, seq) in enumerate(rows):
            if live and i < keep and seq.status is SequenceStatus.RUNNING:
                out.append(AcceptedRow(row + i, seq, chunk, offset))
        row += len(rows)
    return out


def stop_after(seq: Sequence, token: int, eos_token_ids: frozenset, max_model_len: int,
               stop_string: str | None = None) -> Stop | None:
    """Whether `token`, just appended to seq, ends it; else a grammar's matcher takes it, and a
    complete grammar ends it ("stop"), a broken one fails it (its error); else `stop_string`,
    which the output processor found the token completes, ends it."""
    params = seq.sampling_params
    if not params.ignore_eos and token in eos_token_ids:
        return Stop(SequenceStatus.FINISHED_STOPPED)
    if token in params.stop_token_ids:
        return Stop(SequenceStatus.FINISHED_STOPPED, token)
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        return Stop(SequenceStatus.FINISHED_LENGTH)
    if seq.num_tokens >= max_model_len:
        return Stop(SequenceStatus.FINISHED_LENGTH)
    if seq.request.grammar is not None:
        try:
            if advance(seq, token):
                return Stop(SequenceStatus.FINISHED_STOPPED)
        except ValueError as e:
            return Stop(SequenceStatus.FINISHED_ERROR, error=str(e))
    return None if stop_string is None else Stop(SequenceStatus.FINISHED_STOPPED, stop_string)
