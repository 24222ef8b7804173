"""Turns sampled tokens into user-visible text: incremental detokenization, stop strings (the stop
string itself is not returned, and one split across tokens is still caught), logprobs, and
RequestOutput snapshots. Host-only."""

from __future__ import annotations

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sequence import Request, Sequence
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceText:
    """Decoded text of one sequence, with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence):
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[:seq.num_prompt_tokens])
        self.stops = seq.sampling_params.stop
        self.text = ""
        self.num_tokens = 0  # output tokens consumed so far
        self.stopped_at: str | None = None

    def consume(self, seq: Sequence) -> str | None:
        """Feed newly generated tokens; returns the stop string hit, if any."""
        new = seq.output_token_ids[self.num_tokens:]
        self.num_tokens += len(new)
        if self.stopped_at is not None:
            return None
        for token in new:
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

    def update(self, request: Request, now: float) -> list[tuple[Sequence, str]]:
        """Consume new tokens of every sequence; returns (sequence, stop string) pairs that hit a
        stop string and must be finished by the scheduler."""
        hits = []
        for seq in request.sequences:
            st = self._texts.get(seq.seq_id)
            if st is None:
                st = self._texts[seq.seq_id] = SequenceText(self.tokenizer, seq)
            if seq.fork_index == 0 and seq.num_output_tokens > st.num_tokens:
                times = self._token_times.setdefault(request.request_id, [])
                times.extend([now] * (seq.num_output_tokens - st.num_tokens))
            stop = st.consume(seq)
            if stop is not None and not seq.is_finished:
                hits.append((seq, stop))
        return hits

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
            prompt_logprobs=request.prompt_logprobs)

    def release(self, request: Request) -> None:
        for seq in request.sequences:
            self._texts.pop(seq.seq_id, None)
        self._token_times.pop(request.request_id, None)
