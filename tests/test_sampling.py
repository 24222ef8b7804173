"""On-device sampling against numpy: greedy ids (first index among ties, as argmax), the chosen
token's logprob and the top-k logprobs of the unfiltered distribution, and the no-logprobs mode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import backends
from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.core.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, seed_words
from jaxserve.runtime.sampling import GREEDY, RANDOM, SamplingMetadata, sample

BACKENDS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="CPU kernels not built"))]


def _metadata(rows: int, mode: str, k: int, temperature: float = 0.0,
              seeds=None) -> SamplingMetadata:
    seeds = range(rows) if seeds is None else seeds
    return SamplingMetadata(
        temperature=jnp.full((rows,), temperature, jnp.float32),
        top_k=jnp.zeros((rows,), jnp.int32), top_p=jnp.ones((rows,), jnp.float32),
        min_p=jnp.zeros((rows,), jnp.float32),
        seeds=jnp.asarray([seed_words(s) for s in seeds], jnp.uint32),
        forks=jnp.zeros((rows,), jnp.int32), positions=jnp.arange(rows, dtype=jnp.int32),
        mode=mode, num_top_logprobs=k)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture
def logits() -> np.ndarray:
    x = np.random.default_rng(0).normal(size=(6, 300)).astype(np.float32) * 4
    x[1, [17, 250]] = x[1].max() + 1  # a tie for the maximum: the lower index wins
    x[2, :] = 0.0  # every token tied
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [0, 1, 5])
def test_greedy_ids_and_logprobs_match_numpy(logits, k, backend):
    ids, chosen, top_ids, top_lp = sample(jnp.asarray(logits), _metadata(6, GREEDY, k),
                                          backends.get(backend))
    expected = _log_softmax(logits)
    np.testing.assert_array_equal(np.asarray(ids), logits.argmax(-1))
    assert int(ids[1]) == 17 and int(ids[2]) == 0
    np.testing.assert_allclose(np.asarray(chosen), expected[np.arange(6), logits.argmax(-1)],
                               rtol=1e-5, atol=1e-5)
    assert top_ids.shape == (6, k) and top_lp.shape == (6, k)
    if k:
        order = np.argsort(-expected, axis=-1, kind="stable")[:, :k]
        np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(expected, order, -1),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(top_ids)[[0, 3, 4, 5]], order[[0, 3, 4, 5]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_logprobs_mode_samples_the_same_tokens(logits, backend):
    backend = backends.get(backend)
    with_lp = sample(jnp.asarray(logits), _metadata(6, GREEDY, 0), backend)
    without = sample(jnp.asarray(logits), _metadata(6, GREEDY, -1), backend)
    np.testing.assert_array_equal(np.asarray(without[0]), np.asarray(with_lp[0]))
    assert not np.asarray(without[1]).any() and without[2].shape == (6, 0)
    seeded = [sample(jnp.asarray(logits), _metadata(6, RANDOM, k, temperature=1.0), backend)[0]
              for k in (-1, 0)]
    np.testing.assert_array_equal(np.asarray(seeded[0]), np.asarray(seeded[1]))


def test_sampled_token_logprob_is_of_the_unscaled_distribution(logits):
    ids, chosen, _, _ = sample(jnp.asarray(logits), _metadata(6, RANDOM, 0, temperature=0.7))
    expected = _log_softmax(logits)[np.arange(6), np.asarray(ids)]
    np.testing.assert_allclose(np.asarray(chosen), expected, rtol=1e-5, atol=1e-5)


def test_every_seed_has_its_own_stream():
    """Seeds that 32 bits (or the old modulo 2**31 - 1) would merge sample apart; a seed's
    samples repeat; seeds below 2**32 keep jax.random.key(seed)'s stream."""
    seeds = [0, 2**31 - 1, 2**32, -1, SEED_MIN, SEED_MAX, 5]
    assert len({seed_words(s) for s in seeds}) == len(seeds)
    assert seed_words(7) == tuple(int(w) for w in jax.random.key_data(jax.random.key(7)))
    md = dataclasses.replace(_metadata(len(seeds), RANDOM, -1, 1.0, seeds),
                             positions=jnp.full((len(seeds),), 3, jnp.int32))
    flat = jnp.zeros((len(seeds), 4096), jnp.float32)  # uniform: the key alone picks
    streams = [tuple(map(int, sample(flat, md)[0])) for _ in range(2)]
    assert streams[0] == streams[1] and len(set(streams[0])) == len(seeds)
    for bad in (SEED_MAX + 1, SEED_MIN - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)


def test_the_server_keeps_the_seed():
    """A body's seed reaches SamplingParams as sent (it was taken modulo 2**31 - 1, so seeds 0
    and 2**31 - 1 sampled alike)."""
    from jaxserve.server.protocol import ProtocolContext, parse_request
    from tiny_model import tiny_tokenizer

    ctx = ProtocolContext(model_names=("tiny",), tokenizer=tiny_tokenizer(), max_model_len=64,
                          vocab_size=320)
    for seed in (0, 2**31 - 1, -5, SEED_MAX):
        assert parse_request("completion", {"prompt": "a", "seed": seed}, ctx).params.seed == seed
