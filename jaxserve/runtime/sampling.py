"""On-device sampling: logit controls, greedy, temperature, top-k, top-p, min-p, per-row seeds,
and the logprobs returned (LoadConfig.logprobs_mode, as vLLM names them).

Each row's randomness comes only from (seed, fork index, position), so a seeded request samples
the same tokens whatever else shares its batch. Only sampled ids and logprobs leave the device.
Logprobs are float32 in the same jitted call: raw_* of the model's logits (under a grammar's
mask only: the tokens it forbids are -inf), processed_* of the ones the row was sampled from
(after its logit controls, temperature and top-k/top-p/min-p masks; a greedy row's are its
controlled logits). A batch-invariant backend's logsumexp runs in fixed row tiles
(model/batch_invariant.py), as the prompt logprobs' does (`log_softmax`), so a sampled token's
logprob is bitwise the prompt logprob of the same sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.backends import Backend
from jaxserve.backends.xla import BACKEND as XLA
from jaxserve.model.batch_invariant import by_row_tiles
from jaxserve.pytree import pytree_dataclass, static_field
from jaxserve.runtime.logit_controls import LogitControls, apply_controls, apply_mask

GREEDY, RANDOM, FILTERED = "greedy", "random", "filtered"  # static sampling modes
RAW_LOGPROBS = "raw_logprobs"  # LoadConfig.LOGPROBS_MODES' default


@pytree_dataclass
class SamplingMetadata:
    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    seeds: jax.Array  # u32[R, 2] the seed's key words (high, low): sampling_params.seed_words
    forks: jax.Array  # i32[R] fork index of the row's sequence
    positions: jax.Array  # i32[R] position of the token being sampled
    mode: str = static_field()  # GREEDY: all rows greedy; RANDOM: no filters; FILTERED
    # Top logprobs to return per row; 0: only the sampled token's; -1: no logprobs at all (no
    # row asked for them, so the logsumexp over the vocabulary is skipped).
    num_top_logprobs: int = static_field()


def _filter(logits, md: SamplingMetadata):
    """Mask logits outside top-k, top-p (nucleus) and min-p; one descending sort per row."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (md.top_k[:, None] <= 0) | (rank < md.top_k[:, None])
    # Nucleus: keep a token while the mass before it is below top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < md.top_p[:, None]
    keep &= probs >= md.min_p[:, None] * probs[:, :1]
    # The top token always stays: a top_p that float32 flushes to 0 (1e-40), or rounding in
    # the cumulative sum, must not mask every token.
    keep |= rank == 0
    masked_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(masked_sorted, inverse, axis=-1)


def _top(logits, num_top: int, backend: Backend):
    """The num_top >= 1 largest logits and their ids per row (lowest index among ties)."""
    argmax = backend.argmax
    if num_top == 1 and argmax is not None:
        ids, top = argmax(logits)
        return top[:, None], ids[:, None]
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    return top_logits, top_ids.astype(jnp.int32)


def logsumexp(logits, backend: Backend = XLA):
    """logits f32[R, V] -> f32[R]; on a batch-invariant backend a row's is the same whatever
    rows are beside it."""
    if getattr(backend, "batch_invariant", False):
        return by_row_tiles(lambda x: jax.nn.logsumexp(x, axis=-1), logits)
    return jax.nn.logsumexp(logits, axis=-1)


def log_softmax(logits, backend: Backend = XLA):
    """logits f32[R, V] -> logits - logsumexp: the one formula of sampled and prompt logprobs."""
    return logits - logsumexp(logits, backend)[:, None]


def sample(logits, md: SamplingMetadata, backend: Backend = XLA,
           controls: LogitControls | None = None, logprobs_mode: str = RAW_LOGPROBS):
    """logits f32[R, V] -> (token ids i32[R], chosen logprob f32[R], top ids i32[R, K],
    top logprobs f32[R, K]). The logprobs are of the distribution logprobs_mode names (module
    docstring); all zeros when md.num_top_logprobs < 0. controls: the rows' logit controls
    (runtime/logit_controls.py), applied first.

    A logprob is logit - logsumexp(logits): the [R, V] log-softmax is never materialised, and the
    greedy choice is the top logit (lowest index among ties, as argmax): the backend's argmax where
    it has one (XLA's CPU top_k is slow over a vocabulary), else top_k, which XLA runs faster
    than argmax. One top_k serves both the greedy choice and the top logprobs when the logprobs
    are of the logits it was taken over."""
    raw = logits
    if controls is not None:
        logits = apply_controls(logits, controls)
        # raw: the model's logits under the structured-output mask alone, as vLLM's sampler
        # receives them (the grammar's bitmask applied before it, penalties and bias inside):
        # a token the grammar forbids is never listed or given a finite logprob.
        raw = logits if controls.entry_rows.shape[0] == 0 else apply_mask(raw, controls.mask)
    num_top = max(md.num_top_logprobs, 0)
    top_logits, top_ids = _top(logits, max(num_top, 1), backend)
    greedy_ids = top_ids[:, 0]
    processed = logits
    if md.mode == GREEDY:
        ids = greedy_ids
    else:
        scaled = logits / jnp.maximum(md.temperature, 1e-6)[:, None]
        if md.mode == FILTERED:
            scaled = _filter(scaled, md)

        def row_key(words, fork, pos):
            # the words are the key itself (what jax.random.key makes of a 64-bit seed), so
            # no two seeds share a stream
            key = jax.random.wrap_key_data(words, impl="threefry2x32")
            return jax.random.fold_in(jax.random.fold_in(key, fork), pos)

        keys = jax.vmap(row_key)(md.seeds, md.forks, md.positions)
        sampled = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)
        ids = jnp.where(md.temperature == 0.0, greedy_ids, sampled.astype(jnp.int32))
        processed = jnp.where((md.temperature == 0.0)[:, None], logits, scaled)
    if md.num_top_logprobs < 0:
        return ids, jnp.zeros(ids.shape, jnp.float32), top_ids[:, :0], top_logits[:, :0]
    source = raw if logprobs_mode.startswith("raw") else processed
    if source is not logits:  # the top logprobs are of other logits than the greedy top_k's
        top_logits, top_ids = _top(source, max(num_top, 1), backend)
    chosen = jnp.take_along_axis(source, ids[:, None], axis=-1)[:, 0]
    if logprobs_mode.endswith("logits"):
        return ids, chosen, top_ids[:, :num_top], top_logits[:, :num_top]
    lse = logsumexp(source, backend)
    return ids, chosen - lse, top_ids[:, :num_top], top_logits[:, :num_top] - lse[:, None]
