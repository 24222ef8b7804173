"""Speculative decoding with a draft model (method "draft") on the tiny random model: the
target's own weights as the draft (exact, and in int8: self-speculation) and a separate smaller
draft of the same vocabulary. Greedy outputs equal plain decoding token for token, with prefix
caching, chunked prefill, prompts longer than a step's budget, forced preemption, aborts and
n > 1; seeded sampling is unchanged (acceptance compares the target's own sample with the
draft: exact rejection sampling for a proposal that is a single token); every page comes back.
A draft that is the target itself has every draft accepted: its KV follows the sequences exactly.
Bad draft configurations fail at startup."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, ResolvedConfig
from jaxserve.engine import LLMEngine
from tiny_model import tiny_loaded

# The last prompt is longer than a step's token budget (64): its first proposal catches the
# draft up in several calls.
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "0123456789" * 3,
           "xyz", "a long prompt that the scheduler prefills in chunks " * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def one_layer_draft():
    """The tiny model's first layer alone: another shape (its KV pool too), the same vocabulary,
    proposals the target often accepts."""
    loaded = tiny_loaded()
    layers = {name: w[:1] for name, w in loaded.params["layers"].items()}
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, num_layers=1),
                               params={**loaded.params, "layers": layers},
                               fingerprint="tiny-0-first-layer")


def make_llm(spec=None, draft=None, **options) -> LLM:
    # Chunks count their tokens alone (prefill_keys_per_token=0): the pool's pressure and the
    # preemptions it forces are what these tests set up.
    options = {**dict(num_pages=96, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                      prefill_keys_per_token=0), **options}
    config = EngineConfig.from_options(speculative_config=spec, **options)
    return LLM.from_engine(LLMEngine(config, tiny_loaded(), draft_loaded=draft))


def draft_spec(k: int, quantization: str = "none") -> dict:
    # Not adaptive: speculate in every step (the tiny model's cost model could go either way).
    return {"method": "draft", "num_speculative_tokens": k, "quantization": quantization,
            "adaptive": False}


DRAFTS = {"self-k3": (draft_spec(3), None), "self-int8-k4": (draft_spec(4, "int8"), None),
          "one-layer-k2": (draft_spec(2), one_layer_draft)}


@pytest.fixture(scope="module")
def plain():
    return make_llm()


@pytest.fixture(scope="module", params=list(DRAFTS))
def drafting(request):
    # 25 pages of 8 slots for five sequences of up to 196 tokens: preemption is forced. (One
    # pool size for all: the pool's shape is the compiled steps'.)
    spec, draft = DRAFTS[request.param]
    return request.param, make_llm(spec, draft() if draft else None, num_pages=26)


def token_ids(outputs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def check_clean(llm) -> dict:
    st = llm.stats()
    assert st["referenced_pages"] == 0 and st["running"] == st["waiting"] == 0
    llm.engine.scheduler.check_invariants()
    return st


def test_greedy_outputs_are_plain_decoding_token_for_token(plain, drafting):
    name, llm = drafting
    want = token_ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    # Again: the prompts' full pages now come from the prefix cache (the draft computes them
    # for its own pool, whose pages at those ids may hold another sequence's draft KV).
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    st = check_clean(llm)
    assert st["prefix_cache_hits"] > 0 and st["preemptions"] > 0
    assert st["spec_accepted_tokens"] > 0
    if name.startswith("self-k"):  # the target as its own draft: every draft is its argmax
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]


def test_sampling_forks_and_aborts(plain, drafting):
    name, llm = drafting
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=32, n=2),
              SamplingParams(temperature=0, max_tokens=5), GREEDY]
    want = token_ids(plain.generate(PROMPTS, params, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    check_clean(llm)
    # An abort in the middle of speculation returns every page; the others are unchanged.
    greedy = token_ids(plain.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
    engine = llm.engine
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    outputs = {}
    for steps in range(200):
        for out in engine.step():
            outputs[out.request_id] = out
        if steps == 6:
            assert engine.abort(requests[1].request_id)
        if not engine.has_unfinished():
            break
    for i in (0, 2):
        assert outputs[requests[i].request_id].outputs[0].token_ids == greedy[i][0][0]
    check_clean(llm)


def test_bad_draft_configurations_fail_at_startup():
    for bad, message in [({"method": "draft", "quantization": "int4"}, "quantization"),
                         ({"method": "ngram", "model": "other"}, "method 'draft'"),
                         ({"method": "ngram", "quantization": "int8"}, "method 'draft'")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_options(speculative_config=bad)
    with pytest.raises(ValueError, match="vocabulary has 300 tokens, the target's 320"):
        make_llm(draft_spec(2), tiny_loaded(vocab_size=300))
    with pytest.raises(ValueError, match="unknown model"):
        make_llm({"method": "draft", "model": "/no/such/draft"})


def test_a_kv_byte_budget_pays_for_both_pools():
    target = tiny_loaded().config
    draft = one_layer_draft().config  # half the target's layers: half its KV per token
    config = EngineConfig.from_options(kv_cache_bytes=3 * 10 * 8 * target.kv_bytes_per_token(4),
                                       page_size=8, dtype="float32")
    resolved = ResolvedConfig.of(config, target, dtype="float32", backend="xla",
                                 attention_cost=1.0)
    assert resolved.num_pages(config, resolved.kv_bytes_per_token(target)) == 30
    both = resolved.kv_bytes_per_token(target) + resolved.kv_bytes_per_token(draft)
    assert resolved.num_pages(config, both) == 20


def test_draft_flags_map_onto_the_config():
    from absl import flags
    from absl.testing import flagsaver

    from jaxserve.cli import engine_flags

    with flagsaver.flagsaver(speculative_method="draft", speculative_quantization="int8",
                             speculative_model="smollm2", num_speculative_tokens=3):
        parsed = flags.FLAGS.is_parsed()
        flags.FLAGS.mark_as_parsed()
        try:
            options = engine_flags.engine_options()
        finally:
            if not parsed:
                flags.FLAGS.unparse_flags()
    spec = EngineConfig.from_options(**options).speculative
    assert (spec.method, spec.model, spec.quantization, spec.num_speculative_tokens) == \
        ("draft", "smollm2", "int8", 3)


def test_draft_kv_follows_accepted_drafts_and_held_pages():
    from jaxserve.core.draft_kv import LAG_LIMIT, DraftKV
    from jaxserve.core.sequence import Request, Sequence

    request = Request("r", list(range(10)), SamplingParams(temperature=0))
    seq = Sequence(1, request, list(range(10)), 10, page_ids=[5, 6, 7])  # pages of 4 slots
    kv = DraftKV(page_size=4)
    assert kv.computed(seq) == 0 and kv.can_draft(seq)
    # A proposal at the last token (position 9) wrote drafts 40, 41 at positions 10, 11 and
    # proposed 42 after them.
    kv.wrote(seq, 9, [40, 41, 42])
    seq.token_ids += [40, 99]  # the target accepted 40, then took its own 99
    assert kv.computed(seq) == 11  # positions 0..10: the prompt and the accepted draft
    seq.token_ids[10:] = [41]
    assert kv.computed(seq) == 10  # the first draft rejected: only what preceded it
    seq.page_ids[2] = 8  # the page of positions 8..11 replaced (copy-on-write)
    assert kv.computed(seq) == 8
    seq.token_ids += [0] * (LAG_LIMIT + 2)
    assert not kv.can_draft(seq)  # too far behind: it decodes plainly
    kv.forget(seq)
    assert kv.computed(seq) == 0 and not kv.can_draft(seq)  # output too long to start
