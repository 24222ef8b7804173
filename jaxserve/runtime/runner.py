"""ModelRunner: owns every device array (params, KV pool), the jitted model step and the
jitted sampling call chained after it.

step(params, pool, batch, feed) -> (pool, out) is pure and jitted with the pool donated, so the
pool is updated in place; `feed` carries the previous step's sampled tokens into a step planned
before they were read back (async scheduling). Its sample rows' logits stay on the device for
the sampling call (sample_rows: sampling modes, logit controls), so those multiply only that
small function's compiles. Shapes come from the batch buckets; each new
shape signature is one compilation, counted in `compilations`. The jitted step is shared by
every runner of the same model config and backend in the process, so a second engine (a
benchmark's ablation variant, a test) reuses what the first compiled; `compilations` still
counts the shapes this runner met.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends import Backend
from jaxserve.backends.cpu.huge_pages import collapse_into_huge_pages
from jaxserve.config import ModelConfig
from jaxserve.model import layer_scan, llama
from jaxserve.model.kv_cache import KVPool, groups_of
from jaxserve.runtime import memory
from jaxserve.runtime.batch import (StepBatch, build_batch, warmup_batches, warmup_plan,
                                    warmup_samplings)
from jaxserve.runtime import custom_model, distributed, param_update, sharding
from jaxserve.runtime.params import JNP_DTYPES, device_params
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.compilation_cache import use_compilation_cache
from jaxserve.runtime.lora_stack import LoRAStack, step_args
from jaxserve.runtime.logit_controls import LogitControls
from jaxserve.runtime.precompile import Precompiler
from jaxserve.runtime.sampling import RAW_LOGPROBS, XLA, SamplingMetadata, log_softmax, sample
from jaxserve.weights.named_update import NamedUpdate

@dataclasses.dataclass
class StepOutput:
    """Host copies of what one step sampled, first `num_rows` rows only."""

    token_ids: np.ndarray  # i32[rows]
    logprobs: np.ndarray  # f32[rows] logprob of each sampled token
    top_ids: np.ndarray  # i32[rows, K]
    top_logprobs: np.ndarray  # f32[rows, K]
    # With batch.prompt_logprobs >= 0, per flat token: logprob of the next prompt token, top k.
    prompt_logprobs: np.ndarray | None = None  # f32[T]
    prompt_top_ids: np.ndarray | None = None  # i32[T, k]
    prompt_top_logprobs: np.ndarray | None = None  # f32[T, k]


@functools.partial(jax.jit, donate_argnames=("pool",), static_argnames=("scanned_layers",))
def copy_pool_pages(pool: KVPool, src, dst, scanned_layers: int = 0) -> KVPool:
    """Copy-on-write: page src[i] -> dst[i] in every array of the pool (pages, and an int8
    pool's scales, each layout's own page axis), every layer and head. Its own small jitted
    call (copies are rare: forks, prefix hits ending mid-page), so the step's shapes do not
    multiply by the copies buckets. scanned_layers: the layers of a scanned pool (0: not)."""
    if scanned_layers:
        return layer_scan.copy_pages(pool, src, dst, scanned_layers)
    return pool.copy_pages(src, dst)


def model_forward(cfg: ModelConfig, backend: Backend, mesh: Mesh):
    """(params, pool, token_ids, md) -> (pool, hidden) on the mesh's tp devices."""
    if custom_model.is_registered(cfg):  # jaxserve.register_model's (runtime/custom_model.py)
        return custom_model.forward(cfg, backend, mesh)
    tp = sharding.tp_size(mesh)
    if tp == 1:
        return functools.partial(llama.forward, cfg=cfg, backend=backend)
    per_device = functools.partial(llama.forward, cfg=sharding.shard_config(cfg, tp),
                                   backend=backend)
    return sharding.tensor_parallel_forward(per_device, mesh)


def _step(params, pool: KVPool, batch: StepBatch, feed, lora=None, *, cfg: ModelConfig,
          backend: Backend, mesh: Mesh):
    # Tokens sampled by the previous step (still in flight when this one was planned) come in
    # as `feed`, the previous step's padded sample ids, and go out the same way.
    token_ids = jnp.where(batch.feed_rows >= 0, feed[jnp.maximum(batch.feed_rows, 0)],
                          batch.token_ids)
    pool, hidden = model_forward(cfg, backend, mesh)(params, pool, token_ids, batch.attn,
                                                     **step_args(lora, batch.lora_slots))
    # The sample rows' logits stay on the device for sample_rows.
    out = {"logits": llama.logits(params, hidden[batch.logits_indices], cfg, backend)}
    if batch.prompt_logprobs >= 0:  # scoring: log-softmax at every token (echo / evaluation)
        logprobs = log_softmax(llama.logits(params, hidden, cfg, backend), backend)
        target = jnp.take_along_axis(logprobs, batch.prompt_targets[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logprobs, max(batch.prompt_logprobs, 1))
        k = batch.prompt_logprobs
        out["prompt"] = (target, top_ids[:, :k], top_lp[:, :k])
    return pool, out


@functools.partial(jax.jit, static_argnames=("backend", "feed_size", "logprobs_mode"))
def sample_rows(logits, sampling: SamplingMetadata, controls: LogitControls | None, *,
                backend: Backend, feed_size: int, logprobs_mode: str = RAW_LOGPROBS):
    """A step's sampling, its own small jitted call chained after the step on the device: the
    sampling modes and logit controls multiply only its compiles, not the model step's. Returns
    (ids, chosen logprobs, top ids, top logprobs) and the feed of the step planned after it
    (the ids padded to feed_size)."""
    sampled = sample(logits, sampling, backend, controls, logprobs_mode)
    return sampled, jnp.zeros(feed_size, jnp.int32).at[:sampled[0].shape[0]].set(sampled[0])


@functools.lru_cache(maxsize=None)
def jitted_step(cfg: ModelConfig, backend: Backend, mesh: Mesh):
    """The step, jitted with the pool donated: one per process for each model, backend, mesh."""
    return jax.jit(functools.partial(_step, cfg=cfg, backend=backend, mesh=mesh),
                   donate_argnames=("pool",))


def release_compiled_steps() -> None:
    """Drop every compiled step in this process, JAX's in-memory caches included. A compiled
    step of the unrolled model holds hundreds of memory mappings, and a process may hold
    vm.max_map_count (65530): a benchmark that builds engine after engine with different buckets
    would die in LLVM ("Cannot allocate memory"). Later compiles of the same shapes load from
    the on-disk compilation cache."""
    jitted_step.cache_clear()
    jax.clear_caches()


def _signature(batch) -> tuple:
    """A jitted call's cache key: the model step's is its batch without the sampling metadata
    (sampled in sample_rows)."""
    if isinstance(batch, StepBatch):
        batch = dataclasses.replace(batch, sampling=None)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return (treedef, tuple((x.shape, x.dtype.str) for x in leaves))


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, *, num_pages: int, page_size: int,
                 dtype: str = "float32", kv_cache_dtype: str | None = None,
                 backend: Backend = XLA, quantization: str = "none",
                 max_sample_rows: int = 512, huge_pages: bool = False, mesh: Mesh | None = None,
                 scan_layers: bool = False, expert_parallel: bool = False,
                 fingerprint: str | None = None, logprobs_mode: str = RAW_LOGPROBS,
                 lora: tuple[int, int] | None = None):
        """mesh: this runner's ("dp", "tp") devices, one row (sharding.replica_mesh); default
        the first device. scan_layers: the layers' weights stacked and run by lax.scan, the pool
        one cache of every layer's pages (model/layer_scan.py). expert_parallel: a mixture of
        experts' experts spread over the tp devices (sharding.place_params). fingerprint: the
        weights' (LoadedModel.fingerprint), which keeps int8 KV's calibration on disk.
        logprobs_mode: what sampled logprobs are of (runtime/sampling.py). lora: (slots, rank)
        of a LoRA adapter stack passed to every step (runtime/lora_stack.py); None: none."""
        use_compilation_cache()
        self.cfg, self.scan_layers = cfg, scan_layers
        self.mesh = mesh or sharding.make_mesh(1)
        self.dtype = JNP_DTYPES[dtype]
        self.kv_dtype = JNP_DTYPES[kv_cache_dtype or dtype]  # int8 pages carry float32 scales
        self.params = device_params(params, cfg, self.mesh, backend, dtype=self.dtype,
                                    kv_dtype=self.kv_dtype, quantization=quantization,
                                    expert_parallel=expert_parallel, fingerprint=fingerprint)
        self._placing = dict(dtype=self.dtype, quantization=quantization,
                             expert_parallel=expert_parallel, scan_layers=scan_layers)
        self._lent: set[int] = set()  # ids of params a caller lent (update_params)
        self.weights_version = 0  # update_params's count: every output carries it
        if scan_layers and "layers" in self.params:  # (a registered model's: its own)
            self.params["layers"] = layer_scan.group_layers(self.params["layers"], cfg,
                                                            layer_scan.stack_on_device)
        self.num_pages, self.page_size, self.backend = num_pages, page_size, backend
        self.logprobs_mode = logprobs_mode
        self.channel = None
        self.reset_pool()
        self.lora = LoRAStack.zeros(cfg, *lora, self.dtype, self.mesh) if lora else None
        self._adapters = {"lora": self.lora} if lora else {}  # the step's argument, if any
        # Process 0 of several sends its device calls to the others (distributed.follow).
        if jax.process_count() > 1 and jax.process_index() == 0:
            self.channel = distributed.Channel()
        self._step = jitted_step(cfg, backend, self.mesh)
        # The feed of a step planned alone.
        self._no_feed = jax.device_put(np.zeros(max_sample_rows, np.int32),
                                       NamedSharding(self.mesh, PartitionSpec()))
        self._signatures: set = set()
        self._precompiler: Precompiler | None = None  # warm-up's compiles, keyed as _signatures
        self._left, self._left_lock = set(), threading.Lock()  # this warm-up's unfinished jobs
        # Only the weights: they are streamed whole every step. The pool's pages are read in
        # scattered small runs, which 2 MiB pages do not speed up, and collapsing a large pool
        # would add seconds to every start.
        self.huge_page_bytes = collapse_into_huge_pages(
            jax.tree_util.tree_leaves(self.params)) if huge_pages else 0

    def reset_pool(self, num_pages: int | None = None) -> None:
        """A zeroed KV pool (at start, after a failed step consumed the donated one, and of the
        planned size after a memory plan probed with a small one)."""
        if self.channel is not None:
            if num_pages not in (None, self.num_pages):
                raise ValueError("the pool's size is fixed when several processes serve")
            self.channel.send(distributed.Reset())
        self.num_pages = num_pages or self.num_pages
        self.pool = None  # the old pool's buffers go before the new ones are allocated
        if getattr(self, "_zeros", (None,))[0] != self.num_pages:  # kept: no compile again
            cfg, tp = self.cfg, sharding.tp_size(self.mesh)
            heads, layout = sharding.pool_layout_of(cfg, self.backend, tp, self.kv_dtype,
                                                    self.dtype)
            n, slots = self.num_pages, groups_of(cfg).size  # slots: each layer group's layers
            layers, pages = (1, slots * n) if self.scan_layers else (slots, n)  # scanned: one
            zeros = functools.partial(KVPool.zeros, layers, heads, pages,
                                      self.page_size, cfg.head_dim, self.kv_dtype, layout, tp)
            # Made in place on each device (never whole on one): sharded on the head axis.
            placed = sharding.pool_sharding(self.mesh, jax.eval_shape(zeros))
            self._zeros = (self.num_pages, jax.jit(zeros, out_shardings=placed))
        self.pool = self._zeros[1]()

    # ---- weights replaced in place, memory given back (runtime/param_update.py)
    def params_like(self) -> dict:  # structure, shapes, dtypes, shardings (ShapeDtypeStruct)
        if self.params is not None:
            self._like = param_update.abstract(self.params)
        return self._like

    def update_params(self, update) -> None:
        """Replace the params by a NamedUpdate's units or a tree like params_like(); the old
        buffers are freed, not those a caller lent."""
        if self.channel is not None or self.kv_dtype == jnp.int8:
            raise ValueError("weights are not updated in place " + (
                "with several processes" if self.channel is not None else
                "with an int8 KV cache (its key smoothing is calibrated on the loaded model)"))
        like = self.params_like()
        if isinstance(update, NamedUpdate):
            new, lent = param_update.from_units(update, self.params, like, self.cfg,
                                                self.mesh, self.backend, **self._placing), set()
        else:
            new, lent = param_update.from_tree(update, like)
        old, old_lent, self.params = self.params, self._lent, new
        self._lent = lent | (old_lent & {id(x) for x in jax.tree_util.tree_leaves(new)})
        param_update.delete_unused(old, new, old_lent)
        self.weights_version += 1

    def release(self, weights: bool) -> None:
        """Free the KV pool (reset_pool makes it again) and with `weights` the params too
        (update_params places them again); a caller's lent arrays are only dropped."""
        param_update.delete_unused(self.pool, None, set())
        self.pool = None
        if weights:
            self.params_like()
            param_update.delete_unused(self.params, None, self._lent)
            self.params, self._lent = None, set()

    @property
    def compilations(self) -> int:
        """Shapes compiled: by warm-up's jobs once done, and every shape a call met."""
        return len(self._signatures)

    @property
    def compilations_pending(self) -> int:  # warm-up's compiles queued or running
        return self._precompiler.pending() if self._precompiler is not None else 0

    def _compiled(self, key) -> None:
        """Before a call of signature `key`: its warm-up compile done (run here if not begun)."""
        if self._precompiler is not None:
            self._precompiler.wait(key)
        self._signatures.add(key)

    def memory_stats(self) -> dict:
        """Bytes of the weights and the KV pool, over all devices and on one (under tensor
        parallelism each device holds every page, for its KV heads; repeated heads count)."""
        pool_per_device = memory.bytes_on_device(self.pool)  # (0 asleep: release)
        return dict(kv_pool_bytes=getattr(self.pool, "nbytes", 0),
                    weight_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(self.params)),
                    kv_pool_bytes_per_device=pool_per_device,
                    kv_page_bytes_per_device=pool_per_device // self.num_pages,
                    weight_bytes_per_device=memory.bytes_on_device(self.params),
                    huge_page_bytes=self.huge_page_bytes)

    def dispatch(self, batch: StepBatch, copies=None, after=None,
                 controls: LogitControls | None = None, sample: bool = True):
        """Launch one step asynchronously, after the copy-on-write page copies (src, dst arrays)
        if any; returns device arrays (JAX dispatch is async). `after` is the output of the
        previous step when this one feeds on its samples (batch.feed_rows). The rows are
        sampled in a second small call chained on the device, through `controls` when given
        (runtime/logit_controls.py); with sample=False the caller launches it later
        (`sample`), once the controls are known."""
        if self.channel is not None:  # process 0 of several: the others run the same calls
            self.channel.send(distributed.Step(batch, copies, after is not None,
                                               controls if sample else None, sample))
        if copies is not None:
            self._copy_local(*copies)
        self._compiled(_signature(batch))
        feed = self._no_feed if after is None else after["feed"]
        self.pool, out = self._step(self.params, pool=self.pool,
                                    batch=dataclasses.replace(batch, sampling=None), feed=feed,
                                    **self._adapters)
        if sample:
            self._sample_local(out, batch.sampling, controls)
        return out

    def sample(self, out: dict, sampling: SamplingMetadata, controls) -> None:
        """Launch the sampling of a dispatched step's rows: out gains "sampled" and "feed".
        It is always the latest step's (the next one feeds on it): other processes apply it
        to theirs."""
        if self.channel is not None:
            self.channel.send(distributed.Sample(sampling, controls))
        self._sample_local(out, sampling, controls)

    def _sample_local(self, out: dict, sampling: SamplingMetadata, controls) -> None:
        self._compiled(("sample", _signature((sampling, controls))))
        out["sampled"], out["feed"] = sample_rows(
            out["logits"], sampling, controls, backend=self.backend,
            feed_size=self._no_feed.shape[0], logprobs_mode=self.logprobs_mode)

    def copy_pages(self, src, dst) -> None:
        if self.channel is not None:
            self.channel.send(distributed.Copy(src, dst))
        self._copy_local(src, dst)

    def _copy_local(self, src, dst) -> None:
        self._compiled(("copies", len(src)))
        self.pool = copy_pool_pages(self.pool, src, dst, self._scanned_layers)

    def follow(self) -> int:
        """A process other than 0 of several: run process 0's device calls until it stops."""
        return distributed.follow(self, distributed.Channel())

    def stop_followers(self) -> None:
        """Process 0 of several: the other processes' `follow` returns."""
        if self.channel is not None:
            self.channel.send(distributed.Stop())

    @staticmethod
    def fetch(out, num_rows: int) -> StepOutput:
        """Block on a dispatched step and copy its first num_rows rows to the host."""
        out = jax.device_get({k: v for k, v in out.items() if k not in ("feed", "logits")})
        ids, lp, top_ids, top_lp = out["sampled"]
        result = StepOutput(ids[:num_rows], lp[:num_rows], top_ids[:num_rows], top_lp[:num_rows])
        if "prompt" in out:
            result.prompt_logprobs, result.prompt_top_ids, result.prompt_top_logprobs = out["prompt"]
        return result

    def execute(self, batch: StepBatch, num_rows: int, copies=None,
                controls: LogitControls | None = None) -> StepOutput:
        return self.fetch(self.dispatch(batch, copies, controls=controls), num_rows)

    def _shape_batch(self, shape, buckets: Buckets, prompt_logprobs: int | None = None):
        plan = warmup_plan(shape, buckets, self.page_size, prompt_logprobs, self._groups)
        return build_batch(plan, buckets, self.page_size)[:2]

    def step_temp_bytes(self, shape, buckets: Buckets, prompt_logprobs: int | None = None) -> int:
        """Bytes the compiled step of `shape` (Buckets.step_shapes) allocates beside its
        arguments (memory.compiled_temp_bytes)."""
        batch, _ = self._shape_batch(shape, buckets, prompt_logprobs)
        return memory.compiled_temp_bytes(self._step.lower(
            self.params, pool=self.pool, batch=dataclasses.replace(batch, sampling=None),
            feed=self._no_feed, **self._adapters).compile())

    def run_shape(self, shape, buckets: Buckets) -> None:
        """Run one step of `shape` on dummy sequences of the scratch page 0."""
        self.execute(*self._shape_batch(shape, buckets))

    def warmup_count(self, buckets: Buckets, full: bool = False) -> int:
        """How many shapes `warmup` compiles (steps and copies), without compiling them."""
        return sum(1 for _ in warmup_batches(buckets, self.page_size, full)) + len(buckets.copies)

    def _warmup_jobs(self, buckets: Buckets, full: bool):
        """(key, what, compile, tokens) of each executable warm-up compiles, on the real
        arguments' types (so the jitted functions' caches keep them): each step shape, after the
        first step of each sample-row count its sampling calls (warmup_samplings), and the page
        copies."""
        pool, sampled = self.pool, set()
        for batch, _ in warmup_batches(buckets, self.page_size, full, self._groups):
            key, step = _signature(batch), dataclasses.replace(batch, sampling=None)
            tokens, rows = batch.token_ids.shape[0], batch.logits_indices.shape[0]
            yield (key, f"step of {tokens} tokens, {batch.attn.page_tables.shape[0]} rows, "
                   f"{rows} sampled", functools.partial(self._compile_step, pool, step), tokens)
            if rows in sampled:
                continue
            sampled.add(rows)
            for what, sampling, controls in warmup_samplings(batch.sampling, rows, buckets,
                                                             self.cfg.vocab_size, full):
                yield (("sample", _signature((sampling, controls))), what,
                       functools.partial(self._compile_sampling, key, sampling, controls), tokens)
        for n in buckets.copies:  # copy-on-write: forks and prefix hits mid-page only, last
            yield (("copies", n), f"page copy of {n} pages",
                   functools.partial(self._compile_copies, pool, np.zeros(n, np.int32)),
                   float("inf"))

    # The compiled executables stay in the jitted functions' caches alone (release_compiled_steps
    # frees them): a job returns at most the type of what its step's sampling call receives.
    def _compile_step(self, pool, step: StepBatch) -> jax.ShapeDtypeStruct:
        compiled = self._step.lower(self.params, pool=pool, batch=step, feed=self._no_feed,
                                    **self._adapters)
        return compiled.compile().out_info[1]["logits"]

    def _compile_sampling(self, step_key, sampling: SamplingMetadata, controls) -> None:
        logits = self._precompiler.wait(step_key)  # what step_key's step gives it
        logits = jax.device_put(np.zeros(logits.shape, logits.dtype), logits.sharding)
        sample_rows.lower(logits, sampling, controls, backend=self.backend,
                           feed_size=len(self._no_feed), logprobs_mode=self.logprobs_mode).compile()

    def _compile_copies(self, pool, zeros: np.ndarray) -> None:
        copy_pool_pages.lower(pool, zeros, zeros, self._scanned_layers).compile()

    @property
    def _scanned_layers(self) -> int:  # the scanned pool's layer slots (0: not scanned)
        return groups_of(self.cfg).size if self.scan_layers else 0
    _groups = property(lambda self: groups_of(self.cfg).num_groups)  # layer groups

    def warmup(self, buckets: Buckets, full: bool = False,
               on_shape: Callable[[str, float], None] | None = None, *, threads: int = 2,
               first_tokens: int | None = None, on_done: Callable[[], None] | None = None) -> int:
        """Compile ahead of time, in `threads` threads, the step shapes of Buckets.step_shapes,
        their sampling calls and every copies bucket (no request state changes); on_shape(what,
        seconds) after each, in the thread that compiled it. Returns once every one is compiled,
        or with first_tokens, once the steps of at most that many tokens are: the rest go on in
        the background (compilations_pending; with threads=0 each waits for the call that needs
        it), smallest first, page copies last; on_done() after the last. A call whose shape is
        queued or compiling waits for it: nothing compiles twice. Returns how many step and
        copies shapes there are."""
        if self._precompiler is None:
            self._precompiler = Precompiler(threads, self._job_done)
        jobs = list(self._warmup_jobs(buckets, full))
        later = lambda job: first_tokens is not None and job[3] > first_tokens  # noqa: E731
        jobs.sort(key=later)  # stable: the smallest shapes first within each part
        self._on_shape, self._on_done = on_shape, on_done
        self._left = {job[0] for job in jobs}  # before any can finish
        for job in jobs:
            if not self._precompiler.submit(*job[:3]):  # an earlier warm-up's
                self._settle(job[0])
        self._precompiler.wait_all(job[0] for job in jobs if not later(job))
        return sum(1 for job in jobs if not isinstance(job[0][0], str) or job[0][0] == "copies")

    def _job_done(self, key, what: str, seconds: float) -> None:  # in the compiling thread
        self._signatures.add(key)
        if self._on_shape is not None:
            self._on_shape(what, seconds)
        self._settle(key)

    def _settle(self, key) -> None:
        with self._left_lock:
            last = key in self._left and len(self._left) == 1
            self._left.discard(key)
        if last and self._on_done is not None:
            self._on_done()
