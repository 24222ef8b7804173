"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): the router picks num_experts_per_tok experts
a token, and the experts run as two grouped matmuls over the (token, expert) pairs sorted by
expert (`jax.lax.ragged_dot`). Capacity-free: every pair is computed, none dropped, so the
output is transformers' up to float rounding.

Params of a sparse layer in the execution layout (llama.py's, beside attention's):
  router f[E, H] ([out, in] as the other projections; a plain array under every backend)
  experts_gate_up f[E, H, 2I]: each expert's gate, then up columns ([in, out]: ragged_dot's
      right-hand side); experts_down f[E, I, H]
The loaders' layout stacks them per layer: router [L, H, E], experts_gate, experts_up
[L, E, H, I], experts_down [L, E, I, H] (weights/hf_loader.py).

On XLA's CPU backend ragged_dot is lowered to a masked product over all E experts (E / k
times the work of the chosen ones), so a step with no more (token, expert) pairs than experts
(decode) gathers each pair's expert weights instead and reads only the chosen experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EXPERT_KEYS = ("router", "experts_gate", "experts_up", "experts_down")  # loaders' layout


def fuse_experts(lp: dict) -> dict:
    """A sparse layer's expert weights, loaders' layout -> execution layout (see above)."""
    return {"router": np.ascontiguousarray(np.asarray(lp["router"]).T),
            "experts_gate_up": np.concatenate([lp["experts_gate"], lp["experts_up"]], axis=-1),
            "experts_down": np.asarray(lp["experts_down"])}


def route(router_logits, top_k: int, normalize: bool):
    """router_logits f[T, E] -> (weights f32[T, k], experts i32[T, k]): the softmax over all
    experts in float32, its k largest, renormalised to sum 1 when `normalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def run_experts(x, weights, experts, w_gate_up, w_down, activation):
    """x f[T, H], each token's k (weight, expert) -> f[T, H]: sum over its k experts of
    weight * down(activation(gate x) * up x). The T * k pairs are sorted by expert so that
    each expert's rows are contiguous for the grouped matmuls, then added back per token;
    where there are no more pairs than experts (a decode step) each pair reads its expert's
    weights instead (gathered_experts)."""
    t, k = experts.shape
    num_experts = w_gate_up.shape[0]
    if t * k <= num_experts:  # static: T is the step's bucket
        return gathered_experts(x, weights, experts, w_gate_up, w_down, activation)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    gate, up = jnp.split(jax.lax.ragged_dot(x[token], w_gate_up, group_sizes), 2, axis=-1)
    h = (activation(gate) * up).astype(x.dtype)
    y = jax.lax.ragged_dot(h, w_down, group_sizes).astype(jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def gathered_experts(x, weights, experts, w_gate_up, w_down, activation):
    """run_experts with each of the T * k pairs multiplying its own expert's weights, gathered:
    it reads only the chosen experts (at most T * k of them), where XLA's CPU ragged_dot
    computes every expert for every pair."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # pair i is token i // k
    gate, up = jnp.split(jnp.einsum("ph,phn->pn", xs, w_gate_up[flat]), 2, axis=-1)
    h = (activation(gate) * up).astype(x.dtype)
    y = jnp.einsum("pi,pih->ph", h, w_down[flat]).astype(jnp.float32)
    y = y * weights.reshape(-1)[:, None]
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)


def sparse_mlp(cfg, h, lp, activation):
    """One sparse layer's MLP of the normed hidden states h f[T, H] (cfg: a ModelConfig). The
    router's logits are in the model's dtype, as transformers computes them. Every device holds
    every expert (they are replicated under tensor parallelism), so the output needs no sum
    across devices."""
    weights, experts = route(h @ lp["router"].T, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return run_experts(h, weights, experts, lp["experts_gate_up"], lp["experts_down"], activation)
