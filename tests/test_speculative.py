"""Speculative decoding in the scheduler, through the fake model: verification chunks keep every
output identical to plain decoding whatever the drafts (an oracle proposer that is right up to a
random point, and prompt lookup), with prefix caching, chunked prefill, preemption, aborts and
n > 1; rolled-back lookahead pages are returned; a verification stops at an EOS; nothing is
planned ahead while speculating; prompt lookup itself; bad configurations."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from fake_model import (FakeRunner, V, assert_outputs_match_reference, chunk_shape, make_request,
                        make_sched, next_token, random_workload, reference_outputs,
                        run_to_completion)
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.core.speculation import Speculation, ngram_proposal


class OracleProposer:
    """Drafts the fake model's true continuation, wrong from a random position on (or never),
    so verifications accept every number of drafts from 0 to k."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, seq, k):
        tokens, drafts = list(seq.token_ids), []
        wrong_from = self.rng.choice([self.rng.randrange(k + 1), k])
        for i in range(k):
            t = next_token(tokens, seq.num_prompt_tokens, seq.fork_index)
            drafts.append(t if i < wrong_from else (t + 1) % V)
            tokens.append(drafts[-1])
        return drafts


class ScriptedProposer:
    """Proposes what the test's `rule(seq, k)` says (nothing until it says)."""

    def __init__(self):
        self.rule = lambda seq, k: []

    def propose(self, seq, k):
        return self.rule(seq, k)


def spec_sched(k, *, proposer=None, **kw):
    """A scheduler speculating k drafts per sequence, prompt lookup's unless `proposer`."""
    spec = SpeculativeConfig(num_speculative_tokens=k)
    max_model_len = kw.get("max_model_len", 256)
    speculation = Speculation(spec, max_model_len=max_model_len,
                              page_size=kw.get("page_size", 4), proposer=proposer)
    return make_sched(speculative_config={"num_speculative_tokens": k},
                      speculation=speculation, **kw)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_k_keeps_outputs_with_caching_chunking_preemption_aborts_and_forks(k):
    for seed in range(6):
        _scenario(seed * 10 + k, k)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_speculative_scenarios_match_reference(seed):
    _scenario(seed, random.Random(seed).randint(1, 8))


def _scenario(seed, k):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 8])
    max_len = 64
    cfg = dict(page_size=page_size, max_num_seqs=rng.randint(1, 6),
               enable_prefix_caching=rng.random() < 0.7, enable_chunked_prefill=rng.random() < 0.7,
               scheduling_policy=rng.choice(["fcfs", "priority"]))
    cfg["max_num_batched_tokens"] = rng.randint(max(cfg["max_num_seqs"], 5), 40)
    min_pages = -(-(max_len - 1) // page_size) + 1  # any single sequence fits
    oracle = rng.random() < 0.7  # else prompt lookup over a 3-token vocabulary
    sched = spec_sched(k, proposer=OracleProposer(seed) if oracle else None, max_model_len=max_len,
                       num_pages=rng.randint(min_pages + 1, min_pages * 3),
                       eos=(rng.randrange(V),), **cfg)
    reqs, aborts = random_workload(rng, cfg, max_requests=20)
    res = run_to_completion(sched, reqs, abort_at=aborts, ahead=True)
    assert_outputs_match_reference(res, reqs, sched)
    st = sched.stats()
    assert st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    assert sum(st["spec_accepted_per_position"]) == st["spec_accepted_tokens"]
    assert st["num_scheduled_ahead"] == 0  # nothing planned ahead while speculating


def test_rejected_lookahead_returns_its_pages_and_accepted_drafts_advance():
    proposer = ScriptedProposer()
    sched = spec_sched(6, proposer=proposer, page_size=4, num_pages=16)
    runner = FakeRunner(sched)
    r = make_request("r", [1, 2, 3], max_tokens=20)
    sched.add_request(r)
    seq = r.sequences[0]
    plan = sched.schedule()  # the prompt: no drafts yet
    sched.update(plan, runner.run(plan))
    true = reference_outputs([1, 2, 3], r.sampling_params)[0]
    proposer.rule = lambda s, k: [(true[1] + 1) % V] * k  # wrong from the first
    plan = sched.schedule()
    assert chunk_shape(plan) == [("r", 0, 3, 7)] and len(seq.page_ids) == 3  # slots 3..9
    free_before = sched.stats()["free_pages"]
    sched.update(plan, runner.run(plan))
    assert seq.output_token_ids == true[:2] and seq.num_computed_tokens == 4
    assert len(seq.page_ids) == 2 and sched.stats()["free_pages"] == free_before + 1
    proposer.rule = lambda s, k: true[2:2 + k]  # all right: k drafts and a bonus token
    plan = sched.schedule()
    assert chunk_shape(plan) == [("r", 0, 4, 7)]
    sched.update(plan, runner.run(plan))
    assert seq.output_token_ids == true[:9] and seq.num_computed_tokens == 11
    st = sched.stats()
    assert (st["spec_steps"], st["spec_draft_tokens"], st["spec_accepted_tokens"]) == (2, 12, 6)
    assert st["spec_verifying_steps"] == 2  # one sequence: a step per verification
    assert st["spec_accepted_per_position"] == [1] * 6
    run_to_completion(sched, [], runner=runner)
    assert seq.output_token_ids == true


def test_a_verification_stops_at_eos_and_at_max_tokens():
    prompt = [4, 5, 6]
    true = reference_outputs(prompt, make_request("x", prompt, max_tokens=30).sampling_params)[0]
    proposer = ScriptedProposer()
    sched = spec_sched(8, proposer=proposer, eos=(true[4],))
    runner = FakeRunner(sched)
    eos = make_request("eos", prompt, max_tokens=30)
    short = make_request("short", prompt, max_tokens=3)
    for r in (eos, short):
        sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, runner.run(plan))
    proposer.rule = lambda s, k: true[1:1 + k]  # right, through the EOS and beyond
    plan = sched.schedule()
    # max_tokens 3: one token out, so at most 1 draft (2 new tokens); the other gets 8.
    assert sorted(c.num_tokens for c in plan.chunks) == [2, 9]
    sched.update(plan, runner.run(plan))
    assert eos.sequences[0].output_token_ids == true[:5]  # stopped at the EOS (row 3 of 9)
    assert short.sequences[0].output_token_ids == true[:3]
    assert eos.is_finished and short.is_finished and sched.stats()["referenced_pages"] == 0


def test_without_pages_for_the_lookahead_it_decodes_plainly():
    proposer = ScriptedProposer()
    sched = spec_sched(8, proposer=proposer, page_size=4, num_pages=4)  # 3 usable pages
    runner = FakeRunner(sched)
    reqs = [make_request(name, [1, 2, 3], max_tokens=4) for name in ("a", "b")]
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, runner.run(plan))
    true = reference_outputs([1, 2, 3], reqs[0].sampling_params)[0]
    proposer.rule = lambda s, k: true[1:1 + k]
    plan = sched.schedule()  # 2 drafts (max_tokens) need a page each; a gets the free one
    assert chunk_shape(plan) == [("b", 0, 3, 1), ("a", 0, 3, 3)] and not plan.preempted
    sched.update(plan, runner.run(plan))
    res = run_to_completion(sched, [], runner=runner)
    assert [r.sequences[0].output_token_ids for r in reqs] == [true, true]
    assert res.preemptions == sched.stats()["num_preempted_total"]


def test_ngram_proposal():
    assert ngram_proposal([1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]
    assert ngram_proposal([0] * 10, 3, 1, 4) == [0, 0, 0]  # a run: the earliest match
    assert ngram_proposal([9, 1, 2, 3, 4, 5, 1, 2, 7, 1, 2], 3, 1, 4) == [7, 1, 2]  # the latest
    assert ngram_proposal([9, 1, 2, 3, 1, 2], 3, 3, 4) == []  # no 3-gram repeats
    assert ngram_proposal([5, 6, 7], 2, 1, 4) == [] and ngram_proposal([5, 5], 0, 1, 4) == []


@pytest.mark.parametrize("bad, message", [
    ({"num_speculative_tokens": 0}, "1...16"), ({"num_speculative_tokens": 17}, "1...16"),
    ({"method": "eagle"}, "method"), ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "lookup"),
    ({"tokens": 3}, "unknown speculative_config key"),
])
def test_bad_speculative_configs_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(speculative_config=bad)
    assert SpeculativeConfig.parse(None) is None
