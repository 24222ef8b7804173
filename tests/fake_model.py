"""A fake model with hand-computable outputs, to check KV bookkeeping end to end without JAX.

The "KV pool" is a dict slot -> token id. For each chunk the runner writes the chunk's token ids at
slot page_ids[pos // B] * B + pos % B (after applying the plan's copy-on-write copies), and to sample
it "attends" by reading tokens 0..pos back through the page table:

    next_token(context) = (sum_i (i + 1) * (context[i] + 1) + 17 * fork_index * [first output]) % V

so a wrong page table, a missed copy, a bad prefix hit or a lost page changes the output (a page
never written raises KeyError). `reference_outputs` computes the same from the true token list.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Request, SequenceStatus
from jaxserve.core.step_plan import StepPlan

V = 1009


def next_token(context: list[int], num_prompt_tokens: int, fork_index: int) -> int:
    h = sum((i + 1) * (t + 1) for i, t in enumerate(context))
    if len(context) == num_prompt_tokens:  # first output token: forks diverge here
        h += 17 * fork_index
    return h % V


def reference_outputs(prompt: list[int], params: SamplingParams, *, eos: tuple[int, ...] = (),
                      max_model_len: int = 10**9) -> list[list[int]]:
    """Each fork's output tokens computed from its own true token list, alone."""
    outs = []
    for k in range(params.n):
        tokens = list(prompt)
        while True:
            t = next_token(tokens, len(prompt), k)
            tokens.append(t)
            n_out = len(tokens) - len(prompt)
            if (not params.ignore_eos and t in eos) or t in params.stop_token_ids:
                break
            if params.max_tokens is not None and n_out >= params.max_tokens:
                break
            if len(tokens) >= max_model_len:
                break
        outs.append(tokens[len(prompt):])
    return outs


class FakeRunner:
    """Executes plans against a dict KV pool, checking ownership rules as it goes."""

    def __init__(self, scheduler: Scheduler, *, strict: bool = True):
        self.sched = scheduler
        self.page_size = scheduler.page_size
        self.slots: dict[int, int] = {}
        self.strict = strict

    def run(self, plan: StepPlan, feed: list[int] | None = None) -> list[int]:
        """`feed`: what the previous plan sampled, for chunks planned before it was applied
        (feed_row >= 0: the token at position `start` is feed[feed_row], not yet on the host)."""
        b, sched = self.page_size, self.sched
        kinds = [c.is_decode for c in plan.chunks]
        assert kinds == sorted(kinds, reverse=True), "decode chunks must come first"
        assert len(plan.chunks) <= sched.config.max_num_seqs
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len({c.seq.seq_id for c in plan.chunks}) == len(plan.chunks)
        for src, dst in plan.copies:
            assert src != 0 and dst != 0 and src != dst
            for o in range(b):
                if src * b + o in self.slots:
                    self.slots[dst * b + o] = self.slots[src * b + o]
                else:
                    self.slots.pop(dst * b + o, None)
        live = sched.live_sequences()
        for chunk in plan.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            if chunk.feed_row >= 0:  # planned ahead: one token, the one the previous plan samples
                assert chunk.num_tokens == 1 and start == seq.num_tokens and feed is not None
            elif chunk.num_drafts:  # the last token, then drafts past the sequence's end
                assert start == seq.num_computed_tokens == seq.num_tokens - 1
                assert chunk.num_tokens == 1 + chunk.num_drafts == 1 + len(chunk.draft_token_ids)
            else:
                assert start == seq.num_computed_tokens and 0 < chunk.num_tokens and end <= seq.num_tokens
            assert len(seq.page_ids) >= -(-end // b), "page table too short for the chunk"
            allowed = {id(seq)} | {id(s) for s in chunk.sample_seqs}
            for idx in range(start // b, -(-end // b)):
                page = seq.page_ids[idx]
                assert page != 0, "page 0 handed out"
                holders = {id(s) for s in live if page in s.page_ids}
                assert holders <= allowed, f"write into page {page} shared with another sequence"
                if sched.cache is not None:
                    assert not sched.cache.is_cached(page), f"write into cached page {page}"
            tokens = [feed[chunk.feed_row]] if chunk.feed_row >= 0 else chunk.input_token_ids
            for pos, token in zip(range(start, end), tokens):
                self.slots[seq.page_ids[pos // b] * b + pos % b] = token
        out = []
        for chunk in plan.chunks:
            for offset, s in chunk.sample_rows:
                seq, end = chunk.seq, chunk.start + offset + 1
                assert s.page_ids == seq.page_ids
                ctx = [self.slots[seq.page_ids[p // b] * b + p % b] for p in range(end)]
                if self.strict:
                    known = seq.token_ids[:chunk.start] + chunk.input_token_ids[:offset + 1] \
                        if chunk.feed_row < 0 else seq.token_ids[:end - 1] + [feed[chunk.feed_row]]
                    assert ctx == known, f"seq {seq.seq_id} reads wrong KV"
                out.append(next_token(ctx, seq.num_prompt_tokens, s.fork_index))
        return out


@dataclasses.dataclass
class RunResult:
    outputs: dict[str, list[list[int]]]
    finish_reasons: dict[str, list[str | None]]
    plans: list[StepPlan]
    steps: int
    preemptions: int


def make_request(rid: str, prompt: list[int], *, max_tokens: int = 8, n: int = 1, priority: int = 0,
                 cache_salt: str | None = None, **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, **params),
                   priority=priority, cache_salt=cache_salt)


def run_to_completion(scheduler: Scheduler, requests, *, abort_at: dict[int, list[str]] | None = None,
                      runner: FakeRunner | None = None, max_steps: int = 100_000,
                      check: bool = True, keep_plans: bool = False,
                      ahead: bool = False) -> RunResult:
    """Drive schedule -> fake run -> update until everything finishes.

    requests: Requests (all added before step 0) or (arrival_step, Request) pairs.
    abort_at: step -> request ids aborted while that step's plan is in flight (after schedule(),
    before update()). Checks invariants after every operation and that nothing leaks at the end.
    ahead: as the engine's async scheduling, plan (schedule_next) and run the next step before
    applying this one's tokens, wherever the scheduler can."""
    runner = runner or FakeRunner(scheduler)
    arrivals: dict[int, list[Request]] = {}
    all_requests = []
    for item in requests:
        step, req = item if isinstance(item, tuple) else (0, item)
        arrivals.setdefault(step, []).append(req)
        all_requests.append(req)
    abort_at = abort_at or {}
    plans, step = [], 0
    reported = set()  # requests update() returned finished
    ahead_plan = None  # (plan, sampled) run ahead, applied in the next iteration
    last_event = max(list(arrivals) + list(abort_at) + [0])
    while step <= last_event or scheduler.has_unfinished() or ahead_plan is not None:
        assert step < max_steps, "scheduler made no progress (hang)"
        for req in arrivals.get(step, []):
            scheduler.add_request(req)
        if ahead_plan is None:
            plan = scheduler.schedule()
            sampled = runner.run(plan)
        else:
            plan, sampled = ahead_plan
        ahead_plan = None
        nxt = scheduler.schedule_next(plan) if ahead else None
        if nxt is not None:
            ahead_plan = (nxt, runner.run(nxt, feed=sampled))
        if check:
            scheduler.check_invariants()
        for rid in abort_at.get(step, []):
            scheduler.abort(rid)
            if check:
                scheduler.check_invariants()
        returned = scheduler.update(plan, sampled)
        assert len({id(r) for r in returned}) == len(returned), "a request returned twice"
        reported.update(r.request_id for r in returned if r.is_finished)
        if check:
            scheduler.check_invariants()
        if keep_plans:
            plans.append(plan)
        step += 1
    st = scheduler.stats()
    assert st["referenced_pages"] == 0 and st["running"] == 0 and st["waiting"] == 0
    assert st["free_pages"] + st["cached_pages"] == st["total_pages"]
    scheduler.check_invariants()
    for r in all_requests:  # aborts are the caller's to report; every other finish is update()'s
        assert r.request_id in reported or any(
            s.status is SequenceStatus.FINISHED_ABORTED for s in r.sequences), \
            f"{r.request_id} finished unreported"
    return RunResult(
        outputs={r.request_id: [s.output_token_ids for s in r.sequences] for r in all_requests},
        finish_reasons={r.request_id: [s.status.finish_reason for s in r.sequences] for r in all_requests},
        plans=plans, steps=step, preemptions=st["num_preempted_total"])


# ---- helpers for scheduler tests ------------------------------------------------------------

def make_sched(num_pages=64, max_model_len=256, eos=(), speculation=None, **cfg):
    cfg.setdefault("page_size", 4)
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 32)
    cfg.setdefault("watermark", 0.0)
    config = EngineConfig.from_options(**cfg)
    return Scheduler(config.scheduler, config.cache, num_pages=num_pages,
                     max_model_len=max_model_len, eos_token_ids=tuple(eos),
                     model_fingerprint="fake-model", speculation=speculation,
                     prefill_keys_per_token=config.scheduler.prefill_keys_per_token or 0)


def expected(requests, **kw):
    return {r.request_id: reference_outputs(r.prompt_token_ids, r.sampling_params, **kw)
            for r in requests}


def chunk_shape(plan):
    return [(c.seq.request.request_id, c.seq.fork_index, c.start, c.num_tokens) for c in plan.chunks]


def random_workload(rng, cfg: dict, max_requests: int) -> tuple[list, dict]:
    """A random scenario's (arrival step, request) pairs, prompts over a 3-token vocabulary (so
    prefixes repeat), and its aborts {step: [request ids]}, for scheduler options `cfg`."""
    reqs, aborts = [], {}
    for i in range(rng.randint(1, max_requests)):
        hi = cfg["max_num_batched_tokens"] if not cfg["enable_chunked_prefill"] else 40
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, min(hi, 40)))]
        r = make_request(f"r{i}", prompt, max_tokens=rng.choice([None, rng.randint(1, 30)]),
                         n=rng.randint(1, min(3, cfg["max_num_seqs"])), priority=rng.randint(0, 2))
        reqs.append((rng.randint(0, 20), r))
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 40), []).append(r.request_id)
    return reqs, aborts


def assert_outputs_match_reference(res: RunResult, reqs, scheduler: Scheduler) -> None:
    """Every request not aborted produced its reference outputs."""
    for _, r in reqs:
        if any(s.status is SequenceStatus.FINISHED_ABORTED for s in r.sequences):
            continue
        want = reference_outputs(r.prompt_token_ids, r.sampling_params,
                                 eos=tuple(scheduler.eos_token_ids),
                                 max_model_len=scheduler.max_model_len)
        assert res.outputs[r.request_id] == want
