"""Logit controls on the tiny random model: logit_bias, presence, frequency and repetition
penalties and structured-output masks change a greedy output exactly as a numpy reference of the
same rule applied to the model's own logits; rows without controls are unchanged by sharing a
step with controlled rows; no step compiles after warm-up; bad values are refused."""

from __future__ import annotations

import math
import re
from collections import Counter

import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.engine import LLMEngine

PROMPT = list(range(40, 53))


@pytest.fixture(scope="module")
def loaded():
    from tiny_model import tiny_loaded

    return tiny_loaded()


@pytest.fixture(scope="module")
def engine(loaded):
    return LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=8),
                     loaded)


def run(engine, requests):
    """[(prompt ids, params)] -> finished RequestOutputs in order."""
    ids = [engine.add_request({"prompt_token_ids": p}, sp).request_id for p, sp in requests]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def next_logits(engine, tokens):
    """The model's logits after `tokens` (one greedy token of a plain request; the step's
    logits of its row 0, captured from the runner)."""
    captured = []
    real = engine.runner.dispatch

    def spy(batch, *args, **kwargs):
        out = real(batch, *args, **kwargs)
        captured.append(np.asarray(out["logits"][0]))
        return out

    engine.runner.dispatch = spy
    try:
        run(engine, [(tokens, SamplingParams(temperature=0, max_tokens=1))])
    finally:
        engine.runner.dispatch = real
    return captured[0]


def reference_rule(logits, prompt, output, p: SamplingParams):
    """The documented rule in numpy: repetition, frequency and presence, then logit_bias."""
    x = logits.astype(np.float32).copy()
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] = x[t] - np.float32(p.frequency_penalty) * c - np.float32(p.presence_penalty)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    return x


CONTROLS = [
    dict(logit_bias={65: 4.0, 70: -100.0, 300: 2.5}),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.8),
    dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=0.6,
         logit_bias={41: 3.0}),
]


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: "+".join(c))
def test_greedy_controls_equal_numpy_reference(engine, controls):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **controls)
    (out,) = run(engine, [(PROMPT, params)])
    got = out.outputs[0].token_ids
    expected = []
    for _ in range(12):
        x = reference_rule(next_logits(engine, PROMPT + expected), PROMPT, expected, params)
        expected.append(int(np.argmax(x)))
    assert got == expected
    plain = run(engine, [(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))])[0].outputs[0].token_ids
    assert got != plain  # the controls did change the output


def test_greedy_mask_equals_numpy_reference(engine):
    """A regex-constrained greedy output is the argmax of the model's logits under llguidance's
    own mask at each step, filled outside the engine."""
    spec = StructuredOutputsParams(regex=r"[a-f]{3}(-[0-9]{2}){2}")
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)
    (out,) = run(engine, [(PROMPT, params)])
    tok = engine.tokenizer
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=engine.model_config.vocab_size,
                                   eos_token=list(engine.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, spec.grammar_text())
    mask = llnp.allocate_token_bitmask(1, engine.model_config.vocab_size)
    expected = []
    while not matcher.is_stopped():
        x = next_logits(engine, PROMPT + expected)[None].copy()
        llnp.fill_next_token_bitmask(matcher, mask)
        llnp.apply_token_bitmask_inplace(x, mask)
        token = int(np.argmax(x[0]))
        assert matcher.consume_token(token)
        expected.append(token)
    eos = set(engine.eos_token_ids)
    assert out.outputs[0].token_ids == [t for t in expected if t not in eos] or \
        out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].text) == 9


def test_rows_without_controls_unchanged_and_no_compiles_after_warmup(loaded):
    """Sampled (seeded) and greedy rows give the same tokens alone and in steps with
    constrained rows; warm-up compiled every call these steps make (the model step and the
    sampling call, greedy and sampled, with masks and without)."""
    engine = LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=8),
                       loaded)
    engine.warmup()
    before = engine.stats()["compilations"]
    free = [(PROMPT, SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)),
            (PROMPT[:5], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    alone = [o.outputs[0].token_ids for o in run(engine, free)]
    mixed = run(engine, free + [
        (PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=
                                StructuredOutputsParams(regex="[a-z]{3,30}"))),
        (PROMPT, SamplingParams(temperature=0.8, max_tokens=40, structured_outputs=
                                StructuredOutputsParams(choice=["alpha", "beta"])))])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch("[a-z]{3,30}", mixed[2].outputs[0].text)
    assert mixed[3].outputs[0].text in ("alpha", "beta")
    assert engine.stats()["compilations"] == before


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=math.nan), dict(frequency_penalty=2.5), dict(repetition_penalty=0.0),
    dict(repetition_penalty=math.inf), dict(logit_bias={5: 101.0}),
    dict(logit_bias={5: math.nan}), dict(logit_bias={-1: 1.0}), dict(logit_bias={"x": 1.0})])
def test_bad_controls_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_logit_bias_beyond_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match="vocabulary size 320"):
        engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(logit_bias={320: 1.0}))
    assert not engine.has_unfinished()


def test_async_scheduling_defers_sampling_and_changes_no_output(loaded):
    """With async scheduling a step of rows with penalties or a grammar is launched ahead of
    the previous step's read-back, its sampling after those tokens are applied: the outputs
    equal those of an engine that plans each step after the last."""
    requests = [
        (PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                frequency_penalty=1.2, repetition_penalty=1.5)),
        (PROMPT[:7], SamplingParams(temperature=0.9, seed=4, max_tokens=40, n=2,
                                    structured_outputs=StructuredOutputsParams(
                                        regex=r"([a-z]{2,5} ){2,4}[0-9]{1,4}"))),
        (PROMPT[3:], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    outs, ahead = {}, {}
    for async_ in (False, True):
        engine = LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=8,
                                                     async_scheduling=async_), loaded)
        outs[async_] = [[c.token_ids for c in o.outputs] for o in run(engine, requests)]
        ahead[async_] = engine.stats()["num_scheduled_ahead"]
    assert outs[True] == outs[False] and ahead[True] > 10 and ahead[False] == 0
