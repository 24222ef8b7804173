"""Sampled rows under speculation keep the target's distribution, checked over many seeds.

A draft model proposes tokens one at a time (a one-hot q), so exact rejection sampling accepts
draft d with probability p(d) and otherwise samples the residual p(x) / (1 - p(d)), x != d, and
what follows a rejection is sampled given the tokens kept. The engine compares the target's own
sample with each draft, which is that rule. Here, on the tiny model with itself as the draft,
1000 seeded requests each verify two drafts after their first token, and
- the drafts accepted, at each position, agree with the sum of p(d) over the requests (z-tests),
- the second and third tokens, accepted drafts and resamples alike, follow the target's
  distribution given the tokens before them (chi-square tests),
with p from the target's own logits (a plain engine) at the temperature and filters asked for.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from test_logit_controls import next_logits
from tiny_model import tiny_loaded

PROMPT = list(range(40, 53))
NUM_SEEDS = 1000
NUM_DRAFTS = 2
OPTIONS = dict(num_pages=200, page_size=8, max_num_seqs=64)
Z_BOUND = 4.0  # two-sided, p ~ 6e-5: a correct rule fails about once in 16000 runs
CHI2_Z = 3.72  # the chi-square's upper tail at p ~ 1e-4 (Wilson-Hilferty)


@pytest.fixture(scope="module")
def engines():
    spec = {"method": "draft", "num_speculative_tokens": NUM_DRAFTS, "adaptive": False}
    return (LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded()),
            LLMEngine(EngineConfig.from_options(**OPTIONS, speculative_config=spec),
                      tiny_loaded()))


def first_verifications(engine, params: list[SamplingParams]) -> list[tuple[list, list]]:
    """Runs one request of PROMPT per params (max_tokens 1 + NUM_DRAFTS + 1: the first token
    from the prefill, then a verification of NUM_DRAFTS drafts); returns (output tokens, the
    drafts of the request's first verification) per request."""
    drafts = {}
    propose = engine.speculator.propose

    def recording(plan):
        plan, seconds = propose(plan)
        for chunk in plan.chunks:
            if chunk.draft_token_ids:
                drafts.setdefault(chunk.seq.request.request_id, list(chunk.draft_token_ids))
        return plan, seconds

    engine.speculator.propose = recording
    try:
        ids = [engine.add_request({"prompt_token_ids": PROMPT}, p).request_id for p in params]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        engine.speculator.propose = propose
    return [(done[i].outputs[0].token_ids, drafts[i]) for i in ids]


def target_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The sampling distribution of SamplingParams p (temperature, top_k) over logits, float64."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k:
        x = np.where(x >= np.sort(x)[-p.top_k], x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def check_acceptance(cases: list[tuple[np.ndarray, int, int]]) -> None:
    """(target distribution, draft, sampled token) per case: the drafts accepted against the
    sum of their probabilities."""
    accepted = sum(token == d for _, d, token in cases)
    expected = sum(p[d] for p, d, _ in cases)
    variance = sum(p[d] * (1 - p[d]) for p, d, _ in cases)
    assert 0.05 * len(cases) < expected < 0.95 * len(cases)  # both outcomes are common here
    assert abs(accepted - expected) < Z_BOUND * math.sqrt(variance), (accepted, expected)


def check_distribution(cases: list[tuple[np.ndarray, int]]) -> None:
    """(target distribution, sampled token) per case: the tokens against the mixture of the
    distributions, by a chi-square test; tokens expected fewer than 5 times share a bin."""
    want = sum(p for p, _ in cases)
    got = Counter(token for _, token in cases)
    assert all(want[t] > 0 for t in got)  # nothing outside top-k, nothing of probability 0
    big = np.flatnonzero(want >= 5)
    observed = [got[t] for t in big] + [len(cases) - sum(got[t] for t in big)]
    expected = list(want[big]) + [len(cases) - want[big].sum()]
    if expected[-1] < 5:  # too little left to pool: fold it into the largest bin
        i = int(np.argmax(expected[:-1]))
        observed[i] += observed.pop()
        expected[i] += expected.pop()
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    bound = df * (1 - 2 / (9 * df) + CHI2_Z * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0
    assert df >= 1 and chi2 < bound, (chi2, df, observed, expected)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, max_tokens=2 + NUM_DRAFTS, ignore_eos=True),
    SamplingParams(temperature=1.5, top_k=4, max_tokens=2 + NUM_DRAFTS, ignore_eos=True),
], ids=["temperature", "top-k"])
def test_acceptance_and_resampling_follow_the_target_distribution(engines, params):
    plain, spec = engines
    before = spec.stats()["spec_draft_tokens"]
    runs = first_verifications(spec, [dataclasses.replace(params, seed=s)
                                      for s in range(NUM_SEEDS)])
    assert spec.stats()["spec_draft_tokens"] - before >= NUM_SEEDS * NUM_DRAFTS
    cache = {}

    def dist(context: tuple) -> np.ndarray:
        """The target's distribution after PROMPT + context."""
        if context not in cache:
            cache[context] = target_distribution(next_logits(plain, PROMPT + list(context)),
                                                 params)
        return cache[context]

    # Position 1 (the first draft's) and position 2, given the tokens actually kept before.
    for j in (1, 2):
        check_distribution([(dist(tuple(out[:j])), out[j]) for out, _ in runs])
    check_acceptance([(dist(tuple(out[:1])), d[0], out[1]) for out, d in runs])
    # The second draft is judged only where the first was accepted.
    check_acceptance([(dist((out[0], d[0])), d[1], out[2]) for out, d in runs if out[1] == d[0]])
