"""A small GRPO-style loop (docs/rl.md): the engine samples rollouts, a JAX trainer (optax)
updates the policy, update_weights hands it back every step, in one process.

The policy is the tests' tiny seeded Llama (byte tokens); the toy reward is the share of a
completion's tokens that are the byte TOKEN. Each step: n samples per prompt with seeds and
their logprobs from LLM.generate; group-normalised advantages; the trainer's own forward
(plain JAX, dense causal attention over the loaders' layout) gives its logprobs of the same
tokens, whose largest gap to the engine's is printed; one optax step on -A * logprob; then
update_weights with the new weights in Hugging Face names. Printed per step: rollout and update
seconds (update: update_weights), compilations (after the first step they must be 0), mean
reward, the logprob gap.

    python scripts/rl_grpo.py [--steps 12] [--backend cpu] [--batch_invariant]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the tiny model
from tiny_model import tiny_loaded  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.model.rope import apply_rope, rope_tables  # noqa: E402
from jaxserve.weights.named_update import hf_named  # noqa: E402

TOKEN = ord("e")  # the byte the reward counts (a byte-level id: the byte's own value)
PROMPTS = ["tell me a story", "what comes next", "say something", "write a word"]

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_a, **_k: compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def token_logprobs(params, ids, cfg):
    """The trainer's forward: ids i32[T] -> logprob of ids[t + 1] given ids[:t + 1], f32[T - 1]."""
    t, d = ids.shape[0], cfg.head_dim
    g = cfg.num_heads // cfg.num_kv_heads
    cos, sin = rope_tables(jnp.arange(t), d, cfg.rope_theta, cfg.rope_scaling)
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["embed"][ids]
    lay = params["layers"]
    for i in range(cfg.num_layers):
        h = rms(x, lay["attn_norm"][i], cfg.rms_norm_eps)
        q = apply_rope((h @ lay["wq"][i]).reshape(t, -1, d), cos, sin)
        k = jnp.repeat(apply_rope((h @ lay["wk"][i]).reshape(t, -1, d), cos, sin), g, axis=1)
        v = jnp.repeat((h @ lay["wv"][i]).reshape(t, -1, d), g, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k) * cfg.attention_scale
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        x = x + jnp.einsum("hqk,khd->qhd", p, v).reshape(t, -1) @ lay["wo"][i]
        h = rms(x, lay["mlp_norm"][i], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ lay["w_gate"][i]) * (h @ lay["w_up"][i])) @ lay["w_down"][i]
    logits = rms(x, params["final_norm"], cfg.rms_norm_eps) @ params["embed"].T
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    return jnp.take_along_axis(logp, ids[1:, None], axis=-1)[:, 0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max_tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--scale", type=float, default=0.1, help="of the tiny model's weights")
    ap.add_argument("--batch_invariant", action="store_true")
    args = ap.parse_args()

    loaded = tiny_loaded(h=64, inter=128, heads=4, kv_heads=2, d=16)
    # The tests' weights scaled down (the embedding's std to 0.1, the layers' to 0.09): logits
    # of a few units, as a trained model's, where the tests' scale gives tens (and float32's
    # rounding grows with them: a gap of 5e-5 there).
    loaded.params["embed"] = loaded.params["embed"] * np.float32(args.scale)
    for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        loaded.params["layers"][k] = loaded.params["layers"][k] * np.float32(args.scale * 3)
    cfg = loaded.config
    engine = LLMEngine(EngineConfig.from_options(
        num_pages=512, page_size=8, max_num_seqs=64, max_num_batched_tokens=256,
        attention_backend=args.backend, batch_invariant=args.batch_invariant), loaded)
    engine.warmup(compile_threads=2)
    llm = LLM.from_engine(engine)
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    width = max(map(len, prompts))
    prompts = [[ord(" ")] * (width - len(p)) + p for p in prompts]  # one length: one trainer shape

    params = jax.tree_util.tree_map(jnp.asarray, loaded.params)
    opt = optax.adam(args.lr)
    opt_state = opt.init(params)

    def loss(params, ids, adv):
        lp = jax.vmap(lambda s: token_logprobs(params, s, cfg))(ids)[:, width - 1:]
        return -jnp.mean(adv[:, None] * lp)

    @jax.jit
    def train(params, opt_state, ids, adv):
        grads = jax.grad(loss)(params, ids, adv)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    scores = jax.jit(jax.vmap(lambda p, s: token_logprobs(p, s, cfg), in_axes=(None, 0)))
    print("step  rollout_s  train_s  update_s  compiles  mean_reward  "
          "max|engine-trainer| logprob")
    for step in range(args.steps):
        before = len(compiles)
        t0 = time.perf_counter()
        sp = [SamplingParams(n=args.n, temperature=1.0, seed=1000 * step + i, logprobs=0,
                             max_tokens=args.max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        t1 = time.perf_counter()
        ids, engine_lp, rewards = [], [], []
        for p, out in zip(prompts, outs):
            for c in out.outputs:
                ids.append(p + c.token_ids)
                engine_lp.append([lp[t] for t, lp in zip(c.token_ids, c.logprobs)])
                rewards.append(np.mean(np.asarray(c.token_ids) == TOKEN))
        ids, rewards = np.asarray(ids, np.int32), np.asarray(rewards, np.float32)
        trainer_lp = np.asarray(scores(params, ids))[:, width - 1:]
        gap = float(np.max(np.abs(trainer_lp - np.asarray(engine_lp))))
        groups = rewards.reshape(len(prompts), args.n)
        adv = ((groups - groups.mean(1, keepdims=True)) /
               (groups.std(1, keepdims=True) + 1e-4)).reshape(-1)
        params, opt_state = train(params, opt_state, ids, adv)
        jax.block_until_ready(params)
        t2 = time.perf_counter()
        llm.update_weights(hf_named(cfg, jax.tree_util.tree_map(np.asarray, params)))
        t3 = time.perf_counter()
        print(f"{step:4d}  {t1 - t0:9.3f}  {t2 - t1:7.3f}  {t3 - t2:8.3f}  "
              f"{len(compiles) - before:8d}  "
              f"{rewards.mean():11.3f}  {gap:.2e}", flush=True)


if __name__ == "__main__":
    main()
