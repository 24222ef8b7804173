"""The engine's whole step and its sampling call compile for real TPU targets (v5e, v6e) on this
CPU-only host: libtpu's compile-only topologies (tests/tpu_topology.py), abstract inputs on a
chip, XLA and Mosaic run, nothing executes. Two small configs, one step shape each: a packed
step of decode rows and prefill chunks (llama shapes with 3 KV heads of dim 128: JAX's kernel
over the page-major bf16 pool, heads padded to 4, compiled under jax_kernel.compile_target) and
a Gemma-2-like step (a sliding and a full layer, soft caps, head dim 64) over int8 KV pages (our
kernels, the flat page-major pool with its scales as rows per page). Each compiled step's
per-chip bytes come from its memory analysis."""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import numpy as np
import pytest

from jaxserve import backends
from jaxserve.model.kv_cache import PagedKV
from jaxserve.runtime.batch import build_batch, warmup_plan
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.logit_controls import no_controls
from jaxserve.runtime.runner import ModelRunner, jitted_step, sample_rows
from jaxserve.weights.random_init import random_model
from test_accelerator_lowering import CONFIG, GEMMA2_LIKE, _with_sandwich_norms
from pallas_kernels.tpu import jax_kernel
from tpu_topology import abstract, compile_for, tpu_device

PAGE = 16
LLAMA_128 = dataclasses.replace(CONFIG, num_kv_heads=3, head_dim=128)  # 6 query heads
CASES = {"llama-bf16": (LLAMA_128, "bfloat16"), "gemma2-int8": (GEMMA2_LIKE, "int8")}


@pytest.fixture(scope="module")
def runners():
    """A CPU runner per case: its params and pool give the step's trees, shapes and dtypes."""
    out = {}
    for name, (config, kv) in CASES.items():
        params = random_model(config if config is LLAMA_128 else CONFIG, dtype="bfloat16").params
        if config is GEMMA2_LIKE:
            params = _with_sandwich_norms(params)
        out[name] = ModelRunner(config, params, num_pages=64, page_size=PAGE, dtype="bfloat16",
                                kv_cache_dtype=kv, backend=backends.get("pallas-tpu"))
    return out


def _on(tree, device):
    return jax.tree_util.tree_map(lambda x: abstract(np.shape(x), x.dtype, device), tree)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_step_compiles_for_tpu(runners, case, generation):
    device = tpu_device(generation)
    runner = runners[case]
    buckets = Buckets.for_engine(8, 64, CONFIG.max_position_embeddings // PAGE, query_block=1,
                                 packed=True)
    shape = buckets.step_shapes(PAGE)[-1]  # the largest: decode rows and prefill chunks
    batch, _, _ = build_batch(warmup_plan(shape, buckets, PAGE), buckets, PAGE)
    step = jitted_step(runner.cfg, runner.backend, runner.mesh)
    cache = runner.pool.layers[0]
    assert isinstance(cache, PagedKV)  # JAX's kernel's pool, or ours flat (int8: + scale rows)
    assert cache.quantized == (case == "gemma2-int8") and (cache.kv.ndim == 3) == cache.quantized
    start = time.perf_counter()
    with jax_kernel.compile_target(device):
        compiled = step.lower(_on(runner.params, device), pool=_on(runner.pool, device),
                              batch=_on(dataclasses.replace(batch, sampling=None), device),
                              feed=abstract((2 * buckets.seqs[-1],), np.int32, device)).compile()
    seconds = time.perf_counter() - start
    if not cache.quantized:  # 3 KV heads kept as 4 (JAX's kernel tiles 8, not 6); no relayout
        assert runner.pool.layers[0].kv.shape == (64, PAGE, 8, 128)
        assert f"[64,{PAGE},8,128]" in compiled.as_text()
        assert not re.search(rf"\[64,{PAGE},8,128\]\{{[^}}]*\}} copy\(", compiled.as_text())
    else:  # neither the int8 pages nor their scale rows relaid out in HBM (a copy into VMEM,
        # S(1), is memory-space assignment prefetching this 64-page pool's 32 KB of rows)
        for name, shape in (("s8", cache.kv.shape), ("f32", cache.scales.shape)):
            dims = ",".join(map(str, shape))
            assert not re.search(rf"{name}\[{dims}\]\{{[^}}S]*\}} copy\(", compiled.as_text())
    memory = compiled.memory_analysis()
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.pool))
    print(f"{case} on {generation}: compiled in {seconds:.1f} s; arguments "
          f"{memory.argument_size_in_bytes}, temporaries {memory.temp_size_in_bytes} bytes")
    assert memory.argument_size_in_bytes >= pool_bytes > 0
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas attention, compiled by Mosaic

    # The sampling call chained after it: top-k logprobs, filtered sampling, no controls.
    rows = batch.logits_indices.shape[0]
    logits = abstract((rows, runner.cfg.vocab_size), np.float32, device)
    sampling = _on(batch.sampling, device)
    _, sample_seconds = compile_for(
        lambda lg, sm: sample_rows(lg, sm, no_controls(rows, runner.cfg.vocab_size),
                                   backend=runner.backend, feed_size=2 * buckets.seqs[-1]),
        logits, sampling)
    assert sample_seconds > 0
