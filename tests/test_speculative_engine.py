"""Speculative decoding through the engine on the tiny random model: prompt lookup changes no
output, greedy or seeded sampling (a row's sample at a position uses the key it would use
without speculation, and acceptance compares it with the draft: exact rejection sampling for a
proposal that is a single token), with stop strings, logprobs, n > 1 and mixed batches; every
page comes back; the counters add up. And the cost model that chooses the drafts per step."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.core.speculation_control import SpeculationControl
from tiny_model import tiny_loaded

# Repetitive prompts: prompt lookup finds its n-grams in them and in what the model repeats.
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "0123456789" * 3,
           "xyz", "hello hello hello hello"]


def make_llm(spec=None, **options) -> LLM:
    options = dict(num_pages=96, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                   **options)
    return LLM.from_engine(LLMEngine(EngineConfig.from_options(speculative_config=spec,
                                                               **options), tiny_loaded()))


@pytest.fixture(scope="module")
def plain():
    return make_llm()


@pytest.fixture(scope="module", params=[(1, False), (4, False), (8, False), (4, True)],
                ids=["k1", "k4", "k8", "k4-adaptive"])
def spec(request):
    # Mostly not adaptive: speculate in every step (the tiny model's steps cost about the same
    # at any size, where the cost model could go either way); adaptive: whatever it chooses.
    k, adaptive = request.param
    return make_llm({"num_speculative_tokens": k, "adaptive": adaptive})


def speculates_always(llm) -> bool:
    return not llm.engine.config.speculative.adaptive


def texts_and_ids(outputs):
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def test_greedy_outputs_are_plain_decoding_token_for_token(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = texts_and_ids(plain.generate(PROMPTS, params, use_tqdm=False))
    before = spec.stats()
    got = texts_and_ids(spec.generate(PROMPTS, params, use_tqdm=False))
    assert got == want
    st = spec.stats()
    if speculates_always(spec):
        assert st["spec_accepted_tokens"] > before["spec_accepted_tokens"]  # it did speculate
    assert st["referenced_pages"] == 0 and st["running"] == st["waiting"] == 0
    spec.engine.scheduler.check_invariants()


def test_seeded_sampling_forks_and_filters_are_unchanged(plain, spec):
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=32, n=2),
              SamplingParams(temperature=0, max_tokens=5),  # a mixed batch: short greedy
              SamplingParams(temperature=0.5, seed=11, max_tokens=40, ignore_eos=True,
                             logprobs=2)]
    prompts = PROMPTS[:4]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert texts_and_ids(got) == texts_and_ids(want)
    for g, w in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)
    assert spec.stats()["referenced_pages"] == 0


def test_stop_strings_inside_a_verification(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    text = plain.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[20:23]  # completed by a token that speculation verifies in a chunk
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop)
    assert stop not in got.text and len(got.text) <= 20 + len(stop)


def test_counters_add_up(spec):
    st = spec.stats()
    k = spec.engine.config.speculative.num_speculative_tokens
    assert len(st["spec_accepted_per_position"]) == k
    assert sum(st["spec_accepted_per_position"]) == st["spec_accepted_tokens"]
    assert st["spec_accepted_tokens"] <= st["spec_draft_tokens"] <= k * st["spec_steps"]
    # A step verifies the drafts of one sequence or more.
    assert st["spec_verifying_steps"] <= st["spec_steps"] <= 4 * st["spec_verifying_steps"]
    assert st["spec_verifying_steps"] <= st["steps"]
    if speculates_always(spec):
        assert st["spec_accepted_tokens"] > 0
    # Acceptance at a position needs acceptance at every earlier one.
    per = st["spec_accepted_per_position"]
    assert all(a >= b for a, b in zip(per, per[1:]))


# ---- the cost model that chooses the drafts per step ----------------------------------------

def control(plain: dict, verifying: dict, max_k: int = 4) -> SpeculationControl:
    """Each bucket timed twice: first a shape's first run, slow and not counted, then as given."""
    c = SpeculationControl(max_k, (1, 2, 4, 8, 16, 32, 64, 128, 256))
    for is_verifying, times in ((False, plain), (True, verifying)):
        for tokens, seconds in times.items():
            c.observe(tokens, 30 * seconds, verifying=is_verifying)
            c.observe(tokens, seconds, verifying=is_verifying)
    return c


def test_control_does_not_count_a_shapes_first_run():
    """The first verification of a shape paid one-time costs (14x here): counted, it made
    plain decoding win at one stream for the rest of the run, since the probes that could
    correct it verify one draft, in another bucket."""
    c = SpeculationControl(8, (1, 2, 4, 8, 12, 16))
    c.observe(1, 0.021, verifying=False)
    c.observe(1, 0.021, verifying=False)
    c.observe(9, 0.30, verifying=True)  # the first 9-token verification
    assert c.cost(9, True) == pytest.approx(0.021)  # none counted: the plain time stands in
    c.observe(9, 0.032, verifying=True)
    assert c.cost(9, True) == pytest.approx(0.032)
    assert c.choose(1, 100, [100] * 8, [50] * 8) == 8
    c.observe(9, 0.60, verifying=True)  # a later stall counts as twice the average
    assert c.cost(9, True) == pytest.approx(0.9 * 0.032 + 0.1 * 0.064)
    for _ in range(30):  # a lasting change is followed
        c.observe(9, 0.10, verifying=True)
    assert c.cost(9, True) == pytest.approx(0.10, rel=0.05)


def test_control_speculates_where_a_bigger_step_costs_little():
    # One stream, memory-bound: 5 tokens cost 1.2x one; drafts proposed at every position,
    # 60% accepted: k = 4 yields 1 + 4 * 0.6 = 3.4 tokens per step.
    c = control({1: 0.020}, {4: 0.022, 8: 0.026})
    assert c.choose(1, 1000, [1000] * 4, [600] * 4) == 4
    # A batch of 64, compute-bound (step time proportional to tokens): plain wins.
    c = control({64: 0.080, 128: 0.160}, {128: 0.165, 256: 0.330})
    assert c.choose(64, 1000, [1000] * 4, [600] * 4) == 0
    # Nothing accepted: plain, even where steps cost the same.
    assert control({1: 0.02}, {8: 0.02}).choose(1, 1000, [1000] * 4, [0] * 4) == 0


def test_control_follows_a_change_in_acceptance():
    """The scheduler's counts are the run's totals; the control weighs recent decodes: after
    10000 decodes with 60% accepted, traffic whose drafts all fail ends speculation within a
    few thousand decodes (the totals would still say 46% accepted after 3000)."""
    c = control({1: 0.020}, {4: 0.022, 8: 0.026})
    assert c.choose(1, 10000, [10000] * 4, [6000] * 4) == 4
    picks = [c.choose(1, 10000 + n, [10000 + n] * 4, [6000] * 4) for n in range(1, 3001)]
    assert picks.index(0) > 256  # a few hundred decodes are not enough to give up
    assert 0 in picks


def test_control_explores_then_probes_ever_less_often():
    c = SpeculationControl(4, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    assert c.choose(1, 0, [0] * 4, [0] * 4) == 0  # plain decoding first, to time it
    c.observe(512, 0.4, verifying=False)  # a prefill chunk: not a decode's price
    c.observe(512, 0.4, verifying=False)
    assert c.choose(1, 0, [0] * 4, [0] * 4) == 0
    c.observe(1, 0.02, verifying=False)
    c.observe(1, 0.02, verifying=False)
    assert c.choose(1, 0, [0] * 4, [0] * 4) == 4  # verification not timed: try it
    c = control({64: 0.08, 128: 0.16}, {128: 0.165, 256: 0.33})
    picks = [c.choose(64, 1000, [1000] * 4, [600] * 4) for _ in range(16 + 32 + 64)]
    probes = [i for i, k in enumerate(picks) if k]
    assert probes == [15, 15 + 32, 15 + 32 + 64] and all(picks[i] == 1 for i in probes)


def test_control_cost_interpolates_and_extrapolates():
    c = control({8: 0.010, 16: 0.018}, {})
    assert c.cost(12, True) == pytest.approx(0.014)  # verifying: the plain times stand in
    assert c.cost(32, False) == pytest.approx(0.034)  # along the last slope
    assert c.cost(2, False) == pytest.approx(0.010)  # flat below the smallest
    assert control({}, {}).cost(4, False) is None


def test_control_bounds_an_untimed_verification_by_plain_steps():
    """Verifications timed only at one stream (memory-bound: 9 tokens cost 1.5x one) must not
    promise a 64-row verification at that slope: plain steps of as many tokens (a batch's
    decodes, prefill chunks) bound it, and plain decoding wins there."""
    c = control({1: 0.020, 64: 0.080, 128: 0.150, 512: 0.55}, {16: 0.032})
    assert c.cost(16, True) == pytest.approx(0.032)  # its own bucket, timed
    assert c.cost(576, True) >= c.cost(576, False) > 0.55
    assert c.choose(1, 1000, [1000] * 4, [600] * 4) == 4
    assert c.choose(64, 1000, [1000] * 4, [600] * 4) == 0
    # A draft model's steps make a verification 1.77x a plain step of its size at one stream;
    # a 56-row verification, not timed, is priced at that ratio over plain's time there.
    c = control({1: 0.019, 2: 0.020, 8: 0.026, 64: 0.072, 512: 0.37}, {8: 0.046})
    assert c.cost(280, True) == pytest.approx(c.cost(280, False) * 0.046 / 0.026)
    assert c.choose(1, 1000, [1000] * 4, [600] * 4) > 0
    assert c.choose(56, 1000, [1000] * 4, [600] * 4) == 0
