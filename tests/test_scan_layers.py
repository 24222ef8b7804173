"""scan_layers (jaxserve/model/layer_scan.py): the layers run by lax.scan over stacked weights
give the unrolled model's greedy tokens on the cpu and xla backends, through batching, chunked
prefill, prefix-cache hits and copy-on-write page copies, for a uniform model and for one whose
layers alternate sliding-window and full attention with a local rope base (a pattern of period
2 scanned in blocks, and a layer past the last block unrolled). The abstract params and pool of
`jaxserve compile` match a scanned runner's, and a scanned step compiles for a TPU target."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import backends
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config.resolved import resolve_scan_layers
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.model import layer_scan
from jaxserve.runtime import abstract
from jaxserve.runtime.runner import ModelRunner
from jaxserve.weights.random_init import random_model
from tiny_model import tiny_loaded

SLIDING, FULL = "sliding_attention", "full_attention"


def _windowed():
    """Five layers, sliding (window 6, rope base 1000) and full alternating: period 2."""
    loaded = tiny_loaded(seed=3, layers=5)
    cfg = dataclasses.replace(loaded.config, sliding_window=6, rope_local_theta=1000.0,
                              layer_types=(SLIDING, FULL, SLIDING, FULL, SLIDING))
    return dataclasses.replace(loaded, config=cfg)


MODELS = {"uniform": lambda: tiny_loaded(seed=1, layers=4), "windowed": _windowed}
# Prompts sharing a 24-token prefix (prefix hits, one ending mid-page), one long enough for
# several chunks of 16 tokens, and a fork (n=2) whose pages are shared then copied.
PREFIX = "the shared part of it. "


def _run(engine: LLMEngine) -> tuple[dict, int]:
    """request id -> each sample's greedy tokens; and the prompt tokens found cached."""
    first = ["a" * 40 + "b", PREFIX + "one", "xyz"]
    second = [PREFIX + "two", PREFIX + "th", PREFIX[:10]]
    out, cached = {}, 0
    for wave in (first, second):  # the second wave finds the first's pages cached
        for i, p in enumerate(wave):
            engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0,
                                                 ignore_eos=True, n=2 if i == 0 else 1))
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None
                if o.finished:
                    out[o.request_id] = [list(c.token_ids) for c in o.outputs]
                    cached += o.num_cached_tokens
    return out, cached


def _engine(loaded, backend: str, scan: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_options(
        num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
        attention_backend=backend, scan_layers=scan, huge_pages=False), loaded)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_scanned_layers_give_the_unrolled_greedy_tokens(model, backend):
    loaded = MODELS[model]()
    if backend == "cpu":
        try:
            backends.resolve("cpu")
        except ValueError as e:
            pytest.skip(str(e))
    outputs = {}
    for scan in ("off", "on"):
        engine = _engine(loaded, backend, scan)
        assert engine.resolved.scan_layers == (scan == "on")
        assert layer_scan.is_scanned(engine.runner.params) == (scan == "on")
        outputs[scan], cached = _run(engine)
        assert cached >= 2 * 20  # two of the second wave's prompts hit the first's pages
    assert outputs["on"] == outputs["off"] and len(outputs["on"]) == 6


def test_layers_are_grouped_by_their_window_pattern():
    cfg = _windowed().config
    assert layer_scan.period(cfg) == 2
    assert layer_scan.period(tiny_loaded(layers=4).config) == 1
    layers = [{"w": np.full((2, 3), i)} for i in range(cfg.num_layers)]
    grouped = layer_scan.group_layers(layers, cfg, np.stack)
    assert [g["w"][:, 0, 0].tolist() for g in grouped["stacked"]] == [[0, 2], [1, 3]]
    assert [lp["w"][0, 0] for lp in grouped["rest"]] == [4]


def test_auto_is_chosen_per_backend_and_on_off_are_kept():
    assert resolve_scan_layers("on", "cpu") and not resolve_scan_layers("off", "pallas-tpu")
    assert resolve_scan_layers("auto", "pallas-tpu")
    with pytest.raises(ValueError, match="scan_layers"):
        EngineConfig.from_options(scan_layers="yes")


TPU_MODEL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                        eos_token_ids=(1,))


@pytest.fixture(scope="module")
def tpu_runner():
    return ModelRunner(TPU_MODEL, random_model(TPU_MODEL).params, num_pages=8, page_size=16,
                       dtype="bfloat16", backend=backends.get("pallas-tpu-interpret"),
                       scan_layers=True)


def test_abstract_params_and_pool_are_the_scanned_runners(tpu_runner):
    shapes = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)  # noqa
    placed = abstract.abstract_params(TPU_MODEL, tpu_runner.mesh, "bfloat16", scan_layers=True)
    assert shapes(placed) == shapes(tpu_runner.params)
    pool = abstract.abstract_pool(TPU_MODEL, tpu_runner.mesh, 8, 16, "bfloat16",
                                  tpu_runner.backend, "bfloat16", scan_layers=True)
    assert shapes(pool) == shapes(tpu_runner.pool) and len(pool.layers) == 1
