"""End-to-end generation on the real default model (SmolLM2-135M-Instruct, f32).

Greedy output equals Hugging Face transformers token for token, and no engine mechanism (batching,
prefix caching, chunked prefill, preemption, forks, aborts) changes a greedy output; prefix
caching, chunked prefill and preemption also keep it over int8 KV pages, and speculative decoding
(prompt lookup, k = 2 and 5) keeps it too."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM

pytestmark = pytest.mark.slow  # every test runs the real default model

GREEDY = SamplingParams(temperature=0, max_tokens=32)

LONG_PROMPT = ("Here are some notes about the history of computing. " + " ".join(
    f"In year {1940 + i} engineers built machine number {i}, which could add {i * 7} numbers "
    f"per second." for i in range(30)) + " Summarise the notes:")


def make_llm(loaded, **options) -> LLM:
    """An LLM over the already-loaded default model (no reload per test)."""
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig.from_options(**options), loaded)
    return llm


@pytest.fixture(scope="module")
def llm(default_loaded):
    return make_llm(default_loaded, num_pages=400, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def prompts(default_loaded):
    tok = default_loaded.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in (
        "What is the capital of France?", "Write a haiku about the sea.")]
    return [{"prompt_token_ids": tok.encode(c, add_special_tokens=False)} for c in chat] + [
        "The three primary colours are", "def fibonacci(n):\n", LONG_PROMPT]


@pytest.fixture(scope="module")
def reference(prompts, hf_smollm2, default_loaded):
    """transformers greedy continuations (32 tokens or up to EOS), per prompt."""
    import torch

    tok = default_loaded.tokenizer
    out = []
    for p in prompts:
        ids = p["prompt_token_ids"] if isinstance(p, dict) else tok.encode(p)
        with torch.no_grad():
            gen = hf_smollm2.model.generate(torch.tensor([ids]), max_new_tokens=32,
                                            do_sample=False, eos_token_id=list(tok.eos_token_ids),
                                            pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_long_prompt_is_long(default_loaded):
    assert len(default_loaded.tokenizer.encode(LONG_PROMPT)) > 500


def test_greedy_matches_transformers(llm, prompts, reference):
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert out.outputs[0].token_ids == ref, (out.prompt, out.outputs[0].token_ids, ref)
    assert "Paris" in outs[0].outputs[0].text


def test_batched_equals_one_at_a_time(llm, prompts):
    together = _ids(llm.generate(prompts, GREEDY))
    alone = [_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_prefix_caching_does_not_change_outputs(default_loaded, kv):
    tok = default_loaded.tokenizer
    base = tok.encode(LONG_PROMPT)[:200]
    page = 16
    prompts = [
        {"prompt_token_ids": base + tok.encode(" First question: why?")},
        {"prompt_token_ids": base[:page * 9] + [42, 43, 44]},  # hit ends exactly on a boundary
        {"prompt_token_ids": base[:page * 9 + 5] + [50, 51]},  # hit ends mid-page
        {"prompt_token_ids": base},  # fully cached prompt (after the first request)
        {"prompt_token_ids": base[:page * 8]},  # fully cached, page-aligned
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    cached = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=200, max_num_seqs=4, enable_prefix_caching=True)
    first = _ids(cached.generate(prompts[:1], params))
    rest = _ids(cached.generate(prompts[1:], params))
    stats = cached.stats()
    # The later prompts reuse the first one's full base pages, never their own last token:
    # 9 pages (147 tokens), 9 (151), 12 (base, 200 tokens) and 7 (base[:128], page-aligned).
    assert stats["prefix_cache_hits"] == (9 + 9 + 12 + 7) * page
    plain = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=200, max_num_seqs=4, enable_prefix_caching=False)
    assert first + rest == _ids(plain.generate(prompts, params))
    assert plain.stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_chunked_prefill_with_unaligned_chunks(default_loaded, kv, prompts):
    params = SamplingParams(temperature=0, max_tokens=12)
    whole = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=200, max_num_seqs=4, max_num_batched_tokens=1024)
    chunked = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=200, max_num_seqs=4, max_num_batched_tokens=37,
                       enable_prefix_caching=False)
    assert _ids(chunked.generate(prompts, params)) == _ids(whole.generate(prompts, params))


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_forced_preemption_keeps_outputs(default_loaded, kv, prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = prompts[:4]
    ample = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=200, max_num_seqs=4)
    # 4 sequences of ~40-60 tokens need ~16 pages; 9 pages force repeated preemption.
    tight = make_llm(default_loaded, kv_cache_dtype=kv, num_pages=10, max_num_seqs=4, page_size=16,
                     enable_prefix_caching=False)
    expected = _ids(ample.generate(short, params))
    assert _ids(tight.generate(short, params)) == expected
    stats = tight.stats()
    assert stats["preemptions"] >= 2
    assert stats["referenced_pages"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_isolation_same_prefix_different_continuations(default_loaded):
    tok = default_loaded.tokenizer
    prefix = tok.encode(LONG_PROMPT)[:100]
    a = {"prompt_token_ids": prefix + tok.encode(" The answer is yes")}
    b = {"prompt_token_ids": prefix + tok.encode(" The answer is no, because")}
    params = SamplingParams(temperature=0, max_tokens=10)
    llm = make_llm(default_loaded, num_pages=100, max_num_seqs=4)
    alone = [_ids(llm.generate([p], params))[0] for p in (a, b)]
    assert _ids(llm.generate([a, b, a, b], params)) == alone * 2


def test_cache_salt_never_hits(default_loaded):
    prompt = {"prompt_token_ids": default_loaded.tokenizer.encode(LONG_PROMPT)[:64]}
    params = SamplingParams(temperature=0, max_tokens=2)
    engine = LLMEngine(EngineConfig.from_options(num_pages=60, max_num_seqs=2,
                                                 cache_salt="tenant-a"), default_loaded)

    def run(salt=None):
        engine.add_request(prompt, params, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        return engine.stats()["prefix_cache_hits"]

    assert run() == 0
    # 64 prompt tokens: 3 full pages hit (the 4th page holds the last token, never a hit).
    hits_same_salt = run()
    assert hits_same_salt == 48
    assert run(salt="tenant-b") == hits_same_salt  # another tenant, same pages: no hit
    assert run(salt="tenant-b") == hits_same_salt + 48  # but it hits its own


def test_forks_do_not_see_each_other(default_loaded):
    """n=3 samples share the prompt's pages (copy-on-write on the partial last page). Each fork's
    sampled-token logprobs must equal a fresh scoring of its own text: a sibling's KV writes
    leaking into its pages would change them."""
    tok = default_loaded.tokenizer
    prompt = tok.encode("Once upon a time, in a small village by the sea,")  # not page-aligned
    assert len(prompt) % 16
    llm = make_llm(default_loaded, num_pages=60, max_num_seqs=4, enable_prefix_caching=False)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0,
                                      ignore_eos=True))[0]
    texts = [o.token_ids for o in out.outputs]
    assert len({tuple(t) for t in texts}) > 1, "forks should diverge at temperature 1"
    # Three samples share the partial last prompt page: the first two to write it copy it, the
    # last one then owns it alone; later pages are private.
    assert llm.stats()["num_cow_copies"] == 2
    for o in out.outputs:
        scored = llm.generate([{"prompt_token_ids": prompt + o.token_ids}],
                              SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
        expected = [scored.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(o.token_ids)]
        got = [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
        np.testing.assert_allclose(got, expected, atol=2e-3)


def test_seeded_sampling_independent_of_batch(llm, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=12)
    alone = _ids(llm.generate([prompts[2]], params))[0]
    mixed = _ids(llm.generate([prompts[0], prompts[2], prompts[3]],
                              [GREEDY, params, SamplingParams(temperature=1.0, max_tokens=5)]))
    assert mixed[1] == alone


def test_seeds_past_32_bits_sample_apart(llm, prompts):
    """Seed 2**32 was seed 0 on the device (its low 32 bits); a seed still repeats itself."""
    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
    outs = _ids(llm.generate([prompts[2]] * 3, [params(0), params(2**32), params(0)]))
    assert outs[0] == outs[2] and outs[0] != outs[1]


def test_abort_storm_leaves_no_pages_and_survivors_unchanged(default_loaded):
    rng = random.Random(0)
    words = LONG_PROMPT.split()
    prompts = [" ".join(words[rng.randrange(0, 100):][:rng.randrange(3, 40)]) for _ in range(120)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(EngineConfig.from_options(num_pages=120, max_num_seqs=32,
                                                 max_num_batched_tokens=256), default_loaded)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    doomed = set(rng.sample(ids, 60))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        live = [r for r in doomed if r not in finished]
        for rid in rng.sample(live, min(len(live), rng.randrange(0, 6))):
            assert engine.abort(rid)
            doomed.discard(rid)
            finished.pop(rid, None)
    stats = engine.stats()
    assert stats["referenced_pages"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    survivors = [i for i, rid in enumerate(ids) if rid in finished and rid not in doomed]
    assert len(survivors) >= 60
    reference = make_llm(default_loaded, num_pages=120, max_num_seqs=32)
    sample = survivors[::6]
    expected = _ids(reference.generate([prompts[i] for i in sample], params))
    assert [finished[ids[i]] for i in sample] == expected


def test_async_scheduling_changes_no_output(default_loaded, prompts):
    """Steps planned and launched before the previous one's tokens are read back give the same
    tokens, stop where they should (EOS, stop strings, max_tokens) and leave no page behind."""
    params = [SamplingParams(temperature=0, max_tokens=m, stop=stop, logprobs=2)
              for m, stop in ((40, None), (9, None), (30, ["."]), (25, None), (17, ["the"]))]
    runs = {}
    for flag in (False, True):
        engine = LLMEngine(EngineConfig.from_options(num_pages=200, max_num_seqs=4,
                                                     async_scheduling=flag), default_loaded)
        ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
        finished, steps = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    finished[out.request_id] = (c.token_ids, c.text, c.finish_reason,
                                                [sorted(lp) for lp in c.logprobs])
            steps += 1
            if steps == 12:  # one more, mid-stream, aborted two steps later
                late = engine.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=50))
            if steps == 14:
                assert engine.abort(late.request_id)
        stats = engine.stats()
        assert stats["referenced_pages"] == 0 and stats["pending_free_pages"] == 0
        assert (stats["num_scheduled_ahead"] > 0) == flag
        runs[flag] = [finished[i] for i in ids]
    assert runs[True] == runs[False]
    assert {r[2] for r in runs[True]} >= {"stop", "length"}


@pytest.mark.parametrize("method, k", [("ngram", 2), ("ngram", 5), ("draft", 3)])
def test_speculative_decoding_changes_no_output(default_loaded, prompts, llm, method, k):
    """Prompt lookup, or the model's own weights in int8 as its draft, verified in the step
    (every step: not adaptive) gives the plain greedy tokens, with a prompt the model copies
    from, a small pool and a stop string."""
    copy = {"prompt_token_ids": default_loaded.tokenizer.encode(
        "Repeat exactly: the red fox ran over the green hill and the red fox ran home.")}
    batch = [copy] + prompts[:3]
    params = [SamplingParams(temperature=0, max_tokens=32, stop=stop)
              for stop in (None, None, ["."], None)]
    want = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    draft = {"quantization": "int8"} if method == "draft" else {}
    spec = make_llm(default_loaded, num_pages=12, max_num_seqs=4, speculative_config={
        "method": method, "num_speculative_tokens": k, "adaptive": False, **draft})
    got = [o.outputs[0] for o in spec.generate(batch, params, use_tqdm=False)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["referenced_pages"] == 0


def test_bad_input_is_refused_clearly(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    too_long = {"prompt_token_ids": [5] * (llm.engine.max_model_len + 1)}
    before = llm.stats()
    with pytest.raises(ValueError, match="max_model_len|context|exceeds"):
        llm.generate(["fine", too_long], GREEDY)
    after = llm.stats()
    assert after["waiting"] == before["waiting"] == 0 and after["referenced_pages"] == 0
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(model="smollm2-135m", page_sz=16)


def test_chat_takes_and_checks_what_the_server_does(llm):
    """Issue 54 row 15: content parts and content None (were Jinja errors), tools and
    chat_template_kwargs (were no keywords), a template of the call's own and a prefill to
    continue; a bad field is a ValueError naming it (param) and nothing runs."""
    one = SamplingParams(temperature=0, max_tokens=1)
    plain = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi there"}]
    parts = [{"role": "system", "content": None},
             {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    assert llm.chat(parts, one)[0].prompt == llm.chat(plain, one)[0].prompt
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}{{ style }}|"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    out = llm.chat(plain, one, chat_template=template, tools=tools,
                   chat_template_kwargs={"style": "terse"})
    assert out[0].prompt == "get_time;terse|Hi there"
    prefill = [*plain, {"role": "assistant", "content": "Hello! I"}]
    out = llm.chat(prefill, one, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nHello! I")
    for conversation, kwargs, param in [
            ([{"role": "wizard", "content": "x"}], {}, "messages[0].role"),
            (plain, {"tools": [{"type": "function"}]}, "tools[0].function"),
            (prefill, {"continue_final_message": True}, "continue_final_message"),
            (plain, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            (plain, {"chat_template": "{% if %}"}, "chat_template"),
            ([plain, [{"role": "user", "content": 3}]], {}, "messages[0].content")]:
        with pytest.raises(ValueError) as caught:
            llm.chat(conversation, one, **kwargs)
        assert caught.value.param == param, caught.value
    assert "conversation 1: " in str(caught.value)
    assert llm.stats()["waiting"] == llm.stats()["running"] == 0


def test_stats_report_the_required_fields(llm):
    stats = llm.stats()
    for key in ("total_pages", "free_pages", "cached_pages", "referenced_pages", "running",
                "waiting", "preemptions", "prefix_cache_queries", "prefix_cache_hits",
                "compilations"):
        assert key in stats
    assert stats["free_pages"] + stats["cached_pages"] + stats["referenced_pages"] \
        == stats["total_pages"]
