"""The engine's whole step, as an accelerator would run it, lowers on this CPU-only jaxlib: with
the GPU backend for "cuda" (the Triton kernel call in the module) and with the TPU backend for
"tpu" (a Mosaic call), bf16 weights and pool, no host callback anywhere; a mixture of experts'
with its grouped matmul (`ragged_dot` for cuda, megablox's kernel for TPU). Lowering proves the
kernels and the step trace and lower for the platform; for TPU the step also compiles
(tests/test_tpu_step_compile.py), and timing needs the device (scripts/device_check.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxserve import backends
from jaxserve.config import ModelConfig
from jaxserve.runtime.batch import build_batch, warmup_plan
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.runner import ModelRunner, jitted_step
from jaxserve.weights.random_init import random_model

# Small, but with the shapes the kernels take: head dim 64, page 16, G = 3 (as SmolLM2).
CONFIG = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=2,
                     num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                     tie_word_embeddings=True, eos_token_ids=(2,))
# Gemma 2's options on the same shapes: a sliding-window layer and a full one, soft-capped
# scores and logits, GeGLU, scaled embeddings, sandwich norms.
GEMMA2_LIKE = dataclasses.replace(
    CONFIG, architecture="gemma2", sliding_window=32,
    layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, query_pre_attn_scalar=64, mlp_activation="gelu_tanh",
    embed_scale=True, norm_weight_offset=1.0, sandwich_norms=True)
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@pytest.fixture(scope="module")
def loaded():
    return random_model(CONFIG, dtype="bfloat16")


def _with_sandwich_norms(params):
    layers = params["layers"]
    norms = {name: layers["mlp_norm"].copy() for name in ("post_attn_norm", "post_mlp_norm")}
    return {**params, "layers": {**layers, **norms}}


@pytest.mark.parametrize("config", [CONFIG, GEMMA2_LIKE], ids=["llama", "gemma2"])
@pytest.mark.parametrize("backend,platform", [("pallas-gpu", "cuda"), ("pallas-tpu", "tpu")])
def test_engine_step_lowers_for_the_accelerator(loaded, backend, platform, config):
    params = loaded.params if config is CONFIG else _with_sandwich_norms(loaded.params)
    text = _lowered_step(config, params, backend, platform)
    assert KERNEL_CALL[platform] in text  # the attention kernel (in the layer loop)
    assert "callback" not in text
    assert "bf16" in text


# Qwen3-MoE's options on the same shapes: a sparse layer (4 experts, top 2) and a dense one.
MOE_LIKE = dataclasses.replace(
    CONFIG, architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=(1,), qk_norm=True)
GROUPED_MATMUL = {"cuda": "ragged_dot", "tpu": "gmm"}  # megablox's kernel, by its name


@pytest.mark.parametrize("backend,platform", [("pallas-gpu", "cuda"), ("pallas-tpu", "tpu")])
def test_mixture_of_experts_step_lowers_for_the_accelerator(backend, platform):
    """The experts of a packed prefill step run as the platform's grouped matmul."""
    text = _lowered_step(MOE_LIKE, random_model(MOE_LIKE, dtype="bfloat16").params, backend,
                         platform)
    assert KERNEL_CALL[platform] in text and GROUPED_MATMUL[platform] in text
    assert "callback" not in text


def _lowered_step(config, params, backend: str, platform: str) -> str:
    """The text of the engine step of the largest token bucket (decode rows and prefill chunks
    packed together), bf16 weights and pool, lowered for `platform`."""
    page_size = 16
    runner = ModelRunner(config, params, num_pages=64, page_size=page_size,
                         dtype="bfloat16", backend=backends.get(backend))
    buckets = Buckets.for_engine(8, 64, CONFIG.max_position_embeddings // page_size,
                                 query_block=1, packed=True)
    shape = buckets.step_shapes(page_size)[-1]
    batch, _, _ = build_batch(warmup_plan(shape, buckets, page_size), buckets, page_size)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    feed = jnp.zeros(2 * buckets.seqs[-1], jnp.int32)
    lowered = jitted_step(config, runner.backend, runner.mesh).trace(
        runner.params, pool=runner.pool, batch=dataclasses.replace(batch, sampling=None),
        feed=feed).lower(lowering_platforms=(platform,))
    return lowered.as_text()
