"""Compilations are bounded by the buckets: a full warm-up compiles every step shape the scheduler
can produce, after which traffic compiles nothing. Uses a tiny random model (fast compiles)
with the default model's tokenizer."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.weights import LoadedModel

# The model is tiny, but its tokenizer comes from the loaded default model (default_loaded).
pytestmark = pytest.mark.slow


def tiny_loaded(tokenizer) -> LoadedModel:
    cfg = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_ids=(2,))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    layers = {"attn_norm": np.ones((2, 32), np.float32), "mlp_norm": np.ones((2, 32), np.float32),
              "wq": w(2, 32, 32), "wk": w(2, 32, 16), "wv": w(2, 32, 16), "wo": w(2, 32, 32),
              "w_gate": w(2, 32, 48), "w_up": w(2, 32, 48), "w_down": w(2, 48, 32)}
    params = {"embed": w(49152, 32), "final_norm": np.ones(32, np.float32), "layers": layers}
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, fingerprint="tiny",
                       source="test")


# "xla" splits decode rows from query-block-aligned prefill chunks; "cpu" packs every chunk.
BACKENDS = ["xla", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_warmup_then_traffic_compiles_nothing(default_loaded, backend, caplog):
    loaded = tiny_loaded(default_loaded.tokenizer)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        engine = LLMEngine(EngineConfig.from_options(num_pages=80, max_num_seqs=4,
                                                     max_num_batched_tokens=32, page_size=8,
                                                     attention_backend=backend), loaded)
        report = engine.warmup(full=True)
    assert report["compilations"] == engine.stats()["compilations"] > 0
    # The start-up timeline: a line for each shape (compiled, or loaded from JAX's cache).
    shapes = [r.message for r in caplog.records if r.message.startswith("start-up: step of")]
    assert len(shapes) == report["shapes"] - len(engine.buckets.copies)
    assert all(" compiled in " in m or " loaded from the compilation cache " in m
               for m in shapes), shapes
    stats = engine.stats()
    assert report["seconds"] < stats["start_seconds"] < stats["process_start_seconds"]
    rng = np.random.default_rng(1)
    for i in range(12):  # mixed lengths: decode, chunked prefill and mixed steps all occur
        prompt = [int(t) for t in rng.integers(3, 1000, int(rng.integers(1, 70)))]
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12))))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 10
    assert engine.stats()["compilations"] == report["compilations"]


def test_full_warmup_covers_every_packed_shape(default_loaded):
    """Every (rows, tokens) a packed step can have: r chunks of n tokens in all, r <= n <= the
    budget. Rows and tokens pad to buckets of different spacing (3 rows in the 3-token bucket
    are 4 rows), so each pair is checked, not only the buckets' corners."""
    from jaxserve.core.sequence import Request, Sequence
    from jaxserve.core.step_plan import ScheduledChunk, StepPlan
    from jaxserve.runtime.batch import build_batch
    from jaxserve.runtime.runner import _signature

    engine = LLMEngine(EngineConfig.from_options(num_pages=80, max_num_seqs=6,
                                                 max_num_batched_tokens=40, page_size=8,
                                                 attention_backend="cpu"),
                       tiny_loaded(default_loaded.tokenizer))
    engine.warmup(full=True)
    dummy = Request("probe", [0], SamplingParams(temperature=0))
    missing = []
    for rows in range(1, 7):
        for tokens in range(rows, 41):
            plan = StepPlan()
            for i in range(rows):
                n = tokens // rows + (i < tokens % rows)
                seq = Sequence(-1, dummy, [0] * n, 1, page_ids=[0] * engine.buckets.pages)
                plan.chunks.append(ScheduledChunk(seq, 0, n, [seq]))
            batch, _, _ = build_batch(plan, engine.buckets, 8)
            if _signature(batch) not in engine.runner._signatures:
                missing.append((rows, tokens))
    assert not missing


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_warmup_covers_pure_decode_and_prefill(default_loaded, backend):
    loaded = dataclasses.replace(tiny_loaded(default_loaded.tokenizer))
    engine = LLMEngine(EngineConfig.from_options(num_pages=40, max_num_seqs=2,
                                                 max_num_batched_tokens=16, page_size=8,
                                                 attention_backend=backend), loaded)
    report = engine.warmup()
    if backend == "xla":
        # decode-only for 1 and 2 rows; prefill-only for 16 tokens and for the top bucket (48)
        # that holds the budget plus the query-block alignment padding of every row
        assert engine.buckets.tokens == (16, 48)
        step_shapes = 4
    else:
        # packed: one shape per token bucket 1..16 (powers of two and the sizes halfway
        # between), its rows padded to the bucket the tokens imply (Buckets.packed_rows)
        assert engine.buckets.tokens == (1, 2, 3, 4, 6, 8, 12, 16)
        assert engine.buckets.step_shapes(8) == [(0, t, 1 if t == 1 else 2)
                                                 for t in engine.buckets.tokens]
        step_shapes = 8
    # plus the copy-on-write page copies, one shape per copies bucket (4 and 32)
    assert engine.buckets.copies == (4, 32)
    shapes = step_shapes + 2
    # and the sampling call chained after the step (runner.sample_rows) for each count of
    # sample rows (1 and 2) in each of 3 sampling modes, without and with logit controls
    compiled = shapes + 2 * 3 * 2
    assert report == {**report, "shapes": shapes, "compilations": compiled}
    engine.add_request({"prompt_token_ids": [5] * 10}, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["compilations"] == compiled  # traffic compiled nothing more


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_warmup_with_a_budget_above_max_model_len(default_loaded, backend):
    """Token buckets larger than one sequence can hold: a 36-token prompt (three 16-token query
    blocks, 48 slots) lands alone in the 64-token bucket, which no single row fills; the full
    warm-up covers that shape and traffic then compiles nothing."""
    loaded = tiny_loaded(default_loaded.tokenizer)
    engine = LLMEngine(EngineConfig.from_options(num_pages=80, max_num_seqs=4, page_size=8,
                                                 max_num_batched_tokens=64, max_model_len=40,
                                                 attention_backend=backend), loaded)
    assert engine.buckets.pages * 8 < engine.buckets.tokens[-1]
    report = engine.warmup(full=True)
    rng = np.random.default_rng(2)
    lengths = [36] + [int(n) for n in rng.integers(1, 36, 9)]
    for n in lengths:
        prompt = [int(t) for t in rng.integers(3, 1000, n)]
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 5))))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["compilations"] == report["compilations"]


def test_release_compiled_steps_frees_their_memory_mappings(default_loaded):
    """Each compiled step holds memory mappings (the process limit is vm.max_map_count);
    releasing the compiled steps gives them back, and the engine still runs afterwards."""
    import gc
    import sys

    from jaxserve.runtime.runner import release_compiled_steps

    if not sys.platform.startswith("linux"):
        pytest.skip("counts /proc/self/maps")

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    release_compiled_steps()
    gc.collect()
    before = maps()
    engine = LLMEngine(EngineConfig.from_options(num_pages=40, max_num_seqs=4,
                                                 max_num_batched_tokens=32, page_size=8),
                       tiny_loaded(default_loaded.tokenizer))
    engine.warmup()
    compiled = maps()
    assert compiled > before + 20
    release_compiled_steps()
    gc.collect()
    assert maps() < compiled - 20
    engine.add_request({"prompt_token_ids": [5] * 10}, SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
