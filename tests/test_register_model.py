"""Models from outside the tree (jaxserve.register_model): a tiny Llama written here in flax NNX,
registered under a made-up architecture name and loaded from a seeded transformers
LlamaForCausalLM checkpoint, gives the built-in model's greedy tokens token for token through
batching, chunked prefill, pages of 4 slots, prefix-cache hits and a preemption; so does the same model as a pure function; at
tensor parallelism 2 (two virtual devices, a subprocess) the NNX module's partition annotations
shard its weights, the compiled step issues the built-in model's collectives (two all-reduces
a layer) and the tokens stay the same. Bad registrations are clear errors."""

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
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=95,
            initializer_range=0.1)  # (at 0.02, greedy text repeats one token)
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


def megatron(name: str, shape: tuple):
    """The function's sharding: q, k, v, gate and up ([out, in]) split on their outputs, o and
    down on their inputs; the rest replicated."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight")):
        return ("tp", None)
    return (None, "tp") if name.endswith(("o_proj.weight", "down_proj.weight")) else None


jaxserve.register_model(NNX_NAME, TinyLlama)
jaxserve.register_model(FUNCTION_NAME, tiny_llama_function, partition=megatron)

# The third prompt starts with the first's two full pages (a prefix-cache hit once it is
# admitted, after the second finishes).
PROMPTS = [[5, 17, 33, 2, 80, 41, 9, 60, 12, 3, 77], [44, 6],
           [5, 17, 33, 2, 80, 41, 9, 60, 30, 91, 19, 25, 64]]


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
    prefill) over 7 pages of 4 slots: too few for both rows' whole sequences, so one is
    preempted and recomputed; and the engine."""
    engine = LLMEngine(EngineConfig.from_options(**{
        "num_pages": 8, "page_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8,
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


def _cpu_kernels() -> bool:
    from jaxserve.backends.cpu import kernels

    return kernels.available()


# The NNX module on both CPU attention backends; the function with the layers' pages in one
# scanned pool (scan_layers: layer i's pages from page i * N on).
@pytest.mark.parametrize("name, options", [
    (NNX_NAME, {}), (FUNCTION_NAME, {"scan_layers": "on"}),
    pytest.param(NNX_NAME, {"attention_backend": "cpu"}, marks=pytest.mark.skipif(
        not _cpu_kernels(), reason="CPU kernels not built"))])
def test_registered_model_gives_the_builtin_greedy_tokens(checkpoints, builtin_tokens, name,
                                                          options):
    tokens, engine = greedy(checkpoints[name], **options)
    assert engine.model_config.architecture == name
    assert tokens == builtin_tokens
    stats = engine.stats()
    assert stats["num_preempted_total"] >= 1 and stats["prefix_cache_hits"] >= 2
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the prompts' outputs differ
    params = engine.runner.params["model"]
    if name == NNX_NAME:  # the module's parameters, filled from the checkpoint (kernel = W.T)
        q = params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
        w = load_model(checkpoints["LlamaForCausalLM"]).params["layers"]["wq"][0]
        np.testing.assert_array_equal(np.asarray(q), w)
    else:
        assert "model.layers.0.self_attn.q_proj.weight" in params
        assert len(engine.runner.pool.layers) == (1 if options.get("scan_layers") else 3)


# TP 2 in a subprocess (the device count is fixed before JAX starts): the test module's
# registrations, each model's tokens and where its q projection and the pool's pages lie.
_TP_CASE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_register_model as t
from multi_device_cases import collectives
out = {}
for name, directory in json.loads(sys.argv[2]).items():
    tokens, engine = t.greedy(directory, tensor_parallel_size=2)
    params = engine.runner.params["model"]
    q = (params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"] if name == t.NNX_NAME
         else params["model.layers.0.self_attn.q_proj.weight"])
    out[name] = {"tokens": tokens, "q": [str(a) for a in q.sharding.spec],
                 "q_shard": list(q.addressable_shards[0].data.shape),
                 "pool": [str(a) for a in engine.runner.pool.layers[0].k.sharding.spec],
                 "collectives": collectives(engine)}
print(json.dumps(out))
"""


def test_tensor_parallel_2_shards_by_the_annotations_and_keeps_the_tokens(checkpoints,
                                                                         builtin_tokens):
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    dirs = {n: checkpoints[n] for n in (NNX_NAME, FUNCTION_NAME)}
    proc = subprocess.run([sys.executable, "-c", _TP_CASE, here, json.dumps(dirs)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    nnx_run, function_run = out[NNX_NAME], out[FUNCTION_NAME]
    assert nnx_run["tokens"] == builtin_tokens == function_run["tokens"]
    assert nnx_run["q"] == ["None", "tp"] and nnx_run["q_shard"] == [64, 32]  # [in, out / 2]
    assert function_run["q"] == ["tp", "None"] and function_run["q_shard"] == [32, 64]
    assert nnx_run["pool"][0] == "tp"  # the pool on its KV-head axis, one head per device
    # XLA's partitioner made the built-in model's Megatron step of both: per layer one
    # all-reduce of o_proj's and one of down_proj's partial sums [T, H], no weight gathered.
    for run in (nnx_run, function_run):
        c = run["collectives"]
        layers, hidden = TINY["num_hidden_layers"], TINY["hidden_size"]
        assert (c["all_reduce"], c["all_gather"], c["all_to_all"]) == (2 * layers, 0, 0)
        assert c["all_reduce_bytes"] == 2 * layers * c["tokens"] * hidden * 4


# --- bad registrations and checkpoints --------------------------------------------------------

class NoRngs(nnx.Module):
    def __init__(self, config):
        pass


class NoCall(nnx.Module):
    def __init__(self, config, *, rngs):
        pass


class TwoArguments(nnx.Module):
    def __init__(self, config, *, rngs):
        pass

    def __call__(self, token_ids, metadata):
        pass


class ExtraParameter(TinyLlama):
    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros(config.hidden_size))


class WrongAxis(TinyLlama):  # annotated with a mesh axis the engine's mesh does not have
    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        self.model.norm = nnx.RMSNorm(config.hidden_size, rngs=rngs, scale_init=(
            nnx.with_partitioning(nnx.initializers.ones_init(), ("model",))))


@pytest.mark.parametrize("name, model, error, match", [
    ("", TinyLlama, ValueError, "architecture must be a name"),
    ("LlamaForCausalLM", TinyLlama, ValueError, "built-in architecture"),
    ("BadA", object(), TypeError, "nnx.Module subclass or a function"),
    ("BadB", dict, TypeError, "is not a flax nnx.Module"),
    ("BadC", lambda params, token_ids: None, TypeError,
     r"must take \(params, token_ids, metadata, attention\)"),
    ("BadD", NoRngs, TypeError, r"must take \(self, config, \*, rngs\)"),
    ("BadE", TwoArguments, TypeError, "token_ids, metadata, attention"),
    ("BadF", NoCall, TypeError, r"defines no __call__"),
    (NNX_NAME, ExtraParameter, ValueError, "already registered"),
])
def test_bad_registrations_are_clear_errors(name, model, error, match):
    with pytest.raises(error, match=match):
        jaxserve.register_model(name, model)


def test_default_config_is_read_as_the_builtin_loader_reads_it():
    """read_config (register_model without config=) reads config.json's Llama-shaped keys as
    config_from_hf does (rope base of per-layer-type rope_parameters: the full layers'; EOS
    list), defaults intermediate_size to hidden_size and names a missing size."""
    import dataclasses

    from jaxserve.weights.custom import read_config
    from jaxserve.weights.hf_loader import config_from_hf

    c = {**TINY, "architectures": ["LlamaForCausalLM"], "eos_token_id": [94, 95],
         "bos_token_id": 1, "rope_theta": None,
         "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                             "sliding_attention": {"rope_theta": 1e4}}}
    cfg = read_config(c, "Mine")
    assert cfg == dataclasses.replace(config_from_hf(c), architecture="Mine")
    assert cfg.rope_theta == 1e6 and cfg.eos_token_ids == (94, 95)
    narrow = {k: v for k, v in c.items() if k != "intermediate_size"}
    assert read_config(narrow, "Mine").intermediate_size == TINY["hidden_size"]
    with pytest.raises(ValueError, match="config.json of 'Mine' has no 'vocab_size'"):
        read_config({k: v for k, v in c.items() if k != "vocab_size"}, "Mine")


def test_unknown_architectures_and_unmapped_parameters_are_clear_errors(checkpoints, tmp_path):
    def renamed(name: str) -> str:
        directory = shutil.copytree(checkpoints[NNX_NAME], str(tmp_path / name))
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({**config, "architectures": [name]}, f)
        return directory

    with pytest.raises(ValueError, match=f"registered .*{NNX_NAME}"):
        load_model(renamed("NeverRegisteredForCausalLM"))
    jaxserve.register_model("ExtraParameterForCausalLM", ExtraParameter)
    with pytest.raises(ValueError, match="no tensor 'bias' for the module's parameter 'bias'"):
        load_model(renamed("ExtraParameterForCausalLM"))
    jaxserve.register_model("WrongAxisForCausalLM", WrongAxis)
    with pytest.raises(ValueError, match="may name the engine's mesh axes 'tp' and 'dp' only"):
        load_model(renamed("WrongAxisForCausalLM"))
    jaxserve.register_model("WrongRuleForCausalLM", tiny_llama_function,
                            partition=lambda name, shape: ("model",))
    with pytest.raises(ValueError, match=r"names mesh axis 'model'; the engine's mesh has"):
        greedy(renamed("WrongRuleForCausalLM"))


@pytest.mark.parametrize("misuse, match", [
    (lambda att, q, k, v: att(3, q, k, v), r"layer must be a Python int in 0\.\.2"),
    (lambda att, q, k, v: att(1.0, q, k, v), "layer must be a Python int"),
    (lambda att, q, k, v: att(0, q, k[:, :1], v), r"k must be \[5, 2, 16\]"),
    (lambda att, q, k, v: q, "never called attention"),
    (lambda att, q, k, v: att(0, q, k, v), r"must return hidden states \[5, 64\]"),
])
def test_misusing_attention_is_a_clear_error(misuse, match):
    """model/custom.forward on a bare pool: the layer index, the shapes, a model that never
    writes its KV, and what it returns are checked as the step is traced."""
    from jaxserve.backends import get
    from jaxserve.model import custom
    from jaxserve.model.attention import AttentionMetadata
    from jaxserve.model.kv_cache import KVPool
    from jaxserve.weights.custom import read_config

    cfg = read_config(TINY, "Misuse")
    t = 5
    md = AttentionMetadata(positions=jnp.arange(t), slot_mapping=jnp.arange(t) + 4,
                           page_tables=jnp.array([[1, 2]]), seq_lens=jnp.array([t]),
                           query_start=jnp.array([0, t]), token_row=jnp.zeros(t, jnp.int32),
                           num_decode=0)
    pool = KVPool.zeros(3, 2, 4, 4, 16, jnp.float32)
    q, kv = jnp.ones((t, 4, 16)), jnp.ones((t, 2, 16))
    with pytest.raises(ValueError, match=match):
        custom.forward({"model": None}, pool, jnp.zeros(t, jnp.int32), md, cfg=cfg,
                       backend=get("xla"), call=lambda p, ids, m, att: misuse(att, q, kv, kv))


def test_an_installed_package_registers_its_model_through_an_entry_point(checkpoints, tmp_path,
                                                                          monkeypatch):
    """A checkpoint naming an architecture not yet registered loads the entry points of group
    "jaxserve.models" (what `jaxserve serve` relies on); each registers its model once."""
    import importlib.metadata

    from jaxserve.weights import custom

    calls = []

    class Point:
        name = "tiny-plugin"

        def load(self):
            return lambda: (calls.append(1), jaxserve.register_model("PluginLlama", TinyLlama))

    def entry_points(group):
        return [Point()] if group == custom.PLUGIN_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    directory = shutil.copytree(checkpoints[NNX_NAME], str(tmp_path / "plugin"))
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "architectures": ["PluginLlama"]}, f)
    assert load_model(directory).config.architecture == "PluginLlama"
    load_model(directory)
    assert calls == [1]
