"""Speculative decoding through the engine on the tiny random model: prompt lookup changes no
output, greedy or seeded sampling (a row's sample at a position uses the key it would use
without speculation, and acceptance compares it with the draft: exact rejection sampling for a
proposal that is a single token), with stop strings, logprobs, n > 1 and mixed batches; every
page comes back; the counters add up."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
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


@pytest.fixture(scope="module", params=[1, 4, 8])
def spec(request):
    return make_llm({"num_speculative_tokens": request.param})


def texts_and_ids(outputs):
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def test_greedy_outputs_are_plain_decoding_token_for_token(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = texts_and_ids(plain.generate(PROMPTS, params, use_tqdm=False))
    before = spec.stats()
    got = texts_and_ids(spec.generate(PROMPTS, params, use_tqdm=False))
    assert got == want
    st = spec.stats()
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
    k = spec.engine.config.speculative_config.num_speculative_tokens
    assert len(st["spec_accepted_per_position"]) == k
    assert sum(st["spec_accepted_per_position"]) == st["spec_accepted_tokens"]
    assert 0 < st["spec_accepted_tokens"] <= st["spec_draft_tokens"] <= k * st["spec_steps"]
    # Acceptance at a position needs acceptance at every earlier one.
    per = st["spec_accepted_per_position"]
    assert all(a >= b for a, b in zip(per, per[1:]))
