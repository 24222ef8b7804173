"""A long prompt's chunked prefill beside a decoding stream: every token of a chunk attends the
whole context before it, so at a fixed token budget a chunk deep into a long prompt costs many
times the first one, and the neighbour's inter-token gap with it. The scheduler weighs a chunk's
context (SchedulerConfig.prefill_keys_per_token): checked by hand on the fake model, then timed on
the tiny random model through the AsyncEngine, against the same run's full chunk steps."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from fake_model import (FakeRunner, assert_outputs_match_reference, expected, make_request,
                        make_sched, random_workload, run_to_completion)
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.engine.async_engine import AsyncEngine
from tiny_model import tiny_loaded


def _cost(sched, plan) -> float:
    return sum(c.num_tokens * (1 if c.is_decode else 1 + c.start / sched.budget.keys_per_token)
               for c in plan.chunks)


def test_chunks_shrink_with_their_context_and_outputs_stay_exact():
    sched = make_sched(num_pages=160, max_model_len=1024, max_num_batched_tokens=32,
                       prefill_keys_per_token=64)
    neighbour = make_request("n", [1, 2, 3], max_tokens=200, ignore_eos=True)
    long = make_request("long", [(7 * i) % 50 for i in range(500)], max_tokens=2)
    res = run_to_completion(sched, [(0, neighbour), (2, long)], keep_plans=True,
                            runner=FakeRunner(sched))
    assert res.outputs == expected([neighbour, long])
    chunks = [c for plan in res.plans for c in plan.chunks
              if c.seq.request is long and not c.is_decode]
    assert chunks[0].start == 0 and chunks[0].num_tokens == 31  # a full chunk beside a decode
    # Each chunk is the most the budget left after the decode holds at its context's cost.
    for c in chunks[:-1]:
        assert c.num_tokens == int(31 / (1 + c.start / 64)), (c.start, c.num_tokens)
    assert all(_cost(sched, plan) <= 32 for plan in res.plans)
    assert chunks[-1].num_tokens < 5  # 1 + 500 / 64 budget per token


def test_context_is_free_when_off_and_a_step_always_makes_progress():
    prompt = list(range(40))
    off = make_sched(max_num_batched_tokens=32, prefill_keys_per_token=0)
    off.add_request(make_request("a", prompt))
    assert [c.num_tokens for c in off.schedule().chunks] == [32]
    # A cost above the whole budget still leaves the step's first prefill chunk one token.
    tight = make_sched(max_num_batched_tokens=32, prefill_keys_per_token=1)
    res = run_to_completion(tight, [make_request("a", prompt, max_tokens=1)], keep_plans=True)
    assert [c.num_tokens for p in res.plans for c in p.chunks] == [32, 1, 1, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("seed", range(15))
def test_random_workloads_stay_exact_and_within_the_budget(seed):
    """Preemption, prefix hits, forks, aborts and planning ahead, at a steep context cost."""
    rng = random.Random(seed)
    cfg = dict(page_size=rng.choice([1, 2, 4, 8]), max_num_seqs=rng.randint(1, 6),
               enable_prefix_caching=rng.random() < 0.7, enable_chunked_prefill=True,
               prefill_keys_per_token=rng.choice([1, 3, 16, 64]), watermark=0.0)
    cfg["max_num_batched_tokens"] = rng.randint(max(cfg["max_num_seqs"], 5), 40)
    min_pages = -(-63 // cfg["page_size"]) + 1
    sched = make_sched(num_pages=rng.randint(min_pages + 1, min_pages * 3), max_model_len=64,
                       **cfg)
    reqs, aborts = random_workload(rng, cfg, max_requests=25)
    res = run_to_completion(sched, reqs, abort_at=aborts, ahead=rng.random() < 0.5,
                            keep_plans=True)
    assert_outputs_match_reference(res, reqs, sched)
    for plan in res.plans:  # over the budget only by the one token a step's prefill may take
        first = next((c for c in plan.chunks if not c.is_decode), None)
        floor = first is not None and first.num_tokens == 1
        slack = 1 + first.start / sched.budget.keys_per_token if floor else 0
        assert _cost(sched, plan) <= cfg["max_num_batched_tokens"] + slack + 1e-9


def test_engine_resolves_the_context_cost_from_the_model_and_backend():
    loaded = tiny_loaded()
    engine = LLMEngine(EngineConfig.from_options(num_pages=8, max_num_seqs=2,
                                                 max_num_batched_tokens=32,
                                                 attention_backend="xla"), loaded)
    cfg = loaded.config
    want = round(cfg.flops_per_token() / (4 * cfg.num_heads * cfg.head_dim * cfg.num_layers))
    assert engine.resolved.prefill_keys_per_token == engine.scheduler.budget.keys_per_token == want
    pinned = LLMEngine(EngineConfig.from_options(num_pages=8, max_num_seqs=2,
                                                 max_num_batched_tokens=32,
                                                 attention_backend="xla",
                                                 prefill_keys_per_token=0), loaded)
    assert pinned.scheduler.budget.keys_per_token == 0


# ---- timed: a neighbour's gaps beside a long prompt ---------------------------------------------

BUDGET = 128  # max_num_batched_tokens
LONG = 4096  # the long prompt's tokens
CALIBRATION = 8  # prompts of one full chunk each, at context 0: the run's "chunk step"


async def _neighbour_gaps(aengine: AsyncEngine) -> tuple[list[float], list[float], int]:
    """Stream a neighbour; meanwhile prefill CALIBRATION one-chunk prompts, then a LONG one.
    Returns the neighbour's gaps during each phase and the long prompt's engine steps."""
    engine = aengine.engine
    neighbour = await aengine.add([{"prompt_token_ids": [5, 6, 7]}],
                                  SamplingParams(max_tokens=2000, ignore_eos=True))
    arrivals: list[float] = []

    async def stream():
        async for _, _ in neighbour:
            arrivals.append(time.perf_counter())

    streaming = asyncio.ensure_future(stream())

    async def phase(prompts: list[list[int]]) -> tuple[list[float], int]:
        steps = engine.pipeline.num_steps
        while len(arrivals) < 3:
            await asyncio.sleep(0.005)
        start = time.perf_counter()
        group = await aengine.add([{"prompt_token_ids": p} for p in prompts],
                                  SamplingParams(max_tokens=1))
        async for _ in group:
            pass
        end = time.perf_counter()
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end]
        return during, engine.pipeline.num_steps - steps

    try:
        # Token ids over the whole vocabulary so no prompt shares a page with another.
        calibration, _ = await phase([[(i * 37 + j) % 256 for j in range(BUDGET - 1)]
                                      for i in range(CALIBRATION)])
        long, steps = await phase([[(j * 11 + j // 256) % 256 for j in range(LONG)]])
    finally:
        neighbour.abort()
        streaming.cancel()
    return calibration, long, steps


def test_a_neighbour_streams_within_a_few_chunk_steps_beside_a_long_prompt():
    """The tiny model made attention-heavy (wide heads, narrow MLP), so that a chunk of
    BUDGET tokens at the end of a LONG prompt takes about 15 times one at its start, as the
    default model's last chunks of an 8100-token prompt took 9-15 times its first on the cpu
    backend. The neighbour's gaps while the long prompt prefills (all but the longest 1%) must
    stay within 4 of the same run's full chunk steps (the median gap while one-chunk prompts
    prefill)."""
    loaded = tiny_loaded(max_len=8192, h=256, inter=256, layers=4, heads=8, kv_heads=2, d=64)
    engine = LLMEngine(EngineConfig.from_options(num_pages=600, max_num_seqs=4,
                                                 max_num_batched_tokens=BUDGET), loaded)
    engine.warmup()  # a compile inside the measured window would be a gap of its own
    aengine = AsyncEngine(engine)
    try:
        calibration, long, steps = asyncio.run(_neighbour_gaps(aengine))
    finally:
        aengine.shutdown()
    chunk_step = statistics.median(calibration)
    longest = max(long)
    summary = (f"chunk step (median of {len(calibration)}) {chunk_step * 1e3:.1f} ms; "
               f"beside the long prompt: {len(long)} gaps, {steps} steps, median "
               f"{statistics.median(long) * 1e3:.1f} ms, longest {longest * 1e3:.1f} ms")
    print(summary)
    assert len(long) >= LONG // BUDGET, summary  # it streamed throughout, chunk by chunk
    # All but the longest 1% of gaps: one stall of a loaded machine (359 ms beside 7.5 ms steps
    # at load 10) is not the engine's; chunks grown slow with their context would be a run of
    # long gaps (the last third of the prompt's chunks), and a prompt prefilled whole, one gap.
    nearly_longest = sorted(long)[-1 - len(long) // 100]
    assert nearly_longest <= 4 * chunk_step, summary
