"""Scheduler: iteration-level (Orca) scheduling of sequences onto a fixed pool of KV pages.

Owns the waiting and running queues and decides, once per step, which tokens are computed: a
StepPlan of chunks (decode chunks first, then prefill chunks), copy-on-write page copies and the
sequences preempted to make room. `update()` applies the sampled tokens and the stop strings the
output processor found in them, checks stop conditions and releases pages. Host-only, no JAX.

Policies:
- Budget: one decode token per running sequence that finished its prompt, then prefill chunks within
  max_num_batched_tokens and max_num_seqs. With chunked prefill a prompt is split to fit the budget
  (chunks need not be page-aligned); without it a prompt is scheduled whole or not at all (a prompt
  longer than max_num_batched_tokens is rejected; only a preempted sequence recomputing more than
  max_num_batched_tokens tokens is split).
- Context cost (chunked prefill): a prefill chunk's tokens count their context too (StepBudget),
  so a chunk deep into a long prompt is shorter. The first prefill chunk of a step gets a token
  at least.
- Order: running sequences and admission follow arrival (add_request order) under "fcfs", and
  (request.priority, arrival) under "priority" (lower priority value first).
- Admission: a waiting sequence is admitted only if its next chunk's pages (after prefix-cache hits)
  are available (free or evictable) while keeping `watermark` of the pool free for growth; the
  watermark is waived when nothing is running, so the head always gets in eventually.
  No new admission in a step that preempted. scheduling="static": admit only when nothing runs.
- Preemption by recompute: when a running sequence cannot get pages for its chunk, the victim is the
  LAST running sequence in the order above (most recent request, highest fork first; under
  "priority" the lowest priority), possibly the sequence itself. Its pages are dropped and it goes
  to the front of the waiting queue; re-admitted, it recomputes prompt + generated tokens through
  prefill chunks (the prefix cache may supply pages) and continues with identical outputs. A
  request whose prompt + max_tokens can never fit the pool is rejected by add_request; one with
  max_tokens=None (up to the context length) has the pool as its context: a sequence alone in
  the pool whose next token cannot fit in it is finished with FINISHED_LENGTH (reported by the
  next update(), which every plan gets, empty ones included).
- n > 1: at the chunk completing sequence 0's prompt the n-1 forks are created sharing its pages;
  max_num_seqs counts all n at admission. Forks are preempted individually; in a short pool
  they run one at a time, so one sequence fitting the pool is enough.
- Pages freed while a plan is outstanding (returned by schedule(), not yet passed to update()) are
  not reallocated until update() of that plan, which every plan gets (empty ones included).
- Planning ahead (async scheduling): schedule_next(plan), called while `plan` is on the device,
  plans the next decode step with the tokens `plan` samples fed in on the device. Only where
  nothing waits and every running sequence decodes; otherwise it returns None.
- Speculative decoding (`spec_k` > 0 drafts at most per sequence; the engine sets it per step):
  a decoding sequence's chunk also computes the drafts the proposer offers (within the budget
  left after the other decodes) and samples at each of its tokens; update() keeps the tokens up
  to the first sample that differs from its draft and returns lookahead pages left wholly
  unused. Its next positions depend on that verdict, so while speculating nothing is planned
  ahead (schedule_next returns None).
"""

from __future__ import annotations

import time
from collections import Counter

from jaxserve.config import EngineConfig
from jaxserve.core.kv_manager import KVManager
from jaxserve.core.limits import RequestRejected, check_request
from jaxserve.core.page_pool import PagePool
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.sequence import Request, Sequence, SequenceStatus
from jaxserve.core.speculation import Proposer
from jaxserve.core.step_budget import StepBudget
from jaxserve.core.step_plan import ScheduledChunk, StepPlan
from jaxserve.core.step_results import StepResults


class Scheduler(StepResults):
    def __init__(self, config: EngineConfig, *, num_pages: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], model_fingerprint: str,
                 kv_window: int | None = None):
        self.config = config
        self.page_size = config.page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = PagePool(num_pages)
        self.cache = (PrefixCache(self.pool, self.page_size, model_fingerprint)
                      if config.enable_prefix_caching else None)
        # kv_window (ModelConfig.kv_window): pages before every layer's window are released.
        self.kv = KVManager(self.pool, self.page_size, self.cache, window=kv_window)
        self.watermark_pages = int(config.watermark * self.pool.num_usable)
        # The engine resolves None (EngineConfig.resolved_prefill_keys_per_token); here it is off.
        self.budget = StepBudget(config.max_num_batched_tokens,
                                 (config.prefill_keys_per_token or 0)
                                 if config.enable_chunked_prefill else 0, kv_window)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._requests: dict[str, Request] = {}  # live (unfinished) requests
        self._arrival: dict[str, int] = {}
        self._num_arrivals = 0
        self._next_seq_id = 0
        self._step = 0
        self._outstanding: dict[int, tuple[int, StepPlan]] = {}  # id(plan) -> (step, plan)
        self._in_flight: Counter[int] = Counter()  # seq id -> its chunks in outstanding plans
        self._finished_unreported: list[Request] = []
        self.counters = dict(num_preempted_total=0, num_aborted_total=0, num_finished_total=0,
                             num_rejected_total=0, num_failed_total=0, prefix_cache_queries=0,
                             prefix_cache_hits=0, num_steps=0, num_cow_copies=0,
                             num_scheduled_ahead=0, spec_steps=0, spec_verifying_steps=0,
                             spec_draft_tokens=0, spec_accepted_tokens=0)
        spec = config.speculative_config
        self.proposer = Proposer(spec, max_model_len, config.page_size) if spec else None
        k = spec.num_speculative_tokens if spec else 0
        self.spec_k = k  # drafts per sequence at most: the engine's choice per step
        # Per draft position (1st, 2nd, ...): drafts verified there and accepted there, and the
        # decodes that could have speculated (the engine's cost model reads them).
        self.spec_drafted_at, self.spec_accepted_at = [0] * k, [0] * k
        self.spec_opportunities = 0

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Create sequence 0 and queue it, or raise RequestRejected (nothing queued)."""
        try:
            if request.request_id in self._requests:
                raise RequestRejected(f"request_id {request.request_id!r} is already live")
            check_request(request, self.config, max_model_len=self.max_model_len,
                          pages_for=self._pages_to_hold, num_usable_pages=self.pool.num_usable)
        except RequestRejected:
            self.counters["num_rejected_total"] += 1
            raise
        seq = Sequence(seq_id=self._new_seq_id(), request=request,
                       token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids))
        request.sequences.append(seq)
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._num_arrivals
        self._num_arrivals += 1
        self.waiting.append(seq)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Abort a live request wherever it is, or with `error` fail it; frees everything. False
        if unknown or finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.error = error
        status = SequenceStatus.FINISHED_ABORTED if error is None else SequenceStatus.FINISHED_ERROR
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, status)
        self.counters["num_aborted_total" if error is None else "num_failed_total"] += 1
        return True

    def drop_kv(self, error: str) -> list[Request]:
        """The device pool's contents are lost (a failed step had it donated): every running
        request fails with `error`, and the prefix cache forgets every page. Returns them."""
        failed = list({s.request.request_id: s.request for s in self.running}.values())
        for request in failed:
            self.abort(request.request_id, error)
        if self.cache is not None:
            self.cache.clear()
        return failed

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._finished_unreported)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        plan = StepPlan()
        budget = self.budget
        budget.reset()  # _schedule_chunk spends each chunk's share
        self.running.sort(key=self._order_key)
        anything_running = bool(self.running)
        queue = [s for s in self.running if not self._in_flight[s.seq_id]]
        decodes_left = sum(self._is_decode_ready(s) for s in queue)
        i = 0
        while i < len(queue):
            seq = queue[i]
            i += 1
            decode = self._is_decode_ready(seq)
            drafts = []
            if decode:
                decodes_left -= 1
                # Penalised rows are not speculated: their drafts' rows would need the counts
                # with each earlier draft (a grammar's masks follow the drafts: fill_masks).
                if self.spec_k and not seq.sampling_params.has_penalties:
                    drafts = self.proposer.drafts(
                        seq, min(self.spec_k, int(budget.left) - decodes_left - 1))
                    self.spec_opportunities += 1
                n = 1 + len(drafts)
            else:
                n = self._chunk_len(seq, seq.num_computed_tokens,
                                    budget.left - decodes_left, plan)
                if n == 0:
                    continue
            while self.kv.pages_needed(seq, n) > self.pool.num_available:
                if drafts:  # no pages for the lookahead: decode plainly rather than preempt
                    drafts, n = [], 1
                    continue
                fit = 0 if decode else self._fit_chunk(seq, n)
                if 0 < fit < n:  # a shorter prefill chunk fits: take it rather than preempt
                    n = fit
                    continue
                if i < len(queue):  # a later (lower-priority) sequence not yet scheduled
                    victim = queue.pop()
                    decodes_left -= self._is_decode_ready(victim)
                    self._preempt(victim, plan)
                    continue
                if any(s is not seq for s in self.running):
                    self._preempt(seq, plan)
                elif self.pool.num_pending == 0:
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                    self._finished_unreported.append(seq.request)
                n = 0
                break
            if n:
                self._schedule_chunk(seq, n, plan, drafts)

        if cfg.scheduling == "iteration":
            while not plan.preempted and self.waiting and budget.left > 0:
                if not self._admit_one(plan, budget.left):
                    break
        elif not anything_running:
            # Static (request-level) batching: once the previous batch has drained, admit a whole
            # new batch up to max_num_seqs; members beyond this step's token budget are admitted
            # without a chunk and prefilled in later steps. Nothing joins until it drains again.
            while self.waiting:
                if not self._admit_one(plan, budget.left, allow_empty=True):
                    break

        plan.chunks.sort(key=lambda c: not c.is_decode)  # stable: decodes first
        if plan.chunks:
            self._track(plan)
        return plan

    def _track(self, plan: StepPlan) -> None:
        """A non-empty plan goes out: outstanding until update(), pages freed meanwhile held."""
        self._step += 1
        self._outstanding[id(plan)] = (self._step, plan)
        self.kv.step_launched(self._step)
        self.counters["num_steps"] += 1
        self.counters["num_cow_copies"] += len(plan.copies)

    def schedule_next(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan`, planned while `plan` is still on the device (its tokens are not
        known yet), or None where that needs them. Only the common case: nothing waiting, and
        every running sequence samples its own next token in `plan` (decodes and last prompt
        chunks, no forks); each then decodes that token, fed in on the device (feed_row).
        A sequence that `plan`'s token will certainly finish (max_tokens, max_model_len) is left
        out; one that an EOS, stop token or stop string finishes is computed once more and its
        token dropped by update(), as for any sequence finished while a plan is in flight.
        Needs a page at most per sequence, none copied and no preemption; otherwise None."""
        if not plan.chunks or self.spec_k:
            return None
        if id(plan) not in self._outstanding:
            raise ValueError("schedule_next plans the step after one still in flight")
        if self.waiting or plan.preempted:
            return None
        if len(plan.chunks) != len(self.running) or \
                any(len(c.sample_seqs) != 1 or c.sample_seqs[0] is not c.seq or c.draft_token_ids
                    or c.seq.status is not SequenceStatus.RUNNING for c in plan.chunks):
            return None
        nxt = StepPlan()
        rows = []
        for row, chunk in enumerate(plan.chunks):  # one sample row per chunk, in order
            seq = chunk.seq
            position = chunk.start + chunk.num_tokens  # the token `plan` samples
            max_tokens = seq.sampling_params.max_tokens
            if (max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens) \
                    or position + 1 >= self.max_model_len:
                continue
            rows.append((row, seq, position))
        if not rows:
            return None
        if not self.kv.prepare_slots([(seq, position) for _, seq, position in rows]):
            return None
        for row, seq, position in rows:
            nxt.chunks.append(ScheduledChunk(seq=seq, start=position, num_tokens=1,
                                             sample_seqs=[seq], feed_row=row))
            self._in_flight[seq.seq_id] += 1
        self._track(nxt)
        self.counters["num_scheduled_ahead"] += 1
        return nxt

    def _admit_one(self, plan: StepPlan, budget_left: float, allow_empty: bool = False) -> bool:
        """Admit the head waiting sequence with its first chunk; False if it does not fit now.
        With allow_empty, a sequence for which no budget is left is admitted without a chunk."""
        seq = self._head_waiting()
        # Seats, not sequences: a running request not yet forked still needs room for its n.
        if sum(map(self._seats, self.running)) + self._seats(seq) > self.config.max_num_seqs:
            return False
        salt = seq.request.cache_salt if seq.request.cache_salt is not None else self.config.cache_salt
        hit = self.kv.find_prefix(seq, salt)
        hit_tokens = len(hit[0]) * self.page_size
        n = self._chunk_len(seq, hit_tokens, budget_left, plan) if budget_left > 0 else 0
        if n == 0 and not allow_empty:
            return False
        # A static batch reserves room for each member's whole prompt before admitting more.
        need = self.kv.pages_for(seq.num_tokens if allow_empty else hit_tokens + n) - len(hit[0])
        available = self.pool.num_available - sum(self.pool.is_evictable(p) for p in hit[0])
        alone = not self.running
        if need > available - (0 if alone else self.watermark_pages):
            if alone and self.pool.num_pending == 0 \
                    and self._pages_to_hold(seq.num_tokens) > self.pool.num_usable:
                self.waiting.remove(seq)  # a recomputation that can never fit again
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                self._finished_unreported.append(seq.request)
                return True
            return False
        self.waiting.remove(seq)
        self.kv.admit(seq, salt, hit)
        if self.cache is not None:
            self.counters["prefix_cache_queries"] += seq.num_tokens
            self.counters["prefix_cache_hits"] += hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.request.first_scheduled_time is None:
            seq.request.first_scheduled_time = time.monotonic()
        if n:
            self._schedule_chunk(seq, n, plan)
        return True

    def _schedule_chunk(self, seq: Sequence, n: int, plan: StepPlan, drafts=()) -> None:
        start = seq.num_computed_tokens
        self.kv.prepare_write(seq, n, plan.copies)  # drafts included: lookahead slots
        chunk = ScheduledChunk(seq=seq, start=start, num_tokens=n, draft_token_ids=list(drafts))
        self._in_flight[seq.seq_id] += 1
        if drafts:
            chunk.sample_seqs.append(seq)
            for position in range(len(drafts)):
                self.spec_drafted_at[position] += 1
        elif start + n == seq.num_tokens:
            chunk.sample_seqs.append(seq)
            request = seq.request
            if (seq.fork_index == 0 and seq.num_tokens == seq.num_prompt_tokens
                    and len(request.sequences) < request.sampling_params.n):
                for k in range(len(request.sequences), request.sampling_params.n):
                    child = Sequence(seq_id=self._new_seq_id(), request=request,
                                     token_ids=list(seq.token_ids),
                                     num_prompt_tokens=seq.num_prompt_tokens, fork_index=k,
                                     status=SequenceStatus.RUNNING,
                                     num_cached_tokens=seq.num_cached_tokens)
                    self.kv.fork(seq, child)
                    request.sequences.append(child)
                    self.running.append(child)
                    self._in_flight[child.seq_id] += 1
                    chunk.sample_seqs.append(child)
        plan.chunks.append(chunk)
        # Decode and verification chunks count a token each; a prefill chunk its context too.
        self.budget.spend(start, n, prefill=not (chunk.is_decode or drafts))

    # ---- state changes -------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason=None) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        seq.stop_reason = stop_reason
        request = seq.request
        if request.is_finished and request.request_id in self._requests:
            request.finished_time = time.monotonic()
            del self._requests[request.request_id]
            del self._arrival[request.request_id]
            self.counters["num_finished_total"] += 1

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        plan.preempted.append(seq)
        self.counters["num_preempted_total"] += 1
        if self.proposer is not None and self.proposer.draft_kv is not None:
            self.proposer.draft_kv.forget(seq)

    # ---- helpers ---------------------------------------------------------------------------------
    def _pages_to_hold(self, num_tokens: int) -> int:
        return self.kv.pages_to_hold(num_tokens, self.config.max_num_batched_tokens)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _order_key(self, seq: Sequence) -> tuple:
        key = (self._arrival[seq.request.request_id], seq.fork_index)
        if self.config.scheduling_policy == "priority":
            return (seq.request.priority,) + key
        return key

    def _head_waiting(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            return min(self.waiting, key=self._order_key)  # min is stable: front wins ties
        return self.waiting[0]

    def _seats(self, seq: Sequence) -> int:
        """Running slots a sequence takes: all n of a request not yet forked."""
        request = seq.request
        if seq.fork_index == 0 and len(request.sequences) < request.sampling_params.n:
            return request.sampling_params.n
        return 1

    @staticmethod
    def _is_decode_ready(seq: Sequence) -> bool:
        return (seq.num_tokens - seq.num_computed_tokens == 1
                and seq.num_computed_tokens >= seq.num_prompt_tokens)

    def _chunk_len(self, seq: Sequence, start: int, budget_left: float, plan: StepPlan) -> int:
        """Tokens of seq's prefill chunk from `start` within budget_left (context cost counted);
        a token at least when the plan has no prefill chunk yet and any budget is left."""
        remaining = seq.num_tokens - start
        fits = self.budget.tokens_within(start, budget_left)
        if fits == 0 and budget_left >= 1 and all(c.is_decode or c.draft_token_ids
                                                  for c in plan.chunks):
            fits = 1
        if remaining <= fits:
            return remaining
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            return max(fits, 0)
        return 0

    def _fit_chunk(self, seq: Sequence, n: int) -> int:
        """A shorter prefill chunk whose new pages are available now (0 if none or not allowed)."""
        start = seq.num_computed_tokens
        if not (self.config.enable_chunked_prefill
                or seq.num_tokens - start > self.config.max_num_batched_tokens):
            return 0
        end = (len(seq.page_ids) + self.pool.num_available) * self.page_size
        return max(0, min(n, end - start))

    # ---- introspection ------------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for r in self._requests.values() for s in r.sequences if not s.is_finished]

    def check_invariants(self) -> None:
        """AssertionError unless pages are conserved and refcounts match the live page tables."""
        self.kv.check(self.live_sequences())
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.page_ids
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING

    def kv_usage(self) -> dict:
        return self.kv.usage(self.live_sequences())

    def stats(self) -> dict:
        queries = self.counters["prefix_cache_queries"]
        return dict(
            **self.kv.page_stats(), running=len(self.running), waiting=len(self.waiting),
            preemptions=self.counters["num_preempted_total"],
            prefix_cache_hit_rate=self.counters["prefix_cache_hits"] / queries if queries else 0.0,
            spec_accepted_per_position=list(self.spec_accepted_at),
            spec_drafted_per_position=list(self.spec_drafted_at), spec_k=self.spec_k,
            **self.counters)
