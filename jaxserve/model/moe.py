"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): the router picks num_experts_per_tok
experts a token, and the experts run as two grouped matmuls over the (token, expert) pairs sorted by
expert (`jax.lax.ragged_dot`). Capacity-free: every pair is computed, none dropped, so the
output is transformers' up to float rounding.

Params of a sparse layer in the execution layout (llama.py's, beside attention's):
  router f[E, H] ([out, in] as the other projections; a plain array under every backend)
  experts_gate_up f[E, H, 2I]: each expert's gate, then up columns ([in, out]: ragged_dot's
      right-hand side); experts_down f[E, I, H]
The loaders' layout stacks them per layer: router [L, H, E], experts_gate, experts_up
[L, E, H, I], experts_down [L, E, I, H] (weights/hf_loader.py).
gpt-oss adds biases: router_bias f[E], experts_gate_up_bias f[E, 2I], experts_down_bias
f[E, H] (loaders' layout: experts_gate_bias, experts_up_bias [L, E, I], experts_down_bias
[L, E, H]), and its experts' activation is a clamped SwiGLU (ClampedSwiGLU).

On XLA's CPU backend ragged_dot is lowered to a masked product over all E experts (E / k
times the work of the chosen ones), so there the grouped matmul is tiled_grouped_matmul (a loop
over the row tiles each group touches, as megablox visits them: 15x faster than ragged_dot at
2048 pairs over 32 experts), and a step with no more (token, expert) pairs than experts
(decode) gathers each pair's expert weights instead and reads only the chosen experts. Lowered
for a TPU, every step runs JAX's megablox grouped matmul (a Pallas kernel that visits only the
groups with tokens) in place of both (jax.lax.platform_dependent: the choice is made at
lowering, so a compile-only TPU target gets it too). The cpu backend packs float, int8 and
bfloat16 (AMX) experts for its own grouped matmul (backends/cpu/packing.py, PanelExperts):
every step, decode included, runs grouped_experts through it, and it reads each chosen expert
in place, once.

Int8 experts (quantization="int8": quantize.Int8Weight stacks, [E, out, in] with scales and
offsets per 32 inputs; the router stays float) are multiplied packed by the cpu backend
(dequantized in registers); elsewhere a decode step dequantizes only its chosen experts
(gathered_experts, every platform, TPU included) and a larger step the layer's whole stack for
the grouped matmul (a transient the memory plan measures: megablox has no quantized mode).

Expert parallelism (runtime/sharding.py): the experts are sharded on their first axis over the
tensor-parallel devices and a sparse layer holds `expert_ids` i32[E / tp], its device's experts'
global ids. Tokens are replicated there (attention's output was summed across devices), so each
device routes every token, runs the pairs routed to its own experts (the others weigh 0) and
the partial outputs are summed: one all-reduce of [T, H] per sparse layer, as a dense layer's
w_down. No all-to-all: a serving step's tokens are already on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.quantize import Int8Weight

EXPERT_KEYS = ("router", "experts_gate", "experts_up", "experts_down")  # loaders' layout


def fuse_experts(lp: dict) -> dict:
    """A sparse layer's expert weights, loaders' layout -> execution layout (see above); int8
    experts (quantize.Int8Weight, stored [E, out, in]) fused on their output axis alike."""
    gate, up, down = lp["experts_gate"], lp["experts_up"], lp["experts_down"]
    int8 = isinstance(gate, Int8Weight)
    out = {"router": np.ascontiguousarray(np.asarray(lp["router"]).T),
           "experts_gate_up": (Int8Weight.concat([gate, up]) if int8
                               else np.concatenate([gate, up], axis=-1)),
           "experts_down": down if int8 else np.asarray(down)}
    if "router_bias" in lp:  # gpt-oss
        out.update(router_bias=np.asarray(lp["router_bias"]),
                   experts_gate_up_bias=np.concatenate([lp["experts_gate_bias"],
                                                        lp["experts_up_bias"]], axis=-1),
                   experts_down_bias=np.asarray(lp["experts_down_bias"]))
    return out


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation of (gate, up): gate clamped above at limit, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    limit: float
    alpha: float

    def __call__(self, gate, up):
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


def _hidden(activation, gate, up):
    """An expert's hidden state: activation(gate) * up, or a ClampedSwiGLU of both."""
    if isinstance(activation, ClampedSwiGLU):
        return activation(gate, up)
    return activation(gate) * up


def route(router_logits, top_k: int, normalize: bool):
    """router_logits f[T, E] -> (weights f32[T, k], experts i32[T, k]): the softmax over all
    experts in float32, its k largest, renormalised to sum 1 when `normalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def run_experts(x, weights, experts, w_gate_up, w_down, activation, biases=None):
    """x f[T, H], each token's k (weight, expert) -> f[T, H]: sum over its k experts of
    weight * down(activation(gate x) * up x). An expert id past the last (local_pairs') is in
    no group and weighs 0. Where there are no more pairs than experts (a decode step) each
    pair reads its expert's weights (gathered_experts), except lowered for a TPU (unless the
    experts are int8) or where a backend packed the experts (their grouped_matmul reads the
    chosen ones in place)."""
    t, k = experts.shape
    args = (x, weights, experts, w_gate_up, w_down, activation, biases)
    if t * k > w_gate_up.shape[0] or hasattr(w_gate_up, "grouped_matmul"):  # T: static bucket
        return grouped_experts(*args)
    if isinstance(w_gate_up, Int8Weight):  # every platform: dequantize the chosen ones only
        return gathered_experts(*args)
    return jax.lax.platform_dependent(
        *args[:5], tpu=lambda *a: grouped_experts(*a, activation, biases),
        default=lambda *a: gathered_experts(*a, activation, biases))


def grouped_experts(x, weights, experts, w_gate_up, w_down, activation, biases=None):
    """run_experts by grouped matmuls: the T * k pairs sorted by expert so that each expert's
    rows are contiguous, then added back per token."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=w_gate_up.shape[0]).astype(jnp.int32)
    gate_up = grouped_matmul(x[token], w_gate_up, group_sizes)
    if biases is not None:  # each pair's expert's (gpt-oss)
        gate_up = gate_up + jnp.take(biases[0], flat[order], axis=0, mode="clip")
    gate, up = jnp.split(gate_up, 2, axis=-1)
    h = _hidden(activation, gate, up).astype(x.dtype)
    y = grouped_matmul(h, w_down, group_sizes).astype(jnp.float32)
    if biases is not None:
        y = y + jnp.take(biases[1], flat[order], axis=0, mode="clip")
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def grouped_matmul(lhs, rhs, group_sizes):
    """lhs f[M, K] rows in groups (group g: the next group_sizes[g] rows, rows past the last
    group give 0) times rhs f[G, K, N] -> f[M, N] in lhs's dtype: jax.lax.ragged_dot, or
    lowered for a TPU JAX's megablox kernel, for a CPU tiled_grouped_matmul; experts a backend
    packed (the CPU backend's PanelExperts) multiply themselves."""
    if hasattr(rhs, "grouped_matmul"):
        return rhs.grouped_matmul(lhs, group_sizes).astype(lhs.dtype)
    if isinstance(rhs, Int8Weight):  # every expert dequantized for the step (see the top)
        rhs = rhs.dequantize_in(lhs.dtype)
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, tpu=_megablox,
                                      cpu=tiled_grouped_matmul, default=jax.lax.ragged_dot)


def tiled_grouped_matmul(lhs, rhs, group_sizes):
    """grouped_matmul as a loop over (row tile, group) visits: each group's rows are the tiles
    of tm rows they overlap, so there are at most M / tm + G - 1 visits, each one small dense
    matmul of its tile by its group's weight, rows of other groups masked; visits past the last
    group are skipped (lax.cond), so only the chosen experts are read. tm ~ M / G (8..128)."""
    m, g, n = lhs.shape[0], rhs.shape[0], rhs.shape[2]
    tm = max(8, min(128, 1 << max(0, (m // g).bit_length() - 1)))
    tiles = -(-m // tm)
    x = jnp.pad(lhs, ((0, tiles * tm - m), (0, 0)))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    count = jnp.where(group_sizes > 0, (ends - 1) // tm - starts // tm + 1, 0)
    visit_end = jnp.cumsum(count)
    v = jnp.arange(tiles + g - 1)
    group = jnp.minimum(jnp.searchsorted(visit_end, v, side="right"), g - 1)
    tile = starts[group] // tm + v - (visit_end[group] - count[group])
    rows = jnp.arange(tm)

    def visit(out, at):
        e, start = at
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(x, start, tm), rhs[e],
                    preferred_element_type=jnp.float32)
        mine = (start + rows >= starts[e]) & (start + rows < ends[e])
        y = jax.lax.dynamic_slice_in_dim(out, start, tm) + jnp.where(mine[:, None], y, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    def body(out, meta):
        e, t, live = meta
        return jax.lax.cond(live, visit, lambda out, _: out, out, (e, t * tm)), None

    out, _ = jax.lax.scan(body, jnp.zeros((tiles * tm, n), jnp.float32),
                          (group, tile, v < visit_end[-1]))
    return out[:m].astype(lhs.dtype)


def _megablox(lhs, rhs, group_sizes, interpret: bool = False):
    """megablox.gmm with rows padded to its row tile, its tiles at most 128 rows and 512 of K
    and N (the whole dimension where smaller). gmm wants groups that cover every row: the rows
    past the last are one more group that rhs lacks, which gmm leaves out and zeroes (its mode
    for an rhs holding only some groups). interpret: Pallas's interpreter (tests on a CPU)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # imported only lowering for TPU

    m, (k, n) = lhs.shape[0], rhs.shape[1:]
    tm = min(m, 128)
    padded = -(-m // tm) * tm
    sizes = jnp.append(group_sizes, padded - jnp.sum(group_sizes)).astype(jnp.int32)
    out = gmm(jnp.pad(lhs, ((0, padded - m), (0, 0))), rhs, sizes,
              preferred_element_type=lhs.dtype, tiling=(tm, min(k, 512), min(n, 512)),
              interpret=interpret)
    return out[:m]


def gathered_experts(x, weights, experts, w_gate_up, w_down, activation, biases=None):
    """run_experts with each of the T * k pairs multiplying its own expert's weights, gathered:
    it reads only the chosen experts (at most T * k of them), where XLA's CPU ragged_dot
    computes every expert for every pair."""
    t, k = experts.shape
    flat = jnp.minimum(experts.reshape(-1), w_gate_up.shape[0] - 1)  # local_pairs' 0-weight id
    xs = jnp.repeat(x, k, axis=0)  # pair i is token i // k
    gate_up = jnp.einsum("ph,phn->pn", xs, _take(w_gate_up, flat, x.dtype))
    if biases is not None:  # each pair's expert's (gpt-oss)
        gate_up = gate_up + biases[0][flat]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    h = _hidden(activation, gate, up).astype(x.dtype)
    y = jnp.einsum("pi,pih->ph", h, _take(w_down, flat, x.dtype)).astype(jnp.float32)
    if biases is not None:
        y = y + biases[1][flat]
    y = y * weights.reshape(-1)[:, None]
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)


def _take(w, experts, dtype):
    """The [in, out] weights of `experts` from a stack of them (int8: those dequantized only)."""
    return w.take(experts).dequantize_in(dtype) if isinstance(w, Int8Weight) else w[experts]


def local_pairs(weights, experts, expert_ids):
    """Expert parallelism: the (weight, expert) pairs as the device holding experts expert_ids
    (consecutive global ids) runs them: experts as indices into its own, a pair routed to
    another device's expert weighing 0 with index len(expert_ids) (past its last expert)."""
    n = expert_ids.shape[0]
    local = experts - expert_ids[0]
    mine = (local >= 0) & (local < n)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, n)


def sparse_mlp(cfg, h, lp, activation, sum_shards=None):
    """One sparse layer's MLP of the normed hidden states h f[T, H] (cfg: a ModelConfig). The
    router's logits are in the model's dtype, as transformers computes them. Replicated experts
    (one device, or tensor parallelism): the output needs no sum across devices; under expert
    parallelism (lp has expert_ids) each device's partial output is summed by sum_shards."""
    logits = h @ lp["router"].T
    biases = None
    if "router_bias" in lp:  # gpt-oss: the router's and the experts' biases
        logits = logits + lp["router_bias"]
        biases = (lp["experts_gate_up_bias"], lp["experts_down_bias"])
    if cfg.swiglu_limit is not None:
        activation = ClampedSwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha)
    weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if "expert_ids" in lp:
        weights, experts = local_pairs(weights, experts, lp["expert_ids"])
    out = run_experts(h, weights, experts, lp["experts_gate_up"], lp["experts_down"], activation,
                      biases)
    return sum_shards(out) if "expert_ids" in lp else out
