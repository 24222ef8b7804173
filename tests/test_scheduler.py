"""Scheduler: decisions checked by hand, and end-to-end KV bookkeeping through the fake model."""

import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from fake_model import (FakeRunner, V, assert_outputs_match_reference, chunk_shape, expected,
                        make_request, make_sched, random_workload, reference_outputs,
                        run_to_completion)
from jaxserve.core.scheduler import RequestRejected
from jaxserve.core.sequence import SequenceStatus


def random_prompt(rng, lo=1, hi=30, vocab=V):
    return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]


def clone(requests):
    return [make_request(r.request_id, r.prompt_token_ids, max_tokens=r.sampling_params.max_tokens,
                         n=r.sampling_params.n, priority=r.priority, cache_salt=r.cache_salt)
            for r in requests]


def step(sched, runner):
    plan = sched.schedule()
    sched.update(plan, runner.run(plan))
    return plan


# ---- end to end through the fake model -------------------------------------------------------------

def test_fake_model_detects_a_wrong_page_table():
    sched = make_sched()
    runner = FakeRunner(sched, strict=False)
    sched.add_request(make_request("a", list(range(10)), max_tokens=3))
    step(sched, runner)
    seq = sched.running[0]
    plan = sched.schedule()
    good = runner.run(plan)
    seq.page_ids[0], seq.page_ids[1] = seq.page_ids[1], seq.page_ids[0]
    assert runner.run(plan) != good


def test_batched_equals_one_at_a_time_equals_reference():
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", random_prompt(rng), max_tokens=rng.randint(1, 12)) for i in range(12)]
    batched = run_to_completion(make_sched(), clone(reqs)).outputs
    for r in clone(reqs):
        assert run_to_completion(make_sched(), [r]).outputs[r.request_id] == batched[r.request_id]
    assert batched == expected(reqs)


def test_prefix_cache_hits_mid_page_on_boundary_and_fully_cached():
    rng = random.Random(1)
    p = [rng.randrange(V) for _ in range(12)]  # 3 full pages of 4
    first = make_request("p", p, max_tokens=8)
    later = [
        make_request("mid", p[:10] + [1, 2]),  # shares 10 tokens: 2 full pages
        make_request("edge", p[:8] + [3, 4, 5]),  # shares exactly 2 pages
        make_request("full", list(p)),  # fully cached: recomputes its last page
        make_request("longer", p + [7]),  # all 3 prompt pages hit
    ]
    sched = make_sched()
    runner = FakeRunner(sched)  # one KV pool across both runs
    run_to_completion(sched, [first], runner=runner)
    out = run_to_completion(sched, later, runner=runner).outputs
    hits = {r.request_id: r.sequences[0].num_cached_tokens for r in later}
    assert hits == {"mid": 8, "edge": 8, "full": 8, "longer": 12}
    assert sched.stats()["prefix_cache_hits"] == 36
    assert sched.stats()["prefix_cache_queries"] == 12 + 12 + 11 + 12 + 13
    off = make_sched(enable_prefix_caching=False)
    runner = FakeRunner(off)
    run_to_completion(off, clone([first]), runner=runner)
    assert run_to_completion(off, clone(later), runner=runner).outputs == out == expected(later)
    assert off.stats()["prefix_cache_hits"] == 0


def test_chunked_prefill_with_chunks_not_page_aligned():
    rng = random.Random(2)
    reqs = [make_request(f"r{i}", random_prompt(rng, 15, 40), max_tokens=5) for i in range(6)]
    sched = make_sched(max_num_batched_tokens=7, max_num_seqs=3, page_size=4)
    res = run_to_completion(sched, reqs, keep_plans=True)
    assert res.outputs == expected(reqs)
    starts = {c.start % 4 for plan in res.plans for c in plan.chunks if not c.is_decode}
    assert starts - {0}, "chunks should start mid-page"
    assert all(plan.num_tokens <= 7 for plan in res.plans)


def test_forced_preemption_matches_ample_pool():
    rng = random.Random(3)
    reqs = [make_request(f"r{i}", random_prompt(rng, 1, 12), max_tokens=rng.randint(5, 20),
                         n=rng.choice([1, 1, 2])) for i in range(16)]
    ample = run_to_completion(make_sched(num_pages=200), clone(reqs))
    tight_sched = make_sched(num_pages=9, page_size=4)  # 8 usable pages, 32 slots
    tight = run_to_completion(tight_sched, clone(reqs))
    assert ample.preemptions == 0 and tight.preemptions >= 10
    assert tight.outputs == ample.outputs == expected(reqs)


def test_isolation_same_prefix_different_continuations_interleaved():
    rng = random.Random(4)
    prefix = [rng.randrange(V) for _ in range(10)]
    a = make_request("a", prefix + [1, 2, 3], max_tokens=10)
    b = make_request("b", prefix + [4, 5], max_tokens=10)
    c = make_request("c", prefix, max_tokens=10)
    sched = make_sched(max_num_batched_tokens=8)
    together = run_to_completion(sched, [(0, a), (2, b), (3, c)]).outputs
    assert sched.stats()["prefix_cache_hits"] > 0
    for r in clone([a, b, c]):
        assert run_to_completion(make_sched(), [r]).outputs[r.request_id] == together[r.request_id]


def test_different_cache_salt_never_hits():
    p = list(range(20))
    sched = make_sched(cache_salt="global")
    runner = FakeRunner(sched)
    run_to_completion(sched, [make_request("a", p, cache_salt="t1")], runner=runner)
    run_to_completion(sched, [make_request("b", p, cache_salt="t2"), make_request("c", p)], runner=runner)
    assert sched.stats()["prefix_cache_hits"] == 0
    run_to_completion(sched, [make_request("d", p, cache_salt="t1")], runner=runner)
    assert sched.stats()["prefix_cache_hits"] == 16


@pytest.mark.parametrize("num_pages", [200, 10])
def test_forks_never_see_each_others_writes(num_pages):
    rng = random.Random(5)
    reqs = [make_request(f"r{i}", random_prompt(rng, 1, 14), max_tokens=rng.randint(2, 12), n=n)
            for i, n in enumerate([2, 3, 4, 1, 3])]
    sched = make_sched(num_pages=num_pages, max_num_batched_tokens=9)
    res = run_to_completion(sched, reqs)
    assert res.outputs == expected(reqs)  # each fork equals that fork's tokens run alone
    assert all(len(set(map(tuple, outs))) == len(outs) for outs in res.outputs.values())
    assert sched.stats()["num_cow_copies"] > 0
    for r in reqs:
        assert [s.fork_index for s in r.sequences] == list(range(r.sampling_params.n))


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("num_pages,page_size,n,prompt_len,max_tokens",
                         [(24, 8, 2, 69, 110), (8, 4, 4, 11, 17)])
def test_forks_that_fit_the_pool_one_at_a_time_complete(num_pages, page_size, n, prompt_len,
                                                        max_tokens, ahead):
    """One sequence's prompt + max_tokens - 1 tokens fill the pool; its n forks take turns."""
    rng = random.Random(7)
    reqs = [make_request("forks", [rng.randrange(V) for _ in range(prompt_len)],
                         max_tokens=max_tokens, n=n),
            make_request("other", [1, 2, 3], max_tokens=5)]
    # One fork fits the pool; the forks' private tails alone do not.
    fork_pages = -(-(prompt_len + max_tokens - 1) // page_size)
    assert fork_pages <= num_pages - 1 < n * (max_tokens // page_size)
    sched = make_sched(num_pages=num_pages, page_size=page_size, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=1024)
    res = run_to_completion(sched, reqs, ahead=ahead)
    assert res.outputs == expected(reqs) and res.preemptions > 0
    assert res.finish_reasons == {"forks": ["length"] * n, "other": ["length"]}


def test_cancellation_storm_leaves_nothing_referenced():
    rng = random.Random(6)
    reqs, aborts = [], {}
    for i in range(300):
        r = make_request(f"r{i}", random_prompt(rng, 1, 20, vocab=4), max_tokens=rng.randint(1, 15),
                         n=rng.choice([1, 1, 1, 2]))
        arrival = rng.randint(0, 150)
        reqs.append((arrival, r))
        if rng.random() < 0.4:
            aborts.setdefault(arrival + rng.randint(0, 12), []).append(r.request_id)
    sched = make_sched(num_pages=24, max_num_seqs=12, max_num_batched_tokens=24)
    res = run_to_completion(sched, reqs, abort_at=aborts)
    survivors = [r for _, r in reqs if all(s.status is not SequenceStatus.FINISHED_ABORTED
                                           for s in r.sequences)]
    assert 50 < len(survivors) < 300 and sched.stats()["num_aborted_total"] > 50
    for r in survivors:
        assert res.outputs[r.request_id] == reference_outputs(r.prompt_token_ids, r.sampling_params)
    assert sched.stats()["referenced_pages"] == 0 and sched.stats()["num_preempted_total"] > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_scenarios_match_reference(seed):
    _random_scenario(seed, ahead=False)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_scenarios_planned_ahead_match_reference(seed):
    """As the engine's async scheduling: the next step planned and run before this one's
    tokens are applied, wherever schedule_next can."""
    _random_scenario(seed, ahead=True)


def _random_scenario(seed, ahead):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4, 8])
    max_len = 64
    cfg = dict(page_size=page_size, max_num_seqs=rng.randint(1, 6),
               enable_prefix_caching=rng.random() < 0.7, enable_chunked_prefill=rng.random() < 0.7,
               scheduling=rng.choice(["iteration", "iteration", "static"]),
               scheduling_policy=rng.choice(["fcfs", "priority"]), watermark=rng.choice([0.0, 0.1]))
    cfg["max_num_batched_tokens"] = rng.randint(max(cfg["max_num_seqs"], 5), 40)
    min_pages = -(-(max_len - 1) // page_size) + 1  # any single sequence fits
    sched = make_sched(num_pages=rng.randint(min_pages + 1, min_pages * 3), max_model_len=max_len,
                       eos=(rng.randrange(V),), **cfg)
    reqs, aborts = random_workload(rng, cfg, max_requests=25)
    res = run_to_completion(sched, reqs, abort_at=aborts, ahead=ahead)
    assert_outputs_match_reference(res, reqs, sched)


def test_stop_conditions():
    p = [5, 6, 7]
    ref = reference_outputs(p, make_request("x", p, max_tokens=10).sampling_params)[0]
    sched = make_sched(eos=(ref[3],), max_model_len=9)
    eos = make_request("eos", p, max_tokens=10)
    ignore = make_request("ignore", p, max_tokens=10, ignore_eos=True)
    stop = make_request("stop", p, max_tokens=10, stop_token_ids=[ref[1]], ignore_eos=True)
    short = make_request("short", p, max_tokens=2)
    res = run_to_completion(sched, [eos, ignore, stop, short])
    assert res.outputs["eos"] == [ref[:4]] and eos.sequences[0].stop_reason is None
    assert res.outputs["ignore"] == [ref[:6]] and res.finish_reasons["ignore"] == ["length"]  # 3 + 6 = 9
    assert res.outputs["stop"] == [ref[:2]] and stop.sequences[0].stop_reason == ref[1]
    assert res.finish_reasons["stop"] == ["stop"] and res.finish_reasons["short"] == ["length"]
    for r in (eos, ignore, stop, short):
        assert r.first_scheduled_time <= r.first_token_time <= r.finished_time


# ---- scheduling decisions by hand -----------------------------------------------------------------------

def test_chunk_sizes_under_budget():
    sched = make_sched(max_num_batched_tokens=10)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", list(range(6)), max_tokens=3))
    sched.add_request(make_request("b", list(range(9)), max_tokens=3))
    assert chunk_shape(step(sched, runner)) == [("a", 0, 0, 6), ("b", 0, 0, 4)]
    assert chunk_shape(step(sched, runner)) == [("a", 0, 6, 1), ("b", 0, 4, 5)]
    assert chunk_shape(step(sched, runner)) == [("a", 0, 7, 1), ("b", 0, 9, 1)]


def test_without_chunked_prefill_prompts_are_whole_or_wait():
    sched = make_sched(max_num_batched_tokens=10, enable_chunked_prefill=False)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", list(range(6)), max_tokens=3))
    sched.add_request(make_request("b", list(range(10, 19)), max_tokens=3))
    assert chunk_shape(step(sched, runner)) == [("a", 0, 0, 6)]
    assert chunk_shape(step(sched, runner)) == [("a", 0, 6, 1), ("b", 0, 0, 9)]


def test_decodes_first_and_reserved_budget_under_priority():
    sched = make_sched(max_num_batched_tokens=8, scheduling_policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_request("low", [1, 2, 3], max_tokens=20, priority=1))
    assert chunk_shape(step(sched, runner)) == [("low", 0, 0, 3)]
    sched.add_request(make_request("high", list(range(40)), max_tokens=2, priority=0))
    assert chunk_shape(step(sched, runner)) == [("low", 0, 3, 1), ("high", 0, 0, 7)]
    # "high" now runs first in order but is mid-prefill: "low"'s decode keeps its token and goes first
    assert chunk_shape(step(sched, runner)) == [("low", 0, 4, 1), ("high", 0, 7, 7)]


@pytest.mark.parametrize("policy,victim", [("fcfs", "c"), ("priority", "a")])
def test_victim_is_most_recent_or_lowest_priority(policy, victim):
    sched = make_sched(num_pages=7, page_size=2, scheduling_policy=policy)  # 6 usable pages
    runner = FakeRunner(sched)
    reqs = [make_request(rid, [1, 2, 3], max_tokens=6, priority=prio)
            for rid, prio in (("a", 2), ("b", 1), ("c", 0))]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)  # 3 prompts of 3 tokens: 2 pages each, pool full
    step(sched, runner)  # decode writes slot 3, still in page 2
    plan = sched.schedule()  # slot 4 needs a third page each
    assert [s.request.request_id for s in plan.preempted] == [victim]
    head = sched.waiting.head()
    assert head.request.request_id == victim
    assert head.num_computed_tokens == 0 and not head.page_ids
    sched.update(plan, runner.run(plan))
    run_to_completion(sched, [], runner=runner)
    assert {r.request_id: [s.output_token_ids for s in r.sequences] for r in reqs} == expected(reqs)


def test_priority_orders_admission():
    sched = make_sched(max_num_seqs=1, scheduling_policy="priority")
    reqs = [make_request(f"p{prio}", [prio, 1], max_tokens=2, priority=prio) for prio in (2, 0, 1)]
    res = run_to_completion(sched, reqs, keep_plans=True)
    firsts = []
    for plan in res.plans:
        for c in plan.chunks:
            if c.start == 0:
                firsts.append(c.seq.request.request_id)
    assert firsts == ["p0", "p1", "p2"]


@pytest.mark.parametrize("scheduling", ["static", "iteration"])
def test_static_scheduling_waits_for_the_batch_to_drain(scheduling):
    sched = make_sched(scheduling=scheduling)
    a = make_request("a", [1, 2, 3], max_tokens=5)
    b = make_request("b", [4, 5], max_tokens=2)
    res = run_to_completion(sched, [(0, a), (1, b)], keep_plans=True)
    first_b = next(i for i, p in enumerate(res.plans) if any(c.seq.request is b for c in p.chunks))
    last_a = max(i for i, p in enumerate(res.plans) if any(c.seq.request is a for c in p.chunks))
    if scheduling == "static":
        assert first_b == last_a + 1
    else:
        assert first_b == 1
    assert res.outputs == expected([a, b])


def test_rejections_raise_at_once_with_reasons():
    sched = make_sched(num_pages=11, max_model_len=100, max_num_seqs=4)  # 10 pages of 4 = 40 slots
    with pytest.raises(RequestRejected, match=r"prompt of 100 tokens \+ 1 exceeds max_model_len 100"):
        sched.add_request(make_request("long", [1] * 100))
    with pytest.raises(RequestRejected, match="needs 11 pages but the KV pool has 10"):
        sched.add_request(make_request("big", [1] * 41))
    with pytest.raises(RequestRejected, match="empty prompt"):
        sched.add_request(make_request("empty", []))
    with pytest.raises(RequestRejected, match="n=5"):
        sched.add_request(make_request("many", [1], n=5))
    # One sequence's prompt + max_tokens - 1 tokens of KV must fit; n does not multiply it.
    with pytest.raises(RequestRejected, match="max_tokens 12 needs 11 pages of 4 tokens per "
                                              "sequence but the KV pool has 10"):
        sched.add_request(make_request("output", [1] * 30, max_tokens=12, n=2))
    sched.add_request(make_request("ok", [1] * 39, max_tokens=2, n=4))  # 39 + 1 fits exactly
    with pytest.raises(RequestRejected, match="already live"):
        sched.add_request(make_request("ok", [1]))
    nochunk = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(RequestRejected, match="chunked prefill is disabled"):
        nochunk.add_request(make_request("x", [1] * 17))
    assert sched.stats()["num_rejected_total"] == 6 and sched.stats()["waiting"] == 1


@pytest.mark.parametrize("n", [1, 3])
def test_a_sequence_that_outgrows_the_pool_finishes_with_length(n):
    """max_tokens=None (up to the context length): the pool is its context, forks included."""
    sched = make_sched(num_pages=4, page_size=2)  # 3 pages = 6 slots
    r = make_request("r", [1, 2, 3, 4], max_tokens=None, n=n)
    res = run_to_completion(sched, [r])
    assert res.finish_reasons["r"] == ["length"] * n
    # 6 slots hold the KV of 4 prompt and 2 output tokens: 3 tokens out, as in a context of 7
    assert res.outputs["r"] == expected([r], max_model_len=7)["r"]


def test_abort_everywhere_frees_everything():
    sched = make_sched(num_pages=9, max_num_batched_tokens=8, max_num_seqs=3)
    runner = FakeRunner(sched)
    reqs = {rid: make_request(rid, list(range(n)), max_tokens=12)
            for rid, n in (("run", 3), ("pre", 20), ("wait", 5), ("fork", 2))}
    for r in reqs.values():
        sched.add_request(r)
    step(sched, runner)
    assert reqs["pre"].sequences[0].num_computed_tokens == 5  # mid-prefill
    assert sched.abort("pre") and not sched.abort("pre") and not sched.abort("nope")
    plan = sched.schedule()
    sampled = runner.run(plan)
    sched.abort("run")  # in flight: its pages wait for update()
    assert sched.stats()["pending_free_pages"] > 0
    sched.check_invariants()
    returned = sched.update(plan, sampled)
    assert reqs["run"] not in returned and sched.stats()["pending_free_pages"] == 0
    assert reqs["run"].sequences[0].status is SequenceStatus.FINISHED_ABORTED
    assert reqs["run"].finished_time is not None
    run_to_completion(sched, [], runner=runner, abort_at={2: ["wait", "fork"]})
    assert not sched.has_unfinished()
    assert sched.stats()["num_aborted_total"] == 4 and sched.stats()["referenced_pages"] == 0


def test_stop_strings_given_to_update_finish_and_free_pages():
    sched = make_sched()
    r = make_request("r", list(range(9)), max_tokens=30)
    sched.add_request(r)
    plan = sched.schedule()
    assert sched.accepted_rows(plan) == [(0, r.sequences[0])]
    sched.update(plan, [5], {0: "</s>"})  # row 0 completed the stop string
    assert r.is_finished and not sched.has_unfinished() and sched.stats()["referenced_pages"] == 0
    assert r.sequences[0].stop_reason == "</s>"
    assert r.sequences[0].status is SequenceStatus.FINISHED_STOPPED
    assert r.sequences[0].output_token_ids == [5]


def test_watermark_holds_back_admission_but_not_when_idle():
    sched = make_sched(num_pages=11, page_size=4, watermark=0.2)  # 10 usable, watermark 2 pages
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", list(range(30)), max_tokens=11))  # 8 pages: admitted alone
    assert chunk_shape(step(sched, runner)) == [("a", 0, 0, 30)]
    sched.add_request(make_request("b", list(range(100, 104)), max_tokens=2))  # 1 page, 2 free
    plan = step(sched, runner)
    assert chunk_shape(plan) == [("a", 0, 30, 1)] and sched.stats()["waiting"] == 1
    run_to_completion(sched, [], runner=runner)


def test_static_batch_forms_beyond_one_steps_budget_then_drains():
    """Static batching admits a whole batch (up to max_num_seqs) even when the prompts take
    several steps of token budget to prefill; later arrivals wait for the batch to drain."""
    sched = make_sched(scheduling="static", max_num_seqs=3, max_num_batched_tokens=8)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=3) for i in range(5)]
    res = run_to_completion(sched, [(0, r) for r in reqs], keep_plans=True)
    batches = []
    for plan in res.plans:
        ids = {c.seq.request.request_id for c in plan.chunks}
        if not batches or not ids <= batches[-1] and ids & batches[-1] == set():
            batches.append(set(ids))
        else:
            batches[-1] |= ids
    assert batches == [{"r0", "r1", "r2"}, {"r3", "r4"}]
    assert res.outputs == expected(reqs)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_queue_order_front_and_removal(policy):
    from jaxserve.core.live_requests import LiveRequests, WaitingQueue

    live = LiveRequests(policy)
    queue = WaitingQueue(live)
    seqs = [live.add(make_request(f"r{i}", [1], priority=prio))
            for i, prio in enumerate((2, 0, 1, 0))]
    for seq in seqs:
        queue.append(seq)
    rid = lambda: queue.head().request.request_id  # noqa: E731
    assert rid() == ("r0" if policy == "fcfs" else "r1")
    queue.remove(seqs[1])
    queue.remove(seqs[1])  # a second remove does nothing
    assert rid() == ("r0" if policy == "fcfs" else "r3") and len(queue) == 3
    queue.remove(seqs[0])
    queue.push_front(seqs[1])  # preempted: back at the front (its key under "priority")
    assert rid() == "r1" and seqs[1] in queue and seqs[0] not in queue
    assert [s.request.request_id for s in queue] == ["r1", "r2", "r3"]


def test_aborting_many_waiting_requests_in_any_order_is_linear():
    """Issue 54 row 1: a group's abort comes in set order; each abort searched a list of the
    waiting sequences, so 40 000 took 26 s (700 000: hours). The count printed, not timed."""
    sched = make_sched(max_num_seqs=4)
    n = 30_000
    for i in range(n):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=1))
    step(sched, FakeRunner(sched))  # four prefilled and finished (max_tokens=1)
    assert len(sched.waiting) == n - 4
    t0 = time.perf_counter()
    aborted = sum(sched.abort(f"r{i}") for i in reversed(range(n)))
    print(f"aborted {aborted} requests in {time.perf_counter() - t0:.2f} s")
    assert aborted == n - 4 == sched.counters["num_aborted_total"]
    assert len(sched.waiting) == 0 and not sched.running and not sched.has_unfinished()
    sched.check_invariants()
