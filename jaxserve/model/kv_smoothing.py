"""Keys made friendlier to int8 KV pages, folded into the weights at load: q.k is unchanged, so
the float model computes the same attention, while the per-token, per-head int8 scale of a key
(kv_cache.quantize_kv) is no longer set by a few outlier channels. No kernel changes, no new
bytes per token.

Rope rotates channel i with channel i + D/2 (rope.py's half-split pairs) by a position's angle,
a complex multiplication of z = k_i + 1j * k_{i+D/2}. Only a complex scalar per pair commutes
with it, so that is all a fold may apply: the key pair is multiplied by exp(1j * phi) / s and
every query head of its KV head's group by exp(1j * phi) * s (a rotation keeps q.k, the scales
cancel). A low-frequency pair barely turns, so its keys stay near one direction and one of its
channels carries them: phi turns that direction to 45 degrees, sharing the magnitude between
the two int8 channels (most of the gain); s divides each pair by a root of its largest size
(ALPHA, as SmoothQuant's alpha), so no pair sets the scale for the rest. With q/k norms (RMSNorm
of each head before rope) only a per-channel scale fits, in the norm weights, shared by heads.

phi and s come from a calibration pass: the float model over fixed seeded token ids, its keys
as the pages would hold them. Estimating them from the weights alone (the normalised input
taken as white) kept half the gain.

Values carry no rope, so any turn of a value head folds into the weights: v W_v M, and M^T
before W_o's rows of every query head of its group. M is the normalised Hadamard matrix
(a seeded orthogonal one where the head dim is not a power of two): it spreads a value's
large channels over all of them, so the per-token int8 scale is no longer theirs.

Measured on the default model, KL(f32 || int8 KV) along f32's greedy tokens at 32 / 64
tokens (scripts/quantization_agreement.py's 16 chat prompts), and at 64 on 32 other chat
prompts: keys smoothed over 128 tokens at ALPHA 1/2, 4.8e-4 / 5.1e-4, 5.1e-4; each change
alone: 512 tokens 4.2 / 4.4, 4.2; ALPHA 3/8 4.9 / 4.6, 4.5; values turned 4.3 / 4.3, 4.2;
all three with 1024 tokens (this module) 4.5e-4 / 4.1e-4, 4.1e-4 (ALPHA 1/2 there: 4.5 at
64 tokens on the 16, 4.0 on the 32). A few near-tied tokens carry much of the KL: a small
change of s (the calibration seed, 512 tokens for 1024) moves it by 5-15%. The pass over
1024 tokens takes 15 s at load for the default model under load (128: 2.4-5.0 s). Tried and
not kept (128 tokens, ALPHA 1/2, the 16 prompts, 32 / 64): s from the pairs' RMS size 5.2 /
5.1, or their 99th percentile 4.8 / 4.7; the first token left out 4.6 / 4.8; s divided by the
queries' size ** 1/4 4.8 / 4.9 (** 1/2: 7.2 / 7.0); a fixed English paragraph for the seeded
ids 4.7 / 4.6 (and it needs the tokenizer)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model import llama
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.rope import rope_tables

ALPHA = 0.375  # s = (a pair's largest size) ** ALPHA: see the measures above
CALIBRATION_TOKENS = 1024


def _halves(w: np.ndarray, heads: int, d: int):
    """w f[..., heads * D] -> its rope pairs' two channels, each f[..., heads, D / 2]."""
    w = w.reshape(*w.shape[:-1], heads, d)
    return w[..., :d // 2], w[..., d // 2:]


def _turn(w: np.ndarray, heads: int, d: int, phi: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Each rope pair of w f[..., heads * D] multiplied by exp(1j * phi) * s (phi, s broadcast
    to [..., heads, D / 2] from the right)."""
    x, y = _halves(np.asarray(w, np.float64), heads, d)
    c, sn = np.cos(phi) * s, np.sin(phi) * s
    out = np.concatenate([c * x - sn * y, sn * x + c * y], axis=-1)
    return out.reshape(np.shape(w)).astype(np.asarray(w).dtype)


class _DenseAttention:
    """The calibration pass's attention backend: a layer's "cache" is this pass's own keys and
    values (f32[T, Hkv, D], positions 0..T-1), attended causally in full."""

    @staticmethod
    def write_kv(cache, k, v, slot_mapping):
        del cache, slot_mapping
        return KVCache(k.astype(jnp.float32), v.astype(jnp.float32))

    @staticmethod
    def attention(q, cache, md, *, sm_scale, window, soft_cap, sinks=None):
        del md
        t, group = q.shape[0], q.shape[1] // cache.k.shape[1]
        k, v = (jnp.repeat(a, group, axis=1) for a in (cache.k, cache.v))
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = jnp.arange(t)
        seen = pos[None, :] <= pos[:, None]
        if window is not None:
            seen &= pos[None, :] > pos[:, None] - window
        s = jnp.where(seen[None], s, -jnp.inf)
        if sinks is not None:  # gpt-oss: a logit per query head in the denominator, no value
            sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*s.shape[:2], 1))
            s = jnp.concatenate([s, sink], axis=-1)
        p = jax.nn.softmax(s, axis=-1)[..., :t]
        return jnp.einsum("hqk,khd->qhd", p, v).astype(q.dtype)


def calibration_keys(params: dict, cfg: ModelConfig) -> list[np.ndarray]:
    """Each layer's keys f32[T, Hkv, D] (after norms and rope, as pages store them) over
    CALIBRATION_TOKENS fixed token ids (seeded, after BOS where the model has one), from the
    float model run layer by layer on the loaders' params (a lazy load reads each layer)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, CALIBRATION_TOKENS)
    if cfg.bos_token_id is not None:
        ids[0] = cfg.bos_token_id
    f32 = lambda tree: jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), tree)  # noqa: E731
    md = SimpleNamespace(slot_mapping=None)
    # the pass's rows alone in float32 (a whole float32 copy of the table outlived the pass)
    x = np.asarray(llama.embed({"embed": np.asarray(params["embed"])}, ids), np.float32)
    if cfg.embed_scale:
        x = x * np.float32(cfg.hidden_size ** 0.5)

    def layer(x, lp, window):
        positions = jnp.arange(len(ids))
        if window is not None and cfg.rope_local_theta is not None:
            rope = rope_tables(positions, cfg.head_dim, cfg.rope_local_theta)
        else:
            rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return llama.decoder_layer(cfg, _DenseAttention, md, rope, window, x, None, lp,
                                   lambda y: y)

    # One compile per window kind (the layers' shapes are alike), not op by op (the default
    # model: 5.0 s with its compile, 8.5 s eagerly, under load). Every device op of the pass
    # is in it, and its code is dropped after: nothing compiled outlives the pass (the memory
    # plan would charge it to the engine as runtime).
    layer = jax.jit(layer, static_argnums=2)
    stacked, keys = params["layers"], []
    try:
        for i in range(len(stacked["attn_norm"])):
            lp = llama.fuse_layer(f32(llama.layer_of(stacked, i)))
            x, cache = layer(x, lp, cfg.layer_window(i))
            keys.append(np.asarray(cache.k))
    finally:
        layer.clear_cache()
    return keys


def key_transform(keys: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(phi f64[Hkv, D / 2], s f64[Hkv, D]) of one layer from its calibration keys
    f[T, Hkv, D]: the turn that gives each pair equal second moments in its two channels
    (a pair that turns with position has them already), and the scale of each channel (a
    pair's two alike). Under qk_norm no turn, and one scale per channel for every head."""
    d = cfg.head_dim
    k = np.asarray(keys, np.float64)
    x, y = k[..., :d // 2], k[..., d // 2:]
    a, b, c = ((u * v).mean(axis=0) for u, v in ((x, x), (y, y), (x, y)))
    phi = 0.5 * np.arctan2(a - b, 2 * c)  # after the turn: a' == b'
    size = np.sqrt(x * x + y * y).max(axis=0)  # [Hkv, D/2], rope keeps it
    if cfg.qk_norm:
        phi, size = np.zeros_like(phi), np.broadcast_to(size.max(axis=0), size.shape)
    size = np.maximum(size, 1e-6 * size.max())
    s = (size / np.exp(np.mean(np.log(size), axis=-1, keepdims=True))) ** ALPHA
    return phi, np.concatenate([s, s], axis=-1)


def value_turn(d: int) -> np.ndarray:
    """M f64[D, D], orthogonal: the normalised Hadamard matrix, or a seeded orthogonal one
    where D is not a power of two."""
    if d & (d - 1):
        return np.linalg.qr(np.random.default_rng(0).standard_normal((d, d)))[0]
    m = np.ones((1, 1))
    while len(m) < d:
        m = np.block([[m, m], [m, -m]])
    return m / np.sqrt(d)


def _turn_values(layer: dict, cfg: ModelConfig) -> dict:
    """wv (and bv) times M in each KV head, wo's rows of each query head by M^T first."""
    d, m = cfg.head_dim, value_turn(cfg.head_dim)
    out = {}
    for name, heads, mat in (("wv", cfg.num_kv_heads, m), ("bv", cfg.num_kv_heads, m)):
        if name in layer:
            w = np.asarray(layer[name])
            out[name] = (w.astype(np.float64).reshape(*w.shape[:-1], heads, d) @ mat).reshape(
                w.shape).astype(w.dtype)
    wo = np.asarray(layer["wo"])
    rows = wo.astype(np.float64).reshape(cfg.num_heads, d, -1)
    out["wo"] = np.einsum("de,hdo->heo", m, rows).reshape(wo.shape).astype(wo.dtype)
    return out


def smooth_layer(layer: dict, cfg: ModelConfig, turn: tuple[np.ndarray, np.ndarray]) -> dict:
    """One layer of the loaders' layout (float weights [in, out]) with its keys turned by phi
    and divided by s per rope pair, its queries turned and multiplied alike (q.k unchanged),
    and its values turned by value_turn (o W_o unchanged); turn = key_transform's (phi, s)."""
    phi, s = turn
    out = {**layer, **_turn_values(layer, cfg)}
    if cfg.qk_norm:  # the norms' weights, shared by the heads, take s (phi is 0)
        offset = cfg.norm_weight_offset
        for name, m in (("q_norm", s[0]), ("k_norm", 1 / s[0])):
            w = np.asarray(layer[name])
            out[name] = ((offset + w.astype(np.float64)) * m - offset).astype(w.dtype)
        return out
    s = s[..., :cfg.head_dim // 2]
    group = cfg.num_heads // cfg.num_kv_heads
    q_phi, q_s = (np.repeat(v, group, axis=0) for v in (phi, s))  # query heads of each group
    for name, heads, p, m in (("wk", cfg.num_kv_heads, phi, 1 / s), ("bk", cfg.num_kv_heads, phi, 1 / s),
                              ("wq", cfg.num_heads, q_phi, q_s), ("bq", cfg.num_heads, q_phi, q_s)):
        if name in layer:
            out[name] = _turn(layer[name], heads, cfg.head_dim, p, m)
    return out


def key_transforms(params: dict, cfg: ModelConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """key_transform of every layer, from one calibration pass."""
    return [key_transform(k, cfg) for k in calibration_keys(params, cfg)]


def layer_smoother(params: dict, cfg: ModelConfig | None, turns: list | None = None):
    """(i, layer i of the loaders' params) -> that layer smoothed by turns[i] (key_transforms:
    one calibration pass over `params` where not given); cfg None (float pages): the layer as
    it is."""
    if cfg is None:
        return lambda i, layer: layer
    turns = key_transforms(params, cfg) if turns is None else turns
    return lambda i, layer: smooth_layer(layer, cfg, turns[i])


def smooth_keys(params: dict, cfg: ModelConfig) -> dict:
    """The loaders' params (layers stacked, in memory) with every layer smoothed."""
    stacked = {k: np.asarray(v) for k, v in params["layers"].items()}
    smooth = layer_smoother(params, cfg)
    layers = [smooth(i, llama.layer_of(stacked, i)) for i in range(len(stacked["attn_norm"]))]
    return {**params, "layers": {k: np.stack([lp[k] for lp in layers]) for k in stacked}}
