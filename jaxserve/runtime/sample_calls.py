"""A step's sampling calls, each its own small jitted call chained after the model step on the
device (runner.ModelRunner dispatches them): penalties and logit_bias (the controls' entries),
then sampling. Their shapes multiply only their own compiles, not the model step's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.backends import Backend
from jaxserve.runtime.logit_controls import LogitControls, apply_entries
from jaxserve.runtime.sampling import RAW_LOGPROBS, SamplingMetadata, sample


@functools.partial(jax.jit, static_argnames=("backend", "feed_size", "logprobs_mode"))
def sample_rows(logits, sampling: SamplingMetadata, controls: LogitControls | None, *,
                backend: Backend, feed_size: int, logprobs_mode: str = RAW_LOGPROBS,
                unpenalized=None):
    """A step's sampling, its own small jitted call chained after the step on the device: the
    sampling modes and logit controls multiply only its compiles, not the model step's. Returns
    (ids, chosen logprobs, top ids, top logprobs) and the feed of the step planned after it
    (the ids padded to feed_size). unpenalized: the logits before apply_entries_call, if it ran."""
    sampled = sample(logits, sampling, backend, controls, logprobs_mode, unpenalized)
    return sampled, jnp.zeros(feed_size, jnp.int32).at[:sampled[0].shape[0]].set(sampled[0])


@jax.jit
def apply_entries_call(logits, controls: LogitControls):
    """Penalties and logit_bias (the controls' entries), a call of their own before the
    sampling call: its shapes are the sample rows times the entry buckets, not also the
    sampling modes and top-logprobs counts."""
    return apply_entries(logits, controls)


def sampling_key(signature: tuple, entries_applied: bool) -> tuple:
    """The runner's key of a sampling call (its arguments' signature): whether the entries were
    applied before it changes its arguments."""
    return ("sample", signature, entries_applied)
