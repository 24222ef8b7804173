"""How closely each weight format, and int8 KV pages, follow the f32 model, on sixteen fixed
prompts: greedy outputs
identical to f32's, tokens generated before each output's first difference, and the mean KL
divergence KL(f32 || format) of the next-token distributions along the f32 model's greedy
tokens (teacher-forced, full vocabulary). On the default model (a Q4_1 GGUF: group-wise int8
holds it exactly) and on a seeded f32 checkpoint of SmolLM2's shape, built here, whose weights
are not 4-bit.

  python scripts/quantization_agreement.py                 # int8 weights, int8 KV, and bf16
                                                            # where AMX allows
  python scripts/quantization_agreement.py --models=seeded --max_tokens=32
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("max_tokens", 64, "Greedy tokens per prompt.")
flags.DEFINE_list("models", ["smollm2-135m", "seeded"], "smollm2-135m and/or seeded.")

QUESTIONS = (
    "What is the capital of France?", "Name three fruits.", "Write a haiku about the sea.",
    "Explain gravity to a child.", "What is 17 times 3?", "List the planets.",
    "How do I boil an egg?", "Translate 'good morning' into Spanish.", "What is photosynthesis?",
    "Give me a tip for learning to code.", "Why is the sky blue?", "Who wrote Hamlet?",
    "Describe a cat in one sentence.", "What is the largest ocean?", "Suggest a name for a dog.",
    "What does a CPU do?")


# format -> (weight quantization, KV pool dtype)
FORMATS = {"f32": ("none", "auto"), "int8": ("int8", "auto"), "int8-kv": ("none", "int8"),
           "bf16": ("bf16", "auto")}


def greedy(loaded, prompts, fmt: str) -> list[list[int]]:
    from jaxserve.config import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine import LLMEngine

    quantization, kv = FORMATS[fmt]
    engine = LLMEngine(EngineConfig.from_options(num_pages=256, max_num_seqs=len(prompts),
                                                 quantization=quantization, kv_cache_dtype=kv),
                       loaded)
    params = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def dense_logprobs(cfg, params, token_ids, int8_kv: bool = False):
    """Log-softmax of the next-token logits at every position of one sequence, f32[T, V]:
    llama's layer without pages (causal attention over the sequence itself), for scoring; with
    int8_kv, keys and values round-trip through the engine's int8 KV format first (the params
    then smoothed as the runner smooths them for int8 pages: model/kv_smoothing.py). The
    sequence is padded to a multiple of 64 at its end (causal: no earlier row sees it), so
    that few shapes are compiled."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import llama
    from jaxserve.model.kv_cache import quantize_kv

    def stored(x):  # [T, Hkv, D] as attention reads it back from the pool
        if not int8_kv:
            return x
        q, scale = quantize_kv(x)
        return q.astype(jnp.float32) * scale[..., None]

    n = len(token_ids)
    token_ids = list(token_ids) + [0] * (-n % 64)
    t, d = len(token_ids), cfg.head_dim
    hq, hkv = cfg.num_heads * d, cfg.num_kv_heads * d
    cos, sin = llama.rope_tables(jnp.arange(t), d, cfg.rope_theta, cfg.rope_scaling)
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = llama.embed(params, jnp.asarray(token_ids))
    for lp in params["layers"]:
        qkv = llama.matmul(llama.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), lp["w_qkv"])
        qkv = qkv + lp["b_qkv"] if "b_qkv" in lp else qkv
        q = qkv[:, :hq].reshape(t, cfg.num_heads, d)
        k = qkv[:, hq:hq + hkv].reshape(t, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q = llama.rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = llama.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
        v = qkv[:, hq + hkv:].reshape(t, cfg.num_kv_heads, d)
        k, v = stored(k), stored(v)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        s = jnp.where(causal[None], jnp.einsum("qhd,khd->hqk", q, k) * d ** -0.5, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).reshape(t, hq)
        x = x + llama.matmul(o, lp["wo"])
        gate, up = jnp.split(llama.matmul(llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps),
                                          lp["w_gate_up"]), 2, axis=-1)
        x = x + llama.matmul(jax.nn.silu(gate) * up, lp["w_down"])
    hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return jax.nn.log_softmax(llama.logits(params, hidden[:n], cfg), axis=-1)


def mean_kl(loaded, sequences, fmt: str, reference) -> float:
    """Mean over the scored positions (each f32 greedy token's) of KL(f32 || format)."""
    import numpy as np

    from jaxserve.model import llama
    from jaxserve.model.kv_smoothing import smooth_keys
    from jaxserve.model.quantize import quantize

    quantization, kv = FORMATS[fmt]
    params = loaded.params if kv != "int8" else smooth_keys(loaded.params, loaded.config)
    params = llama.per_layer_params(quantize(params, quantization))
    kls = []
    for (ids, first), p in zip(sequences, reference, strict=True):
        q = np.asarray(dense_logprobs(loaded.config, params, ids, int8_kv=kv == "int8"))
        q = q[first - 1:-1]
        kls.extend(np.sum(np.exp(p) * (p - q), axis=-1))
    return float(np.mean(kls))


def load(name: str):
    """The default model and its chat prompts, or a seeded f32 checkpoint of the same shape
    (two layers: its text is noise, its agreement is the measure) with numbered prompts."""
    import dataclasses

    import numpy as np

    from jaxserve.weights import load_model
    from jaxserve.weights.random_init import SMOLLM2_135M, random_model

    if name == "seeded":
        loaded = random_model(dataclasses.replace(SMOLLM2_135M, num_layers=2), seed=0)
        rng = np.random.default_rng(0)
        return loaded, [{"prompt_token_ids": rng.integers(0, 49151, 16).tolist()}
                        for _ in QUESTIONS]
    loaded = load_model(name)
    tok = loaded.tokenizer
    return loaded, [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False)} for q in QUESTIONS]


def main(argv):
    del argv
    import numpy as np

    from jaxserve.backends.cpu import kernels as cpu_kernels
    from jaxserve.model import llama
    from jaxserve.tools.bench.report import greedy_agreement

    formats = ["int8", "int8-kv"] + (["bf16"] if cpu_kernels.amx_bf16_available() else [])
    print(f"{'model':<14}{'format':<9}{'identical':>11}{'tokens before the first difference':>38}"
          f"{'mean KL (nats)':>16}")
    for name in FLAGS.models:
        loaded, prompts = load(name)
        reference = greedy(loaded, prompts, "f32")
        total = sum(map(len, reference))
        sequences = [(p["prompt_token_ids"] + list(r), len(p["prompt_token_ids"]))
                     for p, r in zip(prompts, reference)]
        f32 = llama.per_layer_params(loaded.params)
        ref_lp = [np.asarray(dense_logprobs(loaded.config, f32, ids))[first - 1:-1]
                  for ids, first in sequences]
        for fmt in formats:
            a = greedy_agreement(reference, greedy(loaded, prompts, fmt))
            same, agreed = f"{a['identical_requests']}/{a['requests']}", a["matching_prefix_tokens"]
            kl = mean_kl(loaded, sequences, fmt, ref_lp)
            print(f"{name:<14}{fmt:<9}{same:>11}"
                  f"{f'{agreed}/{total} ({agreed / total:.0%})':>38}{kl:>16.2e}", flush=True)


if __name__ == "__main__":
    app.run(main)
