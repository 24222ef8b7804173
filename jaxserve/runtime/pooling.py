"""The pooling runner's device side (LoadConfig.runner "pooling"): the same model function,
pool and batches as generation, but the step returns each batch row's (each scheduled chunk's)
final-norm hidden states reduced on the device, so that only [S, H] arrays come back to the
host, never [T, H], and nothing is sampled. The host (engine/pooling.py) combines a sequence's
chunks across steps."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVPool
from jaxserve.runtime.batch import StepBatch
from jaxserve.runtime.runner import ModelRunner, StepOutput, model_forward


def pooled_rows(hidden, md: AttentionMetadata) -> dict:
    """hidden f[T, H] -> per row, float32: "sum" f32[S, H] (the row's tokens' hidden states
    summed: mean pooling), "count" i32[S] (its tokens), "first" f32[S, H] (its first token's:
    CLS pooling) and "last" f32[S, H] (its last token's: last-token pooling and classifier
    heads). Padded tokens (token_row == S) count in no row."""
    s = md.seq_lens.shape[0]
    h = hidden.astype(jnp.float32)
    sums = jax.ops.segment_sum(h, md.token_row, num_segments=s + 1)[:s]
    counts = jax.ops.segment_sum(jnp.ones_like(md.token_row), md.token_row,
                                 num_segments=s + 1)[:s]
    first = md.query_start[:-1]
    last = first + jnp.maximum(counts, 1) - 1
    return {"sum": sums, "count": counts, "first": h[first], "last": h[last]}


def _pool_step(params, pool: KVPool, batch: StepBatch, feed, *, cfg: ModelConfig,
               backend: Backend, mesh: Mesh):
    """(params, pool, batch, feed) -> (pool, {"pooled": pooled_rows}): the generation step's
    signature (feed unused: a pooling step is never planned ahead of another's tokens)."""
    pool, hidden = model_forward(cfg, backend, mesh)(params, pool, batch.token_ids, batch.attn)
    return pool, {"pooled": pooled_rows(hidden, batch.attn)}


@functools.lru_cache(maxsize=None)
def _jitted_pool_step(cfg: ModelConfig, backend: Backend, mesh: Mesh):
    return jax.jit(functools.partial(_pool_step, cfg=cfg, backend=backend, mesh=mesh),
                   donate_argnames=("pool",))


@dataclasses.dataclass
class PooledStepOutput(StepOutput):
    """A pooling step's rows (pooled_rows, host copies); its sampled ids are all 0."""

    pooled: dict | None = None


class PoolingRunner(ModelRunner):
    """ModelRunner whose step pools instead of sampling (same params, pool, warm-up shapes)."""

    def __init__(self, cfg: ModelConfig, params: dict, **options):
        super().__init__(cfg, params, **options)
        self._step = _jitted_pool_step(cfg, self.backend, self.mesh)

    def dispatch(self, batch: StepBatch, copies=None, after=None, controls=None,
                 sample: bool = True):
        return super().dispatch(batch, copies, after, controls, sample=False)

    @staticmethod
    def fetch(out, num_rows: int) -> PooledStepOutput:
        pooled = jax.device_get(out["pooled"])
        ids = np.zeros(num_rows, np.int32)
        return PooledStepOutput(ids, ids.astype(np.float32), np.zeros((num_rows, 0), np.int32),
                                np.zeros((num_rows, 0), np.float32), pooled=pooled)

    def _warmup_jobs(self, buckets, full: bool):
        """The step shapes only: nothing is sampled."""
        return (job for job in super()._warmup_jobs(buckets, full)
                if not (isinstance(job[0][0], str) and job[0][0] == "sample"))

    def _compile_step(self, pool, step: StepBatch) -> None:
        self._step.lower(self.params, pool=pool, batch=step, feed=self._no_feed).compile()
