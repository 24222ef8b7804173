"""Scheduler: iteration-level (Orca) scheduling of sequences onto a fixed pool of KV pages.

Owns the waiting and running queues and decides, once per step, which tokens are computed: a
StepPlan of chunks (decode chunks first, then prefill chunks), copy-on-write page copies and the
sequences preempted to make room. `update()` applies a step: it decides which sample rows give
tokens (rows of overtaken chunks do not; of a verification chunk, Speculation's verdict), appends
them, finishes the sequences their stop conditions or the output processor's stop strings end,
and releases pages. Host-only, no JAX.

Policies:
- Budget: one decode token per running sequence that finished its prompt, then prefill chunks within
  max_num_batched_tokens and max_num_seqs. With chunked prefill a prompt is split to fit the budget
  (chunks need not be page-aligned); without it a prompt is scheduled whole or not at all (a prompt
  longer than max_num_batched_tokens is rejected; only a preempted sequence recomputing more than
  max_num_batched_tokens tokens is split).
- Context cost (chunked prefill): a prefill chunk's tokens count their context too (StepBudget),
  so a chunk deep into a long prompt is shorter. The first prefill chunk of a step gets a token
  at least.
- Order (LiveRequests): running sequences and admission follow arrival (add_request order) under
  "fcfs", and (request.priority, arrival) under "priority" (lower priority value first).
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
  not reallocated until update() of that plan, which every plan gets (PlansInFlight).
- Planning ahead (async scheduling): schedule_next(plan), called while `plan` is on the device,
  plans the next decode step with the tokens `plan` samples fed in on the device. Only where
  nothing waits and every running sequence decodes; otherwise it returns None.
- Speculative decoding is Speculation's (k, proposals, verdicts, counters): asked for a decode's
  drafts within the budget left after the other decodes, whose chunk then computes and samples
  them all; update() keeps the tokens its verdict keeps and returns the lookahead pages left
  unused. While speculating (k > 0) nothing is planned ahead: the verdict decides positions.
"""

from __future__ import annotations

import time

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_manager import KVManager
from jaxserve.core.limits import RequestRejected, check_request
from jaxserve.core.live_requests import LiveRequests, WaitingQueue
from jaxserve.core.lora import LoRASlots
from jaxserve.core.page_pool import PagePool
from jaxserve.core.plans_in_flight import PlansInFlight
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.sequence import Request, Sequence, SequenceStatus
from jaxserve.core.speculation import NO_DRAFTS, Drafts, Speculation
from jaxserve.core.step_budget import StepBudget
from jaxserve.core.step_plan import ScheduledChunk, StepPlan
from jaxserve.core.step_results import accepted, stop_after


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, *, num_pages: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], model_fingerprint: str,
                 kv_window: int | None = None, speculation: Speculation | None = None,
                 prefill_keys_per_token: int = 0, group_windows: tuple | None = None,
                 lora: LoRASlots | None = None):
        """speculation: speculative decoding's owner (default: none; the engine passes the one
        its Speculator drives). prefill_keys_per_token: resolved (ResolvedConfig); 0: off.
        group_windows: each layer group's window (core/kv_groups.py), replacing kv_window."""
        self.config, self.lora = config, lora
        self.page_size, self.cache_salt = cache.page_size, cache.cache_salt
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = PagePool(num_pages)
        self.cache = (PrefixCache(self.pool, self.page_size, model_fingerprint)
                      if cache.enable_prefix_caching else None)
        # kv_window (ModelConfig.kv_window): pages before every layer's window are released.
        self.kv = KVManager(self.pool, self.page_size, self.cache, group_windows or (kv_window,))
        self.watermark_pages = int(cache.watermark * self.pool.num_usable)
        self.budget = StepBudget(config.max_num_batched_tokens, prefill_keys_per_token
                                 if config.enable_chunked_prefill else 0, kv_window)
        self.live = LiveRequests(config.scheduling_policy)  # and the policy's order
        self.waiting = WaitingQueue(self.live)
        self.running: list[Sequence] = []
        self.in_flight = PlansInFlight(self.kv)
        self.counters = dict(num_preempted_total=0, num_aborted_total=0, num_finished_total=0,
                             num_rejected_total=0, num_failed_total=0, prefix_cache_queries=0,
                             prefix_cache_hits=0, num_steps=0, num_cow_copies=0,
                             num_scheduled_ahead=0)
        self.speculation = speculation if speculation is not None else Speculation(
            None, max_model_len=max_model_len, page_size=self.page_size)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Create sequence 0 and queue it, or raise RequestRejected (nothing queued)."""
        try:
            if request.request_id in self.live:
                raise RequestRejected(f"request_id {request.request_id!r} is already live")
            check_request(request, self.config, self.page_size, max_model_len=self.max_model_len,
                          pages_for=self._pages_to_hold, num_usable_pages=self.pool.num_usable)
        except RequestRejected:
            self.counters["num_rejected_total"] += 1
            raise
        self.waiting.append(self.live.add(request))

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Abort a live request wherever it is, or with `error` fail it; frees everything. False
        if unknown or finished."""
        request = self.live.get(request_id)
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
        return self.live.has_unfinished()

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        plan = StepPlan()
        budget = self.budget
        budget.reset()  # _schedule_chunk spends each chunk's share
        self.running.sort(key=self.live.key)
        anything_running = bool(self.running)
        queue = [s for s in self.running if not self.in_flight.holds(s)]
        decodes_left = sum(self._is_decode_ready(s) for s in queue)
        i = 0
        while i < len(queue):
            seq = queue[i]
            i += 1
            decode = self._is_decode_ready(seq)
            drafts = NO_DRAFTS
            if decode:
                decodes_left -= 1
                drafts = self.speculation.drafts(seq, int(budget.left) - decodes_left - 1)
                n = 1 + drafts.count
            else:
                n = self._chunk_len(seq, seq.num_computed_tokens,
                                    budget.left - decodes_left, plan)
                if n == 0:
                    continue
            while self.kv.pages_needed(seq, n) > self.pool.num_available:
                if drafts.count:  # no pages for the lookahead: decode plainly, not preempt
                    drafts, n = NO_DRAFTS, 1
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
                    self.live.unreported(seq.request)
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
        self.in_flight.launched(plan)
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
        if not plan.chunks or self.speculation.k:
            return None
        if not self.in_flight.is_out(plan):
            raise ValueError("schedule_next plans the step after one still in flight")
        if self.waiting or plan.preempted:
            return None
        if len(plan.chunks) != len(self.running) or \
                any(len(c.sample_seqs) != 1 or c.sample_seqs[0] is not c.seq or c.num_drafts
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
            self.in_flight.hold(seq)
        self._track(nxt)
        self.counters["num_scheduled_ahead"] += 1
        return nxt

    def _admit_one(self, plan: StepPlan, budget_left: float, allow_empty: bool = False) -> bool:
        """Admit the head waiting sequence with its first chunk; False if it does not fit now.
        With allow_empty, a sequence for which no budget is left is admitted without a chunk."""
        seq = self.waiting.head()
        # Seats, not sequences: a running request not yet forked still needs room for its n.
        seats = self.live.seats
        if sum(map(seats, self.running)) + seats(seq) > self.config.max_num_seqs or (
                self.lora and not self.lora.admits(seq.request, self.running)):  # LoRA slots
            return False
        salt = seq.request.cache_salt if seq.request.cache_salt is not None else self.cache_salt
        hit = self.kv.find_prefix(seq, salt)
        hit_tokens = hit.num_pages * self.page_size
        n = self._chunk_len(seq, hit_tokens, budget_left, plan) if budget_left > 0 else 0
        if n == 0 and not allow_empty:
            return False
        # A static batch reserves room for each member's whole prompt before admitting more.
        need, available = self.kv.admission_pages(hit, seq.num_tokens if allow_empty
                                                  else hit_tokens + n)
        alone = not self.running
        if need > available - (0 if alone else self.watermark_pages):
            if alone and self.pool.num_pending == 0 \
                    and self._pages_to_hold(seq.num_tokens) > self.pool.num_usable:
                self.waiting.remove(seq)  # a recomputation that can never fit again
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                self.live.unreported(seq.request)
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

    def _schedule_chunk(self, seq: Sequence, n: int, plan: StepPlan,
                        drafts: Drafts = NO_DRAFTS) -> None:
        start = seq.num_computed_tokens
        self.kv.prepare_write(seq, n, plan.copies)  # drafts included: lookahead slots
        chunk = ScheduledChunk(seq=seq, start=start, num_tokens=n, num_drafts=drafts.count,
                               draft_token_ids=list(drafts.token_ids))
        self.in_flight.hold(seq)
        if drafts.count:
            chunk.sample_seqs.append(seq)
            self.speculation.scheduled(chunk)
        elif start + n == seq.num_tokens:
            chunk.sample_seqs.append(seq)
            request = seq.request
            if (seq.fork_index == 0 and seq.num_tokens == seq.num_prompt_tokens
                    and len(request.sequences) < request.sampling_params.n):
                for k in range(len(request.sequences), request.sampling_params.n):
                    child = self.live.fork(seq, k)
                    self.kv.fork(seq, child)
                    self.running.append(child)
                    self.in_flight.hold(child)
                    chunk.sample_seqs.append(child)
        plan.chunks.append(chunk)
        # Decode and verification chunks count a token each; a prefill chunk its context too.
        self.budget.spend(start, n, prefill=not (chunk.is_decode or chunk.num_drafts))

    # ---- applying a step -----------------------------------------------------------------------
    def accepted_rows(self, plan: StepPlan,
                      sampled_token_ids: list[int] | None = None) -> list[tuple[int, Sequence]]:
        """(row, sequence) of the sample rows whose tokens update(plan) will append, in order
        (step_results.accepted; a verification's need the sampled tokens). Changes nothing."""
        return [(a.row, a.seq) for a in accepted(plan, sampled_token_ids, self.speculation,
                                                  self.eos_token_ids)]

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
        self.in_flight.applying(plan)
        # Before the chunks below advance their sequences.
        rows = accepted(plan, sampled_token_ids, self.speculation, self.eos_token_ids)
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == chunk.start \
                    and not chunk.num_drafts:  # a verification's computed tokens: below
                seq.num_computed_tokens += chunk.num_tokens
                self.kv.register_full_pages(seq)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for a in rows:  # others were overtaken: their tokens dropped
            seq = a.seq
            if seq.is_finished:  # a token before it in the same verification chunk ended it
                continue
            token = int(sampled_token_ids[a.row])
            seq.num_computed_tokens = a.chunk.start + a.offset + 1  # KV up to this row's input
            self.kv.register_full_pages(seq)
            seq.token_ids.append(token)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request.request_id] = request
            stop = stop_after(seq, token, self.eos_token_ids, self.max_model_len,
                              stop_strings.get(a.row))
            if stop is not None and stop.error is not None:
                request.error = stop.error
            if stop is not None:
                self._finish(seq, stop.status, stop.reason)
        verified = [a.chunk for a in rows if a.chunk.num_drafts]  # a chunk per row applied
        for seq in self.speculation.settle(verified):  # lookahead pages left wholly unused
            self.kv.trim(seq, seq.num_tokens)
        for request in self.live.take_unreported():
            touched.setdefault(request.request_id, request)
        self.in_flight.applied()
        return list(touched.values())

    # ---- state changes -------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason=None) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        seq.stop_reason = stop_reason
        request = seq.request
        if request.is_finished and self.live.remove(request):
            request.finished_time = time.monotonic()
            self.counters["num_finished_total"] += 1

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.push_front(seq)
        plan.preempted.append(seq)
        self.counters["num_preempted_total"] += 1
        self.speculation.forget(seq)

    # ---- helpers ---------------------------------------------------------------------------------
    def _pages_to_hold(self, num_tokens: int) -> int:
        return self.kv.pages_to_hold(num_tokens, self.config.max_num_batched_tokens)

    @staticmethod
    def _is_decode_ready(seq: Sequence) -> bool:
        return (seq.num_tokens - seq.num_computed_tokens == 1
                and seq.num_computed_tokens >= seq.num_prompt_tokens)

    def _chunk_len(self, seq: Sequence, start: int, budget_left: float, plan: StepPlan) -> int:
        """Tokens of seq's prefill chunk from `start` within budget_left (context cost counted);
        a token at least when the plan has no prefill chunk yet and any budget is left."""
        remaining = seq.num_tokens - start
        fits = self.budget.tokens_within(start, budget_left)
        if fits == 0 and budget_left >= 1 and all(c.is_decode or c.num_drafts
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
        return max(0, min(n, self.kv.tokens_fitting(seq) - start))

    # ---- introspection ------------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.live.sequences()

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
            **self.kv.page_stats(self.live_sequences()), running=len(self.running),
            waiting=len(self.waiting),
            preemptions=self.counters["num_preempted_total"],
            prefix_cache_hit_rate=self.counters["prefix_cache_hits"] / queries if queries else 0.0,
            **self.speculation.stats(), **self.counters)
