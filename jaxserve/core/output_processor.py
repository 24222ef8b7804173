"""Turns sampled tokens into what users see: incremental detokenization, stop strings (the stop
string itself is not returned, and one split across tokens is still caught), logprobs and prompt
logprobs, token times, and RequestOutput snapshots. Host-only.

It reads a step's rows before the scheduler applies them, and answers with the stop strings they
hit; the engine passes those to Scheduler.update, which finishes the sequences."""

from __future__ import annotations

import math

from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.core.sequence import Request, Sequence
from jaxserve.core.step_plan import StepPlan
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

LOGPROB_FLOOR = -9999.0  # a logprob that is not finite, in outputs (JSON has no -inf or NaN)


class SequenceText:
    """Decoded text of one sequence, with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence):
        spec = seq.sampling_params.structured_outputs
        self.detok = IncrementalDetokenizer(  # a tool call's special markup stays in the text
            tokenizer, seq.token_ids[:seq.num_prompt_tokens],
            keep_ids=spec.special_text_ids if spec is not None else ())
        self.stops = seq.sampling_params.stop
        self.text = ""
        self.stopped_at: str | None = None

    def add(self, token: int) -> str | None:
        """Feed one generated token; returns the stop string it completes, if any."""
        if self.stopped_at is not None:
            return None
        before = len(self.text)
        self.text += self.detok.add(token)
        for stop in self.stops:
            # A stop may straddle the previous text and this token's delta.
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text, self.stopped_at = self.text[:at], stop
                return stop
        return None

    def visible(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could begin a stop string."""
        if finished or not self.stops:
            return self.text
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, SequenceText] = {}
        self._token_times: dict[str, list[float]] = {}

    def process(self, rows: list[tuple[int, Sequence]], out,
                now: float) -> tuple[dict[int, str], dict[str, str]]:
        """A step's sample rows that the scheduler will apply ((row, sequence) pairs from
        Scheduler.accepted_rows, in order; a sequence has several when it verified drafts),
        with the step's output `out` (token_ids, logprobs, top_ids, top_logprobs per row):
        records logprobs and token times and detokenizes each token. Returns ({row: stop
        string} for the rows whose token completes a stop string (the sequence's later rows
        are skipped), {request_id: error} for the requests whose row could not be processed:
        they fail alone)."""
        stops, errors, stopped = {}, {}, set()
        for row, seq in rows:
            if seq.seq_id in stopped:
                continue
            try:
                stop = self._process_row(seq, row, out, now)
            except Exception as e:  # noqa: BLE001 - a bad row fails its request, not the step
                errors[seq.request.request_id] = f"processing its output failed: {e!r}"
                continue
            if stop is not None:
                stops[row] = stop
                stopped.add(seq.seq_id)
        return stops, errors

    def _process_row(self, seq: Sequence, row: int, out, now: float) -> str | None:
        """Logprobs, token time and text of one row's token; the stop string it completes."""
        token = int(out.token_ids[row])
        k = seq.sampling_params.logprobs
        if k is not None:
            seq.output_logprobs.append(logprob_entry(token, out.logprobs[row], out.top_ids[row][:k],
                                                     out.top_logprobs[row]))
        if seq.fork_index == 0:
            self._token_times.setdefault(seq.request.request_id, []).append(now)
        st = self._texts.get(seq.seq_id)
        if st is None:
            st = self._texts[seq.seq_id] = SequenceText(self.tokenizer, seq)
        return st.add(token)

    @staticmethod
    def record_prompt_logprobs(plan: StepPlan, offsets: list[int], out) -> dict[str, str]:
        """request.prompt_logprobs[i] = {prompt token i: logprob, top-k...} (None for i = 0),
        from a step's per-token prompt logprobs (offsets: each chunk's first flat token).
        Returns {request_id: error} for the requests whose entries could not be recorded."""
        errors = {}
        for chunk, first in zip(plan.chunks, offsets):
            seq = chunk.seq
            k = seq.sampling_params.prompt_logprobs
            if k is None or seq.fork_index or seq.is_finished:
                continue
            try:
                _record_chunk_prompt_logprobs(chunk, first, k, out)
            except Exception as e:  # noqa: BLE001 - fails this request alone
                errors[seq.request.request_id] = f"recording its prompt logprobs failed: {e!r}"
        return errors

    def snapshot(self, request: Request, prompt: str | None) -> RequestOutput:
        outputs = []
        for seq in request.sequences:
            st = self._texts.get(seq.seq_id)
            finished = seq.is_finished
            token_ids = list(seq.output_token_ids)
            lps = None
            if seq.sampling_params.logprobs is not None:
                lps = list(seq.output_logprobs[:len(token_ids)])
            outputs.append(CompletionOutput(
                index=seq.fork_index, text=st.visible(finished) if st else "",
                token_ids=token_ids, finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason, logprobs=lps,
                cumulative_logprob=sum(d[t] for d, t in zip(lps, token_ids)) if lps else None))
        outputs.sort(key=lambda o: o.index)
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, finished_time=request.finished_time,
            token_times=list(self._token_times.get(request.request_id, [])))
        seq0 = request.sequences[0] if request.sequences else None
        return RequestOutput(
            request_id=request.request_id, prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids), outputs=outputs,
            finished=request.is_finished, metrics=metrics,
            num_cached_tokens=seq0.num_cached_tokens if seq0 else 0,
            prompt_logprobs=request.prompt_logprobs, error=request.error)

    def release(self, request: Request) -> None:
        for seq in request.sequences:
            self._texts.pop(seq.seq_id, None)
        self._token_times.pop(request.request_id, None)


def logprob_entry(token: int, logprob, top_ids, top_logprobs) -> dict[int, float]:
    """{token: its logprob, top token: logprob, ...}, finite only: a top token whose logprob is
    -inf (masked by a grammar or a bias) is left out, and a token's own logprob that is not
    finite (an overflowed logit) reads as LOGPROB_FLOOR, as vLLM's API does."""
    entry = {int(t): float(lp) for t, lp in zip(top_ids, top_logprobs) if math.isfinite(lp)}
    entry[int(token)] = float(logprob) if math.isfinite(logprob) else LOGPROB_FLOOR
    return entry


def _record_chunk_prompt_logprobs(chunk, first: int, k: int, out) -> None:
    seq, request = chunk.seq, chunk.seq.request
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None]
    for p in range(chunk.start, chunk.start + chunk.num_tokens):
        target = p + 1
        if target >= seq.num_prompt_tokens or target < len(request.prompt_logprobs):
            continue  # past the prompt, or already recorded (recompute after preemption)
        i = first + p - chunk.start
        request.prompt_logprobs.append(logprob_entry(
            seq.token_ids[target], out.prompt_logprobs[i], out.prompt_top_ids[i][:k],
            out.prompt_top_logprobs[i][:k]))
