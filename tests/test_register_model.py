"""Models from outside the tree (jaxserve.register_model): a tiny Llama written here in flax NNX,
registered under a made-up architecture name and loaded from a seeded transformers
LlamaForCausalLM checkpoint, gives the built-in model's greedy tokens token for token through
batching, chunked prefill and pages of 4 slots; so does the same model as a pure function; at
tensor parallelism 2 (two virtual devices, a subprocess) the NNX module's partition annotations
shard its weights and the tokens stay the same. Bad registrations are clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxserve
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.weights import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=95)
NNX_NAME, FUNCTION_NAME = "TinyNNXLlamaForCausalLM", "TinyFunctionLlamaForCausalLM"
# Columns of q, k, v, gate and up split over "tp", the rows of o and down: Megatron's layout.
COLUMNS = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))
ROWS = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("tp", None))


def rope(x, positions, theta: float):
    """Hugging Face's rotate_half rotary embedding of x f[T, heads, D] at positions i32[T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None]
    cos, sin = (jnp.concatenate([f(angles)] * 2, axis=-1)[:, None] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


# --- the model in NNX, named as transformers names Llama's modules (default weight mapping) ---

class Attention(nnx.Module):
    def __init__(self, cfg, layer: int, *, rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer, self.cfg = layer, cfg
        self.q_proj = nnx.Linear(h, cfg.num_heads * d, use_bias=False, kernel_init=COLUMNS,
                                 rngs=rngs)
        self.k_proj = nnx.Linear(h, cfg.num_kv_heads * d, use_bias=False, kernel_init=COLUMNS,
                                 rngs=rngs)
        self.v_proj = nnx.Linear(h, cfg.num_kv_heads * d, use_bias=False, kernel_init=COLUMNS,
                                 rngs=rngs)
        self.o_proj = nnx.Linear(cfg.num_heads * d, h, use_bias=False, kernel_init=ROWS,
                                 rngs=rngs)

    def __call__(self, x, positions, attention):
        cfg, t = self.cfg, x.shape[0]
        q = self.q_proj(x).reshape(t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        return self.o_proj(attention(self.layer, q, k, v).reshape(t, -1))


class MLP(nnx.Module):
    def __init__(self, cfg, *, rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Linear(h, i, use_bias=False, kernel_init=COLUMNS, rngs=rngs)
        self.up_proj = nnx.Linear(h, i, use_bias=False, kernel_init=COLUMNS, rngs=rngs)
        self.down_proj = nnx.Linear(i, h, use_bias=False, kernel_init=ROWS, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, layer: int, *, rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(h, epsilon=eps, rngs=rngs)
        self.self_attn = Attention(cfg, layer, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(h, epsilon=eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, attention):
        x = x + self.self_attn(self.input_layernorm(x), positions, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, cfg, *, rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)


class TinyLlama(nnx.Module):
    """config: jaxserve's ModelConfig of the checkpoint; returns the final normed hidden states
    (the engine applies the checkpoint's lm_head and samples)."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.model = LlamaModel(config, rngs=rngs)

    def __call__(self, token_ids, metadata, attention):
        x = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            x = layer(x, metadata.positions, attention)
        return self.model.norm(x)


# --- the same model as a pure function of the checkpoint's tensors ----------------------------

def tiny_llama_function(params, token_ids, metadata, attention):
    t, d, theta, eps = token_ids.shape[0], 16, TINY["rope_theta"], TINY["rms_norm_eps"]
    x = params["model.embed_tokens.weight"][token_ids]
    for i in range(TINY["num_hidden_layers"]):
        w = {k[len(f"model.layers.{i}."):]: v for k, v in params.items()
             if k.startswith(f"model.layers.{i}.")}
        h = rms_norm(x, w["input_layernorm.weight"], eps)
        q, k, v = (h @ w[f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d)
        o = attention(i, rope(q, metadata.positions, theta), rope(k, metadata.positions, theta), v)
        x = x + o.reshape(t, -1) @ w["self_attn.o_proj.weight"].T
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (jax.nn.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms_norm(x, params["model.norm.weight"], eps)


jaxserve.register_model(NNX_NAME, TinyLlama)
jaxserve.register_model(FUNCTION_NAME, tiny_llama_function)

PROMPTS = [[5, 17, 33, 2, 80, 41, 9, 60, 12, 3, 77], [44, 6], [8, 8, 30, 91, 19, 25, 64]]


def write_checkpoints(directory: str) -> dict:
    """A seeded tiny LlamaForCausalLM saved by transformers, and copies of it whose config.json
    names the registered architectures: architecture -> directory."""
    from jaxserve.weights.random_init import numbered_tokenizer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # norm weights are ones at init: vary them so that they matter
        for name, w in model.named_parameters():
            if name.endswith("norm.weight"):
                w.normal_(1.0, 0.2)
    out = {"LlamaForCausalLM": os.path.join(directory, "builtin")}
    model.save_pretrained(out["LlamaForCausalLM"])
    numbered_tokenizer(TINY["vocab_size"], TINY["eos_token_id"]).save(out["LlamaForCausalLM"])
    for name in (NNX_NAME, FUNCTION_NAME):
        out[name] = shutil.copytree(out["LlamaForCausalLM"], os.path.join(directory, name))
        with open(os.path.join(out[name], "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(out[name], "config.json"), "w") as f:
            json.dump({**config, "architectures": [name]}, f)
    return out


def greedy(directory: str, **options) -> list[list[int]]:
    """Each prompt's 8 greedy tokens, the prompts batched (2 rows a step, 8 tokens: chunked
    prefill) over pages of 4 slots."""
    engine = LLMEngine(EngineConfig.from_options(**{
        "num_pages": 48, "page_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8,
        "attention_backend": "xla", "huge_pages": False, **options}), load_model(directory))
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0,
                                                ignore_eos=True)).request_id for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[i] for i in ids], engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(str(tmp_path_factory.mktemp("register_model")))


@pytest.fixture(scope="module")
def builtin_tokens(checkpoints):
    return greedy(checkpoints["LlamaForCausalLM"])[0]


@pytest.mark.parametrize("name", [NNX_NAME, FUNCTION_NAME])
def test_registered_model_gives_the_builtin_greedy_tokens(checkpoints, builtin_tokens, name):
    tokens, engine = greedy(checkpoints[name])
    assert engine.model_config.architecture == name
    assert tokens == builtin_tokens
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the prompts' outputs differ
    if name == NNX_NAME:  # the module's parameters, filled from the checkpoint
        params = engine.runner.params["model"]
        q = params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
        assert q.shape == (64, 64)
