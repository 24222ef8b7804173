"""gpt-oss matches transformers: a tiny seeded GptOssForCausalLM written by save_pretrained
(stacked float experts, as transformers writes them) and loaded from its directory: three
layers (sliding window 8, full, sliding), YaRN rope, attention biases and sinks, 4 experts of
which 2 a token with router and expert biases and the clamped SwiGLU. Logits within 1e-4 on
the cpu and xla backends (pages of 8, prefill chunks of 32, then decode, crossing the window);
the engine's greedy tokens equal transformers' through small pages, chunked prefill, prefix
caching and preemption. The MXFP4 expert format of the released checkpoints: its
dequantization against hand-computed values, and a checkpoint rewritten in it loads to the
same weights."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import (chunks_then_decode_logits_match, crossing_chunk_logits_match,  # noqa: E402
                         seeded_model, tensor_parallel_tokens_match, transformers_greedy)
from skips import need_backend  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.kv_groups import groups_of  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402
from jaxserve.weights.gpt_oss import dequantize_mxfp4  # noqa: E402

PAGE, CHUNK, WINDOW, VOCAB = 8, 32, 8, 211


def _hf_model():
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                             original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                             truncate=False),
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, attn_implementation="eager")
    # routers: clear choices, far from uniform; experts: some gates past the clamp
    model = seeded_model(transformers.GptOssForCausalLM, cfg,
                         {"router.weight": 30.0, "experts.gate_up_proj": 20.0,
                          "experts.down_proj": 20.0})
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("sinks"):  # logits like the scores': each takes a visible share
                w.copy_(torch.randn_like(w) * 2.0)
            if name.endswith("bias"):
                w.copy_(torch.randn_like(w) * 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, its directory as save_pretrained writes it, with a tokenizer)."""
    from jaxserve.weights.random_init import numbered_tokenizer

    directory = str(tmp_path_factory.mktemp("gpt_oss"))
    model = _hf_model()
    model.save_pretrained(directory)
    numbered_tokenizer(VOCAB, 2).save(directory)
    return model, directory


def test_config(checkpoint):
    cfg = load_model(checkpoint[1], lazy=True).config
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks and cfg.attention_bias
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.norm_topk_prob) == (7.0, 1.702, True)
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_logits_match_transformers(checkpoint, backend):
    """Two prefill chunks of 32 then 4 decode steps, pages out of order, the model loaded
    lazily; the sliding layers' window (8) is crossed by every chunk."""
    need_backend(backend)
    model, directory = checkpoint
    loaded = load_model(directory, lazy=True)
    chunks_then_decode_logits_match(model, loaded.config, loaded.params, backend, num_pages=40,
                                    pages_per_table=10, decode_steps=4)


@pytest.mark.parametrize("backend", ["pallas-tpu-interpret", "pallas-gpu-interpret"])
def test_pallas_kernels_in_the_model_match_transformers(checkpoint, backend):
    """The Pallas kernels with sinks (interpreted) in the model's step: a chunk of 16 after 8
    tokens crosses the sliding layers' window, then a decode step."""
    model, directory = checkpoint
    loaded = load_model(directory, lazy=True)
    tables = [[5, 2, 7, 1], [9, 3, 11, 4], [6, 12, 8, 10]]  # one a layer group
    crossing_chunk_logits_match(model, loaded.config, loaded.params, backend,
                                tables[:groups_of(loaded.config).num_groups], num_pages=16)


@functools.cache
def _prompts():
    rng = np.random.default_rng(2)
    shared = [int(t) for t in rng.integers(3, VOCAB, 24)]  # three pages, cached after the first
    return [shared + [5, 6, 7], shared + [9, 10]] + [
        [int(t) for t in rng.integers(3, VOCAB, n)] for n in (7, 45, 70)]


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_engine_greedy_tokens_match_transformers(checkpoint, backend):
    """Five requests at once through pages of 8 in a pool too small for all (preemption),
    chunks of 32 (chunked prefill beside others' decode), two sharing a 3-page prefix cached by
    a request before them (prefix caching), 10 greedy tokens each: transformers' tokens."""
    need_backend(backend)
    model, directory = checkpoint
    loaded = load_model(directory)
    # 10 usable pages per layer group: the longest request (10 pages a group) just fits.
    pages = 1 + 10 * groups_of(loaded.config).num_groups
    config = EngineConfig.from_options(page_size=PAGE, max_num_batched_tokens=CHUNK,
                                       max_num_seqs=5, num_pages=pages, attention_backend=backend,
                                       enable_prefix_caching=True)
    llm = LLM.from_engine(LLMEngine(config, loaded))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = _prompts()
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == transformers_greedy(model, prompt, 10)
    counters = llm.engine.scheduler.counters
    assert counters["prefix_cache_hits"] >= 3 * PAGE and counters["num_preempted_total"] > 0
    llm.engine.scheduler.check_invariants()


def test_mxfp4_dequantization_by_hand():
    """Two blocks of 32 FP4 (e2m1) codes, two a byte (low nibble first), with e8m0 scales
    2^(s - 127): every code of the table, by hand."""
    codes = np.arange(32) % 16  # block 0: the table twice; block 1: reversed
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
             -6.0]
    blocks = np.stack([codes, codes[::-1]]).astype(np.uint8)  # [2 blocks, 32 codes]
    packed = (blocks[:, 0::2] | (blocks[:, 1::2] << 4)).astype(np.uint8)  # [2, 16] bytes
    scales = np.array([127, 130], np.uint8)  # 2^0 and 2^3
    got = dequantize_mxfp4(packed[None], scales[None])  # [1, 64]
    want = [table[c] for c in codes] + [8.0 * table[c] for c in codes[::-1]]
    assert got.shape == (1, 64) and got.dtype == np.float32
    np.testing.assert_array_equal(got[0], np.array(want, np.float32))
    assert np.signbit(got[0, 8])  # code 8 is -0
    # One byte 0x7F: low nibble 0xF (-6) first, high nibble 0x7 (6), times 2^(125 - 127).
    one = dequantize_mxfp4(np.array([[0x7F] * 16], np.uint8), np.array([125], np.uint8))
    np.testing.assert_array_equal(one, np.tile(np.float32([-1.5, 1.5]), 16))
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(packed, scales[:1])


def _to_mxfp4(w):
    """f[E, out, in] -> (blocks u8[E, out, in/32, 16], scales u8[E, out, in/32]): each value
    rounded to the nearest FP4 value times its block's power of 2 (a test's quantizer)."""
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    e, o, i = w.shape
    blocks = w.reshape(e, o, i // 32, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exp)[..., None]
    idx = np.abs(np.abs(scaled)[..., None] - table).argmin(-1) + 8 * (scaled < 0)
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8)
    # C order: safetensors writes an array's memory as it lies
    return np.ascontiguousarray(packed), np.ascontiguousarray(exp + 127, np.uint8)


def test_mxfp4_checkpoint_loads_dequantized(checkpoint, tmp_path):
    """The tiny checkpoint with its experts rewritten as MXFP4 (blocks and scales, [out, in]
    order, as the released gpt-oss checkpoints store them) loads to the experts that its
    dequantized values make, in the loader's layout; other tensors unchanged."""
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = checkpoint[1]
    tensors = load_file(f"{directory}/model.safetensors")
    quantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(np.swapaxes(tensors[name], 1, 2))  # [in, out] -> [out, in]
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{directory}/{f}", tmp_path / f)
    save_file(quantized, str(tmp_path / "model.safetensors"))
    layers = load_model(str(tmp_path)).params["layers"]
    plain = load_model(directory).params["layers"]
    gate_up = dequantize_mxfp4(quantized["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                               quantized["model.layers.1.mlp.experts.gate_up_proj_scales"])
    np.testing.assert_array_equal(layers["experts_gate"][1], np.swapaxes(gate_up[:, 0::2], 1, 2))
    np.testing.assert_array_equal(layers["experts_up"][1], np.swapaxes(gate_up[:, 1::2], 1, 2))
    # The quantizer keeps each value to FP4's precision of its block's largest.
    np.testing.assert_allclose(layers["experts_down"], plain["experts_down"],
                               atol=0.25 * np.abs(plain["experts_down"]).max())
    for key in ("wq", "sinks", "router", "router_bias", "experts_gate_bias", "experts_down_bias"):
        np.testing.assert_array_equal(layers[key], plain[key])


@pytest.mark.parametrize("t", [13, 2])
def test_biased_clamped_experts_equal_a_per_token_loop(t):
    """sparse_mlp with gpt-oss's router bias, expert biases and clamped SwiGLU against a loop
    in float64 as transformers writes it (top-k of the biased logits, softmax over those):
    13 tokens take the grouped matmuls, 2 tokens (4 pairs, 5 experts) the gathered experts.
    Gates and ups reach well past the limit, so the clamps act."""
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.model import moe

    rng = np.random.default_rng(0)
    h, i, e, limit, alpha = 16, 24, 5, 7.0, 1.702
    x = rng.standard_normal((t, h)).astype(np.float32)
    router, router_bias = rng.standard_normal((e, h)).astype(np.float32), rng.standard_normal(e)
    gate, up = (rng.standard_normal((e, h, i)).astype(np.float32) * 3 for _ in range(2))
    down = rng.standard_normal((e, i, h)).astype(np.float32) * 0.3
    gate_bias, up_bias, down_bias = (rng.standard_normal(s).astype(np.float32)
                                     for s in ((e, i), (e, i), (e, h)))
    cfg = ModelConfig(vocab_size=8, hidden_size=h, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=e,
                      num_experts_per_tok=2, moe_intermediate_size=i, swiglu_limit=limit,
                      swiglu_alpha=alpha)
    lp = moe.fuse_experts({"router": router.T, "experts_gate": gate, "experts_up": up,
                           "experts_down": down, "router_bias": router_bias.astype(np.float32),
                           "experts_gate_bias": gate_bias, "experts_up_bias": up_bias,
                           "experts_down_bias": down_bias})
    got = np.asarray(jax.jit(lambda x, lp: moe.sparse_mlp(cfg, x, lp, jax.nn.silu))(x, lp))
    want = np.zeros((t, h))
    clamped = 0
    for n, row in enumerate(x.astype(np.float64)):
        logits = row @ router.T + router_bias
        chosen = np.argsort(-logits)[:2]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        for k, w in zip(chosen, weights / weights.sum()):
            g, u = row @ gate[k] + gate_bias[k], row @ up[k] + up_bias[k]
            clamped += int((g > limit).sum() + (np.abs(u) > limit).sum())
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            want[n] += w * (((u + 1) * g / (1 + np.exp(-alpha * g))) @ down[k] + down_bias[k])
    assert clamped > 0
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_tensor_parallel_keeps_transformers_tokens(checkpoint):
    """tensor_parallel_size=2 on two virtual CPU devices (its own process): each device holds
    its query heads' sinks (sharded as the q rows) and adds the output bias once after the sum.
    Greedy tokens = transformers'."""
    tensor_parallel_tokens_match(*checkpoint, num_pages=64)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_engine_step_compiles_for_tpu(checkpoint, generation):
    """The engine's whole step for the tiny checkpoint in bfloat16 on the Pallas TPU backend,
    compiled for v5e and v6e without a TPU (libtpu's compile-only topologies): the sliding and
    full layers' attention with sinks in this package's kernels over the flat page-major pool
    (head dim 64), the experts in megablox. Skipped where libtpu is not installed."""
    import dataclasses

    import jax

    from jaxserve import backends
    from jaxserve.model.kv_cache import PagedKV
    from jaxserve.runtime.batch import build_batch, warmup_plan
    from jaxserve.runtime.buckets import Buckets
    from jaxserve.runtime.runner import ModelRunner, jitted_step
    from pallas_kernels.tpu import jax_kernel
    from tpu_topology import abstract, tpu_device

    device = tpu_device(generation)
    loaded = load_model(checkpoint[1], lazy=True)
    runner = ModelRunner(loaded.config, loaded.params, num_pages=64, page_size=16,
                         dtype="bfloat16", backend=backends.get("pallas-tpu"))
    assert isinstance(runner.pool.layers[0], PagedKV) and runner.pool.layers[0].kv.ndim == 3
    buckets = Buckets.for_engine(8, 64, 32, query_block=1, packed=True)
    shape = buckets.step_shapes(16)[-1]  # the largest: decode rows and prefill chunks
    batch, _, _ = build_batch(warmup_plan(shape, buckets, 16), buckets, 16)
    on = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: abstract(np.shape(x), x.dtype, device), tree)
    step = jitted_step(runner.cfg, runner.backend, runner.mesh)
    with jax_kernel.compile_target(device):
        compiled = step.lower(on(runner.params), pool=on(runner.pool),
                              batch=on(dataclasses.replace(batch, sampling=None)),
                              feed=abstract((2 * buckets.seqs[-1],), np.int32, device)).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Pallas attention (and megablox), compiled by Mosaic
