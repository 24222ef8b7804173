"""Scheduler: a step planned before the previous one's tokens are back (async scheduling), and a
second plan while one is in flight; checked by hand through the fake model."""

from fake_model import (FakeRunner, chunk_shape, expected, make_request, make_sched,
                        reference_outputs, run_to_completion)
from jaxserve.core.sequence import SequenceStatus


def test_second_schedule_before_update_skips_sequences_in_flight():
    sched = make_sched(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", [4, 5, 6, 7, 8], max_tokens=4)
    sched.add_request(a)
    p1 = sched.schedule()
    s1 = runner.run(p1)
    sched.add_request(b)
    p2 = sched.schedule()  # a is in flight: only b is scheduled
    assert chunk_shape(p2) == [("b", 0, 0, 5)]
    s2 = runner.run(p2)
    sched.abort("b")  # freed while two plans are outstanding
    sched.update(p1, s1)
    assert sched.stats()["pending_free_pages"] == 2  # still held for p2
    sched.update(p2, s2)
    assert sched.stats()["pending_free_pages"] == 0
    run_to_completion(sched, [], runner=runner)
    assert a.sequences[0].output_token_ids == expected([a])["a"][0]


def test_schedule_next_decodes_ahead_and_drops_what_a_stop_makes_moot():
    p = [5, 6, 7]
    ref = reference_outputs(p, make_request("x", p, max_tokens=20).sampling_params)[0]
    sched = make_sched(eos=(ref[5],), page_size=4)
    runner = FakeRunner(sched)
    a = make_request("a", p, max_tokens=20)
    b = make_request("b", [9, 9], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    p1 = sched.schedule()
    s1 = runner.run(p1)
    p2 = sched.schedule_next(p1)  # both prompts end in p1: both decode their first token
    assert chunk_shape(p2) == [("a", 0, 3, 1), ("b", 0, 2, 1)]
    assert [c.feed_row for c in p2.chunks] == [0, 1]
    s2 = runner.run(p2, feed=s1)
    sched.update(p1, s1)
    p3 = sched.schedule_next(p2)  # b's second token is its last: only a goes on
    assert chunk_shape(p3) == [("a", 0, 4, 1)] and a.sequences[0].page_ids[1] != 0  # a new page
    s3 = runner.run(p3, feed=s2)
    sched.update(p2, s2)
    assert b.sequences[0].status is SequenceStatus.FINISHED_LENGTH
    sched.add_request(make_request("c", [1], max_tokens=1))
    assert sched.schedule_next(p3) is None  # something waits: admission needs the tokens
    sched.update(p3, s3)
    sched.abort("c")
    # Run a to its EOS (its 6th token); the step planned ahead of that token is dropped.
    plan = sched.schedule()
    out = runner.run(plan)
    while True:
        nxt = sched.schedule_next(plan)
        nxt_out = runner.run(nxt, feed=out)
        sched.update(plan, out)
        if a.sequences[0].is_finished:
            break
        plan, out = nxt, nxt_out
    assert a.sequences[0].output_token_ids == ref[:6]
    assert sched.stats()["pending_free_pages"] > 0  # a's pages wait for the step in flight
    assert sched.update(nxt, nxt_out) == []
    assert sched.stats()["pending_free_pages"] == 0 and sched.stats()["referenced_pages"] == 0
    assert a.sequences[0].output_token_ids == ref[:6]
    assert sched.counters["num_scheduled_ahead"] >= 4
    sched.check_invariants()
