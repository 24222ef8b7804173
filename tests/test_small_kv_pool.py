"""A KV pool much smaller than the work: n > 1 forks that fit the pool one at a time complete
(preempted and recomputed) with the outputs of a big pool; a request whose max_tokens can never
fit is refused with the pages it needs; one bounded only by the context ends at the pool with
"length" and is reported, never left hanging. Uses the tiny random model (tests/tiny_model.py)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server.protocol import ProtocolContext, parse_request
from tiny_model import tiny_loaded, tiny_tokenizer

FORK_PROMPT = "the cat sat on the mat " * 3  # 69 byte tokens
OTHER_PROMPT = "hello world"  # 11 byte tokens


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def engines(loaded):
    """(page size, pages) -> LLM, built once per module."""
    made = {}

    def get(page_size: int, num_pages: int) -> LLM:
        if (page_size, num_pages) not in made:
            made[page_size, num_pages] = LLM.from_engine(LLMEngine(EngineConfig.from_options(
                num_pages=num_pages, page_size=page_size, max_num_seqs=4,
                max_num_batched_tokens=16, attention_backend="xla"), loaded))  # few shapes
        return made[page_size, num_pages]

    return get


def greedy(max_tokens, n=1):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([[c.token_ids for c in o.outputs] for o in outs],
            [[c.finish_reason for c in o.outputs] for o in outs])


def assert_clean(llm):
    stats = llm.stats()
    assert not llm.engine.has_unfinished()
    assert stats["referenced_pages"] == 0 and stats["running"] == stats["waiting"] == 0
    llm.engine.scheduler.check_invariants()


# (page size, pages incl. scratch, fork prompt, n, max_tokens): one sequence fits the pool
# (prompt + max_tokens - 1 tokens of KV), the n forks together do not. The forks' isolation
# (copy-on-write) is checked with forks that differ on the fake model (test_scheduler.py).
FITS = [(8, 24, FORK_PROMPT, 2, 110),  # 178 of 184 slots per fork
        (4, 8, OTHER_PROMPT, 4, 17)]  # 27 of 28 slots per fork


@pytest.mark.parametrize("page_size,num_pages,prompt,n,max_tokens", FITS)
def test_forks_that_fit_one_at_a_time_match_a_big_pool(engines, page_size, num_pages, prompt, n,
                                                        max_tokens):
    prompts = [prompt, OTHER_PROMPT]
    params = [greedy(max_tokens, n), greedy(6)]  # a plain request alongside the forks
    want = run(engines(page_size, 400), prompts, params)
    small = engines(page_size, num_pages)
    before = small.stats()["preemptions"]
    got = run(small, prompts, params)
    assert got == want
    assert got[1] == [["length"] * n, ["length"]]
    assert small.stats()["preemptions"] > before
    assert_clean(small)


def test_max_tokens_the_pool_can_never_hold_is_refused_with_the_pages(engines):
    small = engines(8, 24)  # 23 usable pages of 8 tokens
    with pytest.raises(ValueError, match=r"prompt of 69 tokens \+ max_tokens 150 needs 28 pages "
                                         r"of 8 tokens per sequence but the KV pool has 23"):
        run(small, [FORK_PROMPT], greedy(150, n=2))  # 69 + 150 - 1 = 218 slots of KV
    assert_clean(small)
    assert run(small, [OTHER_PROMPT], greedy(6)) == run(engines(8, 400), [OTHER_PROMPT], greedy(6))


@pytest.mark.parametrize("n", [1, 2])
def test_up_to_the_context_ends_at_the_pool_with_length(engines, n):
    """max_tokens=None: the pool (28 slots) is shorter than the context (256), so each sequence
    ends, reported, when its next token's KV no longer fits: 28 - 11 + 1 = 18 tokens."""
    small = engines(4, 8)
    got = run(small, [OTHER_PROMPT], greedy(None, n))
    assert got == run(engines(4, 400), [OTHER_PROMPT], greedy(18, n))
    assert got[1] == [["length"] * n]
    assert_clean(small)


@pytest.mark.parametrize("limit,body,want", [
    (None, {}, None),  # chat's default, the context left: the engine bounds it (the pool too)
    (None, {"max_tokens": 40}, 40),  # asked for: the pool must hold it or it is refused
    (8, {}, 8),  # the server's limit is asked for in the client's stead
    (300, {}, None)])
def test_chat_up_to_the_context_is_not_refused_for_a_small_pool(limit, body, want):
    ctx = ProtocolContext(model_names=("tiny",), tokenizer=tiny_tokenizer(), max_model_len=256,
                          vocab_size=320, max_tokens_limit=limit)
    messages = [{"role": "user", "content": "hi"}]
    parsed = parse_request("chat", {"model": "tiny", "messages": messages, **body}, ctx)
    assert parsed.params.max_tokens == want
