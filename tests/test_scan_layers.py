"""scan_layers (jaxserve/model/layer_scan.py): the layers run by lax.scan over stacked weights
give the unrolled model's greedy tokens on the cpu and xla backends, through batching, chunked
prefill, prefix-cache hits and copy-on-write page copies, for a uniform model (cpu) and for one
whose layers alternate sliding-window and full attention with a local rope base (xla: a pattern
of period 2 scanned in blocks, and a layer past the last block unrolled; also at TP 2). The
abstract params and pool of `jaxserve compile` match a scanned runner's, and a scanned step
compiles for a TPU target."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

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
from jaxserve.runtime.batch import build_batch, warmup_plan
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.runner import ModelRunner, jitted_step
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
# several chunks of 8 tokens, and a fork (n=2) whose pages are shared then copied.
PREFIX = "the shared part of it. "


def _run(engine: LLMEngine) -> tuple[dict, int]:
    """request id -> each sample's greedy tokens; and the prompt tokens found cached."""
    first = ["a" * 40 + "b", PREFIX + "one", "xyz"]
    second = [PREFIX + "two", PREFIX + "th", PREFIX[:10]]
    out, cached, copies = {}, 0, []
    real_copy = engine.runner._copy_local
    engine.runner._copy_local = lambda src, dst: (copies.append(len(src)), real_copy(src, dst))
    for wave in (first, second):  # the second wave finds the first's pages cached
        for i, p in enumerate(wave):
            engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0,
                                                 ignore_eos=True, n=2 if i == 0 else 1))
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None
                if o.finished:
                    out[o.request_id] = [list(c.token_ids) for c in o.outputs]
                    cached += o.num_cached_tokens
    assert copies  # the fork's shared last page, copied on write
    return out, cached


def _engine(loaded, backend: str, scan: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_options(
        num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
        attention_backend=backend, scan_layers=scan, huge_pages=False), loaded)


# The window pattern's blocks are the model layer's, alike on every backend: one model each.
@pytest.mark.parametrize("backend, model", [("cpu", "uniform"), ("xla", "windowed")])
def test_scanned_layers_give_the_unrolled_greedy_tokens(backend, model):
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


# Run in a subprocess: the device count is fixed before JAX starts.
_TP_CASE = """
import dataclasses, json, sys
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
sys.path.insert(0, sys.argv[1])
from test_scan_layers import _windowed
out = {}
for scan in ("off", "on"):
    e = LLMEngine(EngineConfig.from_options(num_pages=32, page_size=4, max_num_seqs=1,
        max_num_batched_tokens=8, attention_backend="xla", tensor_parallel_size=2,
        scan_layers=scan, huge_pages=False), _windowed())
    e.add_request("the shared one", SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True))  # 2 prefill chunks
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                out.setdefault(scan, {})[o.request_id] = list(o.outputs[0].token_ids)
w = e.runner.params["layers"]["stacked"][0]["w_qkv"]
print(json.dumps({"out": out, "spec": list(w.sharding.spec),
                  "pool": list(e.runner.pool.layers[0].k.sharding.spec)}))
"""


def test_tensor_parallel_scanned_layers_give_the_unrolled_tokens():
    """TP 2 on two virtual CPU devices: the stacked weights keep their column sharding behind
    an unsharded layer axis, the one pool its head sharding."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _TP_CASE, here], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"]["on"] == result["out"]["off"] and len(result["out"]["on"]) == 1
    assert result["spec"] == [None, "tp"] and result["pool"] == ["tp"]


def test_layers_are_grouped_by_their_window_pattern():
    cfg = _windowed().config
    assert layer_scan.period(cfg) == 2
    assert layer_scan.period(tiny_loaded(layers=4).config) == 1
    layers = [{"w": np.full((2, 3), i)} for i in range(cfg.num_layers)]
    grouped = layer_scan.group_layers(layers, cfg, np.stack)
    assert [g["w"][:, 0, 0].tolist() for g in grouped["stacked"]] == [[0, 2], [1, 3]]
    assert [lp["w"][0, 0] for lp in grouped["rest"]] == [4]


def test_auto_is_chosen_per_platform_and_on_off_are_kept():
    assert resolve_scan_layers("on", "cpu") and not resolve_scan_layers("off", "tpu")
    assert resolve_scan_layers("auto", "tpu") and not resolve_scan_layers("auto", "cpu")
    assert not resolve_scan_layers("auto", "gpu")
    with pytest.raises(ValueError, match="scan_layers"):
        EngineConfig.from_options(scan_layers="yes")


# JAX's TPU kernel's page-major pool (3 KV heads of dim 128 in bfloat16, padded to 4).
TPU_MODEL = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=3,
                        num_heads=6, num_kv_heads=3, head_dim=128, max_position_embeddings=256,
                        tie_word_embeddings=True, eos_token_ids=(2,))
PAGE = 16


@pytest.fixture(scope="module")
def tpu_runner():
    """Placed on this CPU (nothing runs): its params and pool give the step's trees."""
    return ModelRunner(TPU_MODEL, random_model(TPU_MODEL, dtype="bfloat16").params,
                       num_pages=8, page_size=PAGE, dtype="bfloat16",
                       backend=backends.get("pallas-tpu"), scan_layers=True)


def test_abstract_params_and_pool_are_the_scanned_runners(tpu_runner):
    shapes = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)  # noqa
    placed = abstract.abstract_params(TPU_MODEL, tpu_runner.mesh, "bfloat16", scan_layers=True)
    assert shapes(placed) == shapes(tpu_runner.params)
    pool = abstract.abstract_pool(TPU_MODEL, tpu_runner.mesh, 8, PAGE, "bfloat16",
                                  tpu_runner.backend, "bfloat16", scan_layers=True)
    assert shapes(pool) == shapes(tpu_runner.pool)
    (cache,) = tpu_runner.pool.layers  # every layer's pages in one page-major cache
    assert cache.kv.shape == (3 * 8, PAGE, 8, 128)


def test_a_scanned_step_compiles_for_tpu(tpu_runner):
    from pallas_kernels.tpu import jax_kernel
    from tpu_topology import abstract as on_device, tpu_device

    device = tpu_device("v6e")
    buckets = Buckets.for_engine(8, 64, 16, packed=True)
    shape = buckets.step_shapes(PAGE)[-1]
    batch = build_batch(warmup_plan(shape, buckets, PAGE), buckets, PAGE)[0]
    on = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: on_device(np.shape(x), x.dtype, device), tree)
    step = jitted_step(TPU_MODEL, tpu_runner.backend, tpu_runner.mesh)
    with jax_kernel.compile_target(device):
        compiled = step.lower(on(tpu_runner.params), pool=on(tpu_runner.pool),
                              batch=on(dataclasses.replace(batch, sampling=None)),
                              feed=on_device((2 * buckets.seqs[-1],), np.int32, device)).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and " while(" in text  # the Pallas attention, in a scan
    # The pool (3 layers x 8 pages) is read through its page tables, never sliced per layer.
    assert "[24,16,8,128]" in text
    assert not re.search(r"\[8,16,8,128\]\{[^}]*\} (copy|dynamic-slice)\(", text)
