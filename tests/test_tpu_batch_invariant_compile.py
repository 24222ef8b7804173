"""`batch_invariant` on TPU (docs/rl.md): the engine's step under the option, on the xla backend
(attention token by token in jnp, the per-token parts in fixed row tiles), compiles for v5e and
v6e on this CPU-only host (libtpu's compile-only topologies, tests/tpu_topology.py; nothing
runs). The Pallas backend is refused by name: its kernels' reduction orders are not fixed."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import backends
from jaxserve.runtime.batch import build_batch, warmup_plan
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.runner import ModelRunner, jitted_step
from jaxserve.weights.random_init import random_model
from test_accelerator_lowering import CONFIG
from tpu_topology import abstract, tpu_device

PAGE = 16


def _on(tree, device):
    return jax.tree_util.tree_map(lambda x: abstract(np.shape(x), x.dtype, device), tree)


@pytest.fixture(scope="module")
def runner():
    backend = backends.batch_invariant(backends.get("xla"), CONFIG)
    return ModelRunner(CONFIG, random_model(CONFIG, dtype="bfloat16").params, num_pages=64,
                       page_size=PAGE, dtype="bfloat16", kv_cache_dtype="bfloat16",
                       backend=backend)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_batch_invariant_step_compiles_for_tpu(runner, generation):
    device = tpu_device(generation)
    backend = runner.backend
    buckets = Buckets.for_engine(8, 64, CONFIG.max_position_embeddings // PAGE,
                                 query_block=backend.query_block, packed=backend.packed)
    # the largest step of decode rows and prefill chunks together
    shape = max(buckets.step_shapes(PAGE, full=True), key=lambda s: (min(s[0], s[1]) > 0, s))
    assert shape[0] > 0 and shape[1] > 0, shape
    batch, _, _ = build_batch(warmup_plan(shape, buckets, PAGE), buckets, PAGE)
    step = jitted_step(runner.cfg, backend, runner.mesh)
    compiled = step.lower(_on(runner.params, device), pool=_on(runner.pool, device),
                          batch=_on(dataclasses.replace(batch, sampling=None), device),
                          feed=abstract((2 * buckets.seqs[-1],), np.int32, device)).compile()
    assert backend.batch_invariant and "while" in compiled.as_text()  # tiles, token loops
    memory = compiled.memory_analysis()
    print(f"batch_invariant step {shape} on {generation}: arguments "
          f"{memory.argument_size_in_bytes}, temporaries {memory.temp_size_in_bytes} bytes")
    assert memory.argument_size_in_bytes > 0


def test_pallas_is_refused_by_name():
    with pytest.raises(ValueError, match="pallas-tpu.*xla"):
        backends.batch_invariant(backends.get("pallas-tpu"), CONFIG)
