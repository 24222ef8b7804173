"""Mistral, Gemma, Gemma 2 and Gemma 3 (text) match transformers on tiny seeded checkpoints
(tests/hf_families.py), f32, pages of 8 and prefill chunks of 32 crossing the sliding window:
logits within 1e-4 through the step function on the xla and cpu backends, and the engine's greedy
tokens equal to transformers' greedy ones, with prefix-cache hits and preemption. For Mistral
(every layer windowed) the engine releases pages outside the window: a long generation holds a
window's pages, not its length's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_families import (FAMILIES, WINDOW, chunks_then_decode_logits_match,  # noqa: E402
                         crossing_chunk_logits_match, family_loaded, family_model,
                         greedy_reference)
from skips import need_backend  # noqa: E402
from jaxserve.backends.cpu import kernels as cpu_kernels  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402

PAGE = 8
CHUNK = 32


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, backend):
    """Two prefill chunks of 32 (the second crossing the window of 12 many times over), then
    decode steps. Where every layer is windowed (Mistral) the pages before the window are taken
    out of the page table (the scratch page 0 instead), as the KV manager releases them."""
    need_backend(backend)
    model, cfg, params = family_model(family)
    seq = chunks_then_decode_logits_match(model, cfg, params, backend, num_pages=64,
                                          pages_per_table=12, decode_steps=5,
                                          release_window=True)
    if cfg.kv_window is not None:
        assert seq.page_ids[:5] == [0] * 5  # keys 0..39 lie before position 68's window


@pytest.mark.parametrize("family,backend", [("gemma2", "pallas-tpu-interpret"),
                                            ("gemma2", "pallas-gpu-interpret")])
def test_pallas_kernels_in_the_model_match_transformers(family, backend):
    """The Pallas kernels (interpreted) in Gemma 2's step: a sliding and a full layer,
    soft-capped scores; a chunk of 16 after 8 tokens crosses the window, then a decode step."""
    model, cfg, params = family_model(family)
    crossing_chunk_logits_match(model, cfg, params, backend,
                                [[5, 2, 7, 1], [9, 3, 11, 4]])  # two layer groups


def _engine(family, backend, **options):
    config = EngineConfig.from_options(page_size=PAGE, max_num_batched_tokens=CHUNK,
                                       max_num_seqs=4, attention_backend=backend, **options)
    return LLM.from_engine(LLMEngine(config, family_loaded(family)))


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_mistral_window_releases_pages_and_keeps_greedy_parity(backend):
    """A 40-token prompt and 80 greedy tokens in a pool of 9 usable pages: without releasing
    pages before the window the sequence would need 15. Tokens equal transformers' greedy ones;
    the peak is what a window and a chunk span."""
    need_backend(backend)
    llm = _engine("mistral", backend, num_pages=10)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 211, 40)]
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(80), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy_reference("mistral", prompt, 80)
    scheduler = llm.engine.scheduler
    bound = -(-(WINDOW - 1 + CHUNK) // PAGE) + 1  # 7 pages: a window's keys and a chunk
    assert scheduler.kv.peak_referenced_pages <= bound < -(-120 // PAGE)
    assert scheduler.counters["num_preempted_total"] == 0
    scheduler.check_invariants()


def test_mistral_window_with_prefix_hits_and_preemption():
    """Requests sharing a 48-token prefix (cached pages, some of them before a later request's
    window) in a pool of 8 usable pages, too few for all three at once: preemption recomputes
    from token 0.
    Every output equals transformers' greedy one."""
    llm = _engine("mistral", "cpu" if cpu_kernels.available() else "xla", num_pages=9)
    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(3, 211, 48)]
    prompts = [prefix + [int(t) for t in rng.integers(3, 211, n)] for n in (5, 17, 30)]
    llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(4), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(40), use_tqdm=False)
    counters = llm.engine.scheduler.counters
    assert counters["prefix_cache_hits"] >= 4 * PAGE and counters["num_preempted_total"] > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == greedy_reference("mistral", prompt, 40)
    llm.engine.scheduler.check_invariants()


def test_mistral_window_with_draft_speculation():
    """Speculative method "draft" on a model that releases pages before its window: the
    target's own weights as the draft read only inside the window too, so its KV past the
    released pages stays valid and every draft is accepted; tokens equal transformers' greedy
    ones in the pool of 9 usable pages. A draft that attends its whole context would read the
    released pages: refused at startup by name."""
    spec = {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}
    llm = _engine("mistral", "cpu" if cpu_kernels.available() else "xla", num_pages=10,
                  speculative_config=spec)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 211, 40)]
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(80), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy_reference("mistral", prompt, 80)
    st = llm.stats()
    assert st["spec_draft_tokens"] > 40 and st["spec_accepted_tokens"] == st["spec_draft_tokens"]
    llm.engine.scheduler.check_invariants()

    loaded = family_loaded("mistral")
    full = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config,
                                                                  sliding_window=None))
    config = EngineConfig.from_options(page_size=PAGE, max_num_batched_tokens=CHUNK,
                                       max_num_seqs=4, num_pages=10, speculative_config=spec)
    with pytest.raises(ValueError, match="draft model must then be windowed"):
        LLMEngine(config, loaded, draft_loaded=full)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_greedy_generation_matches_transformers(family):
    """The engine (auto backend: the C++ kernels on a CPU that has them) keeps every page of a
    mixed local/global model and generates transformers' greedy tokens past the window, for
    requests sharing a cached 40-token prefix in a pool too small for all three (preemption)."""
    # Gemma 2/3: pages of one layer group (half the layers); 18 of them hold 9 pages' bytes of
    # Gemma, where a sliding group's pages go before its window (fits all three with 24)
    llm = _engine(family, "auto", num_pages=13 if family == "gemma" else 19)
    rng = np.random.default_rng(4)
    prefix = [int(t) for t in rng.integers(3, 211, 40)]
    prompts = [prefix + [int(t) for t in rng.integers(3, 211, n)] for n in (3, 9, 17)]
    llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(2), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == greedy_reference(family, prompt, 12)
    counters = llm.engine.scheduler.counters
    assert counters["prefix_cache_hits"] >= 4 * PAGE and counters["num_preempted_total"] > 0
    assert None in llm.engine.scheduler.kv.windows  # a group of full layers keeps every page


def test_unknown_architectures_and_options_are_refused_by_name():
    from jaxserve.weights import config_from_hf

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4)
    for config, message in (
            ({"architectures": ["Gemma3nForCausalLM"]}, "Gemma3nForCausalLM"),
            ({"architectures": ["GemmaForCausalLM"], "hidden_act": "relu"}, "'relu'"),
            ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
             "use_bidirectional_attention"),
            ({"architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
              "rope_parameters": {"full_attention": {"rope_type": "default"},
                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
             "sliding layers"),
            ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8,
              "layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention")):
        with pytest.raises(ValueError, match=message):
            config_from_hf({**base, **config})
