"""The memory plan (engine/memory_plan.py): one budget in, weights + activation peak + runtime +
margin + KV pool out, never more than the budget; the process's peak growth under a workload
that fills the pool (with preemptions) stays inside it; int8 KV pages multiply the pages."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.engine.memory_plan import MARGIN, largest_shape
from jaxserve.runtime import memory
from jaxserve.runtime.runner import release_compiled_steps
from jaxserve.weights.random_init import random_model
from tiny_model import tiny_loaded

GIB = 2 ** 30
MIB = 2 ** 20


def wide_loaded():
    """The tiny model with wide KV (8 KV heads of 64: 8 KiB per token over its 2 layers), so a
    pool of a few hundred MiB fills in seconds."""
    base = tiny_loaded()
    cfg = dataclasses.replace(base.config, num_heads=8, num_kv_heads=8, head_dim=64,
                              max_position_embeddings=4096)
    return dataclasses.replace(random_model(cfg, seed=0), tokenizer=base.tokenizer)


@pytest.mark.parametrize("options, message", [
    (dict(memory_utilization=float("nan")), "memory_utilization must be in (0, 1]"),
    (dict(memory_utilization=0.0), "memory_utilization must be in (0, 1]"),
    (dict(memory_utilization=1.5), "memory_utilization must be in (0, 1]"),
    (dict(memory_budget_bytes=0), "memory_budget_bytes must be > 0"),
    (dict(memory_budget_bytes=GIB, memory_utilization=0.5), "not both"),
])
def test_bad_budgets_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_options(**options)


def test_accelerators_default_to_a_utilization_and_the_cpu_to_a_pool_size():
    assert CacheConfig().planned_utilization("gpu") == 0.9
    assert CacheConfig().planned_utilization("cpu") is None
    assert CacheConfig(num_pages=64).planned_utilization("tpu") is None  # an override
    assert CacheConfig(memory_utilization=0.5).planned_utilization("cpu") == 0.5


def test_a_budget_below_the_weights_and_one_step_names_the_minimum():
    with pytest.raises(ValueError, match=r"the minimum is (\d+) bytes") as e:
        LLMEngine(EngineConfig.from_options(memory_budget_bytes=64 * MIB), wide_loaded())
    minimum = int(e.value.args[0].split("the minimum is ")[1].split()[0])
    assert minimum > 64 * MIB


@pytest.mark.parametrize("name", ["memory_budget_bytes", "kv_cache_bytes"])
def test_more_memory_than_the_device_holds_is_refused_before_allocating(name):
    """1e15 bytes: a one-line ValueError naming the request and the memory there is (it was an
    out-of-memory traceback from allocating the pool)."""
    with pytest.raises(ValueError, match=rf"{name}={10**15} .* holds: {memory.capacity()} bytes"):
        LLMEngine(EngineConfig.from_options(**{name: 10**15}), tiny_loaded())


def test_num_pages_overrides_the_budget():
    engine = LLMEngine(EngineConfig.from_options(memory_budget_bytes=GIB, num_pages=40),
                       wide_loaded())
    assert engine.memory_plan is None and engine.num_pages == 40
    assert engine.stats()["activation_peak_bytes"] is None


def test_a_draft_model_pays_its_weights_and_pages_from_the_budget():
    """Speculative method "draft" with the target as its own draft: the plan counts both
    models' weights and both pools' pages (as many pages each), and the engine serves greedy
    tokens equal to plain decoding from the planned pools."""
    loaded, budget = wide_loaded(), 512 * MIB
    options = dict(memory_budget_bytes=budget, page_size=16, max_num_seqs=4,
                   max_num_batched_tokens=128)
    plain = LLMEngine(EngineConfig.from_options(**options), loaded)
    spec = {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}
    drafted = LLMEngine(EngineConfig.from_options(speculative_config=spec, **options), loaded,
                        draft_loaded=loaded)
    p, d = plain.memory_plan, drafted.memory_plan
    assert d.weight_bytes == 2 * p.weight_bytes and d.page_bytes == 2 * p.page_bytes
    assert d.planned_bytes + d.margin_bytes <= budget
    stats = drafted.stats()
    assert stats["draft_kv_pool_bytes"] == stats["kv_pool_bytes"] == d.kv_pool_bytes // 2
    assert drafted.num_pages == drafted.scheduler.pool.num_pages == d.num_pages
    prompts = [list(range(5, 40)), list(range(100, 117)) * 3]
    for engine in (plain, drafted):
        for i, ids in enumerate(prompts):
            engine.add_request({"prompt_token_ids": ids}, SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True), request_id=str(i))
    tokens = []
    for engine in (plain, drafted):
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] = o.outputs[0].token_ids
        tokens.append(out)
    assert tokens[0] == tokens[1] and len(tokens[0]["1"]) == 24
    assert drafted.stats()["spec_accepted_tokens"] > 0


def test_the_activation_peak_does_not_depend_on_the_pool_size():
    """The plan reads the largest step's temporaries on a 2-page probe pool and then sizes the
    pool: valid only because a step's temporaries do not grow with the pool."""
    engine = LLMEngine(EngineConfig.from_options(num_pages=8, page_size=16, max_num_seqs=8,
                                                 max_num_batched_tokens=128), wide_loaded())
    shape = largest_shape(engine.buckets, 16)
    small = engine.runner.step_temp_bytes(shape, engine.buckets)
    engine.runner.reset_pool(300)
    assert engine.runner.step_temp_bytes(shape, engine.buckets) == small > 0


def test_a_full_pool_at_the_largest_chunk_stays_inside_the_plan():
    """256 MiB: the plan stays inside it, and a workload that fills the pool (more prompt
    tokens than it holds: preemptions) at the largest chunk grows the process's peak memory
    (resident set) by at most 25% beyond the budget: the plan predicts the memory of the step
    shapes it has not compiled yet from a few it has, and a compile's growth is noisy."""
    loaded = wide_loaded()
    budget = 256 * MIB
    before = memory.in_use()
    # Chunks count their tokens alone (prefill_keys_per_token=0): every prefill step is the
    # largest chunk, however deep into its prompt.
    engine = LLMEngine(EngineConfig.from_options(
        memory_budget_bytes=budget, page_size=16, max_num_seqs=16, max_num_batched_tokens=512,
        enable_prefix_caching=False, prefill_keys_per_token=0), loaded)
    plan = engine.memory_plan
    assert plan.planned_bytes + plan.margin_bytes <= budget
    assert plan.margin_bytes == int(MARGIN * budget)
    assert engine.stats()["kv_pool_bytes"] == plan.kv_pool_bytes
    assert engine.stats()["activation_peak_bytes"] == plan.activation_peak_bytes > 0
    rng = np.random.default_rng(0)
    slots = (plan.num_pages - 1) * plan.page_size
    prompt_len = slots // 14
    output_len = prompt_len // 6  # 16 running sequences outgrow the pool
    for _ in range(math.ceil(1.2 * slots / prompt_len)):  # 20% more prompt than it holds
        engine.add_request({"prompt_token_ids": rng.integers(0, 300, prompt_len).tolist()},
                           SamplingParams(temperature=0, max_tokens=output_len,
                                          ignore_eos=True))
    memory.reset_peak()
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["peak_referenced_pages"] >= 0.9 * (plan.num_pages - 1)
    assert memory.peak() - before <= 1.25 * budget
    assert stats["referenced_pages"] == 0


@pytest.fixture
def cold_compilation_cache(tmp_path):
    """An empty persistent compilation cache and no compiled steps in memory: a step shape
    loaded from the cache keeps about twice the memory of one compiled afresh (XLA's CPU
    executables as deserialized), so plans compared with each other must start alike."""
    from jax._src import compilation_cache

    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    release_compiled_steps()
    yield
    release_compiled_steps()
    jax.config.update("jax_compilation_cache_dir", old)
    compilation_cache.reset_cache()


@pytest.mark.slow
def test_three_gib_on_the_default_model(default_loaded, cold_compilation_cache):
    """A 3 GiB budget: the plan fills at least 85% of it and never more, and with int8 KV it
    holds at least 3.5x the pages of float32. An int8 page (its scales counted) takes 1/3.76 of
    a float32 page; the rest of the budget must then cost the two alike: on the CPU the
    compiled step shapes are device memory, and the backend's write_kv keeps int8's quantizing
    writes out of them (docs/memory.md gives the measured plans)."""
    budget = 3 * GIB
    plans = {}
    for kv in ("float32", "int8"):
        release_compiled_steps()
        engine = LLMEngine(EngineConfig.from_options(memory_budget_bytes=budget, kv_cache_dtype=kv),
                           default_loaded)
        plan = plans[kv] = engine.memory_plan
        assert 0.85 * budget <= plan.planned_bytes <= budget - plan.margin_bytes
        assert engine.stats()["kv_pool_bytes"] == plan.kv_pool_bytes
        del engine
    f32, int8 = plans["float32"], plans["int8"]
    cfg = default_loaded.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads
    assert f32.page_bytes == per_token * f32.page_size * cfg.head_dim * 4
    assert int8.page_bytes == per_token * int8.page_size * (cfg.head_dim + 4)  # f32 scales
    assert int8.num_pages >= 3.5 * f32.num_pages
