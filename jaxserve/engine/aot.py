"""Ahead-of-time compiles of the engine's calls (`jaxserve compile`).

For a TPU topology (runtime/topology.py), on any x86 host: every executable the engine's warm-up
compiles (each step shape of Buckets.step_shapes, the sampling call per sample-row count and
mode, the page copies) is compiled for that topology's devices from abstract inputs: the params
as the runner would place them under tensor_parallel_size (runtime/abstract.py, no weight read),
the KV pool of the planned size. The memory plan is the engine's (engine/memory_plan.py) with
the compiled steps' memory analysis in place of measurements, per device:

    budget (memory_utilization x HBM) = weights + activation peak + runtime + margin + KV pool

the activation peak being the largest step's (plain or scoring) temporaries and outputs beside
the donated pool, the runtime the compiled code (the largest step's code per compiled shape and
the largest sampling call's per sampling call: an accelerator keeps a loaded program in its
memory), the margin memory_plan.MARGIN of the budget.

For this host's own backend: the engine is built and warmed up, so its compiles land in JAX's
persistent compilation cache, where `serve`, `generate`, `batch` and `LLM` find them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import time

import jax
import numpy as np

from jaxserve import backends
from jaxserve.config import DEFAULT_MEMORY_UTILIZATION, EngineConfig, ModelConfig
from jaxserve.core import kv_groups
from jaxserve.model import layer_scan
from jaxserve.engine import memory_plan, roofline
from jaxserve.engine.assembly import PROBE_PAGES, Assembly
from jaxserve.engine.memory_plan import GIB, MARGIN, MemoryPlan
from jaxserve.runtime import abstract, memory, sharding
from jaxserve.runtime.batch import build_batch, warmup_batches, warmup_plan, warmup_samplings
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.runner import copy_pool_pages, jitted_step, sample_rows
from jaxserve.runtime.sampling import FILTERED
from jaxserve.runtime.topology import Topology, compile_target, tpu_topology
from jaxserve.weights.model_config import read_model_config


@dataclasses.dataclass(frozen=True)
class Target:
    """What the engine would run on one replica of the topology."""

    model: ModelConfig
    topology: Topology
    mesh: jax.sharding.Mesh
    backend: backends.Backend
    buckets: Buckets
    dtype: str
    kv_dtype: str
    page_size: int
    max_model_len: int
    scan_layers: bool = False  # LoadConfig.scan_layers resolved for the backend
    expert_parallel: bool = False  # ParallelConfig.enable_expert_parallel


@dataclasses.dataclass
class CompileReport:
    target: Target
    plan: MemoryPlan | None  # None: the largest step did not compile (see failures)
    fits: bool
    shapes: int = 0  # step and page-copy shapes compiled: the engine's warm-up count
    sampling_calls: int = 0
    failures: list = dataclasses.field(default_factory=list)  # {"shape", "error"}
    compile_seconds: float = 0.0
    generated_code_bytes: int = 0  # measured, over every executable compiled
    step_peak_bytes: int = 0  # the most a compiled step holds: arguments, temporaries, outputs
    cost: dict | None = None  # the roofline report (roofline.py), when asked for and compiled

    def as_dict(self) -> dict:
        t, p = self.target, self.plan
        per_device = None if p is None else {
            "weight_bytes": p.weight_bytes, "kv_pool_bytes": p.kv_pool_bytes,
            "activation_peak_bytes": p.activation_peak_bytes, "runtime_bytes": p.runtime_bytes,
            "margin_bytes": p.margin_bytes, "budget_bytes": p.budget_bytes,
            "page_bytes": p.page_bytes, "generated_code_bytes": self.generated_code_bytes,
            "step_peak_bytes": self.step_peak_bytes}
        return {"topology": t.topology.name, "device_kind": t.topology.device_kind,
                "hbm_bytes_per_device": t.topology.hbm_bytes_per_device,
                "tensor_parallel_size": sharding.tp_size(t.mesh), "dtype": t.dtype,
                "kv_cache_dtype": t.kv_dtype, "attention_backend": t.backend.name,
                "max_model_len": t.max_model_len, "page_size": t.page_size,
                "shapes": self.shapes, "sampling_calls": self.sampling_calls,
                "failures": self.failures,
                "per_device": per_device, "num_pages": None if p is None else p.num_pages,
                "fits": self.fits, "cost": self.cost,
                "compile_seconds": round(self.compile_seconds, 2)}

    def refusal(self) -> str:
        """Why the model does not fit, in GiB per device."""
        p, t = self.plan, self.target
        if p is None:
            return (f"the largest step does not compile for {t.topology.name}: "
                    f"{self.failures[0]['error']}")
        held = self.step_peak_bytes + self.generated_code_bytes
        if p.num_pages >= 2 and held > t.topology.hbm_bytes_per_device:
            return (f"{t.topology.name}: the compiled steps and code hold {held / GIB:.2f} GiB "
                    f"per device, more than its {t.topology.hbm_bytes_per_device / GIB:.0f} GiB "
                    "HBM")
        terms = {"weights": p.weight_bytes, "activations": p.activation_peak_bytes,
                 "runtime": p.runtime_bytes, "margin": p.margin_bytes, "2 KV pages": 2 * p.page_bytes}
        held = " + ".join(f"{k} {v / GIB:.2f} GiB" if v >= GIB / 100 else
                          f"{k} {v / 2 ** 20:.1f} MiB" for k, v in terms.items() if v)
        return (f"{t.topology.name} at tensor_parallel_size {sharding.tp_size(t.mesh)} cannot "
                f"hold the model: per device, {held} > a budget of {p.budget_bytes / GIB:.2f} "
                f"GiB ({t.topology.hbm_bytes_per_device / GIB:.0f} GiB HBM)")


def tpu_target(config: EngineConfig, topology_name: str) -> Target:
    """The engine's configuration resolved for a TPU topology as a TPU host would resolve it
    (assembly.py); ValueError for what the engine would refuse there."""
    load, parallel = config.load, config.parallel
    model = read_model_config(load.model)
    tp = parallel.tensor_parallel_size
    if load.quantization not in ("none", "int8"):
        raise ValueError(f"quantization={load.quantization!r} runs on the CPU backend; on a "
                         "TPU use none or int8 (dtype bfloat16 is the default there)")
    sharding.check_fits(model, tp, load.quantization, parallel.enable_expert_parallel)
    spec = config.speculative
    if spec is not None and spec.method == "draft":
        raise ValueError("jaxserve compile does not compile a draft model's calls yet; use "
                         "speculative method ngram or none")
    topology = tpu_topology(topology_name)
    need = tp * parallel.data_parallel_size
    if need > len(topology.devices):
        raise ValueError(f"tensor_parallel_size {tp} x data_parallel_size "
                         f"{parallel.data_parallel_size} needs {need} devices; {topology_name} "
                         f"has {len(topology.devices)}")
    mesh = sharding.replica_mesh(sharding.make_mesh(tp, devices=topology.devices), 0)
    assembly = Assembly.of(config, model, "tpu")
    r = assembly.resolved
    return Target(model, topology, mesh, assembly.backend, assembly.buckets, r.dtype,
                  r.kv_cache_dtype, config.cache.page_size, r.max_model_len, r.scan_layers,
                  parallel.enable_expert_parallel)


class _Compiler:
    """The target's calls lowered on abstract inputs and compiled."""

    def __init__(self, target: Target):
        self.t = target
        self.params = abstract.abstract_params(target.model, target.mesh, target.dtype,
                                               scan_layers=target.scan_layers,
                                               expert_parallel=target.expert_parallel)
        self.step = jitted_step(target.model, target.backend, target.mesh)
        self.feed = abstract.replicated(np.zeros(target.buckets.max_sample_rows, np.int32),
                                        target.mesh)

    def pool(self, num_pages: int):
        t = self.t
        return abstract.abstract_pool(t.model, t.mesh, num_pages, t.page_size, t.kv_dtype,
                                      t.backend, t.dtype, scan_layers=t.scan_layers)

    def batch(self, shape, prompt_logprobs: int | None = None):
        b, t = self.t.buckets, self.t
        plan = warmup_plan(shape, b, t.page_size, prompt_logprobs,
                           kv_groups.groups_of(t.model).num_groups)
        return build_batch(plan, b, t.page_size)[0]

    def compile_step(self, batch, pool, options: dict | None = None):
        step = abstract.replicated(dataclasses.replace(batch, sampling=None), self.t.mesh)
        with compile_target(self.t.mesh):
            return self.step.lower(self.params, pool=pool, batch=step,
                                   feed=self.feed).compile(options)

    def samplings(self, batch) -> list:
        """(what, sampling, controls) of each sampling call the engine's warm-up compiles after
        a step like `batch` (batch.warmup_samplings, the runner's list)."""
        return list(warmup_samplings(batch.sampling, batch.logits_indices.shape[0],
                                     self.t.buckets, self.t.model.vocab_size))

    def compile_sampling(self, batch, sampling, controls):
        rows, vocab = batch.logits_indices.shape[0], self.t.model.vocab_size
        logits = abstract.replicated(np.zeros((rows, vocab), np.float32), self.t.mesh)
        sampling = abstract.replicated(sampling, self.t.mesh)
        ctl = abstract.replicated(controls, self.t.mesh) if controls is not None else None
        with compile_target(self.t.mesh):
            return sample_rows.lower(logits, sampling, ctl, backend=self.t.backend,
                                     feed_size=self.feed.shape[0]).compile()

    def compile_copies(self, n: int, pool):
        idx = abstract.replicated(np.zeros(n, np.int32), self.t.mesh)
        with compile_target(self.t.mesh):
            return copy_pool_pages.lower(pool, idx, idx, kv_groups.groups_of(self.t.model).size
                                         if self.t.scan_layers else 0).compile()


def plan_memory(config: EngineConfig, target: Target, compiler: _Compiler) -> MemoryPlan:
    """The engine's memory plan, from the largest step compiled (plain and scoring) on a probe
    pool; the pool's size from the budget, or from num_pages / kv_cache_bytes when given.

    Unlike on the host, a step's temporaries may grow with the pool: XLA's TPU compiler lays out
    again (copies) a pool whose head_dim is below the 128 lanes of a vector register, every step.
    So the largest step is compiled again with a larger pool, and where it grew, each page is
    charged its share of the growth too (the warm-up's compiles at the planned size check it)."""
    t, b, cache = target, target.buckets, config.cache
    weights = abstract.bytes_per_device(compiler.params)
    page_bytes = abstract.bytes_per_device(compiler.pool(1))
    hbm = t.topology.hbm_bytes_per_device
    budget = cache.memory_budget_bytes or int(
        (cache.memory_utilization or DEFAULT_MEMORY_UTILIZATION) * hbm)
    margin = int(MARGIN * budget)
    plan = functools.partial(MemoryPlan, budget_bytes=budget, weight_bytes=weights,
                             margin_bytes=margin, page_bytes=page_bytes, page_size=t.page_size,
                             group_windows=kv_groups.groups_of(t.model).windows)
    if weights + margin + 2 * page_bytes > budget:  # no step need be compiled to know
        return plan(activation_peak_bytes=0, runtime_bytes=0, num_pages=0)
    shape = memory_plan.largest_shape(b, t.page_size)
    probe = compiler.pool(PROBE_PAGES)
    compiled = [compiler.compile_step(compiler.batch(shape, k), probe)
                for k in (None, b.logprobs[-1])]
    activation = max(memory.compiled_temp_bytes(c) for c in compiled)
    code = compiled[0].memory_analysis().generated_code_size_in_bytes
    batches = [batch for batch, _ in warmup_batches(
        b, t.page_size, num_groups=kv_groups.groups_of(t.model).num_groups)]
    warmup_shapes = len(batches) + len(b.copies)
    # The sampling calls' code too (for an 8B at TP 4 it was 0.1 of 0.24 GiB of code): the
    # largest one (the most rows, filtered, with logit controls) counted for each of them.
    largest = compiler.batch(shape)
    _, filtered, masks = max(compiler.samplings(largest),
                             key=lambda c: (c[1].mode == FILTERED, c[2] is not None))
    sampling = compiler.compile_sampling(largest, filtered, masks)
    sampling_calls = sum(len(compiler.samplings(x)) for x in
                         {x.logits_indices.shape[0]: x for x in batches}.values())
    runtime = (int(code) * warmup_shapes + sampling_calls
               * int(sampling.memory_analysis().generated_code_size_in_bytes))
    rest = budget - weights - runtime - margin
    num_pages = (rest - activation) // page_bytes
    sized = cache.num_pages is not None or cache.kv_cache_bytes is not None
    if sized:
        num_pages = cache.num_pages or cache.kv_cache_bytes // page_bytes
    if num_pages > PROBE_PAGES:
        # An eighth of the size: at the full size such copies may not compile at all.
        size = max(PROBE_PAGES + 1, num_pages // 8)
        grown = memory.compiled_temp_bytes(compiler.compile_step(compiler.batch(shape),
                                                                 compiler.pool(size)))
        per_page = max(0, grown - memory.compiled_temp_bytes(compiled[0])) / (size - PROBE_PAGES)
        if per_page and not sized:
            num_pages = int((rest - activation) // (page_bytes + per_page))
        activation += math.ceil(per_page * max(0, num_pages - PROBE_PAGES))
    return plan(activation_peak_bytes=activation, runtime_bytes=runtime,
                num_pages=int(max(num_pages, 0)))


def _shallow(target: Target, layers: int) -> Target:
    """The target with its first `layers` layers, unscanned (the cost report's compiles)."""
    m = target.model
    model = dataclasses.replace(m, num_layers=layers, layer_types=m.layer_types and
                                m.layer_types[:layers],
                                mlp_only_layers=tuple(i for i in m.mlp_only_layers if i < layers))
    return dataclasses.replace(target, model=model, scan_layers=False)


def _cost_compilers(compiler: _Compiler) -> tuple[list, float]:
    """Compilers whose steps, compiled with roofline.COST_OPTIONS, give the target's cost
    (roofline.extrapolate over the periods returned): a scanned step counts its loop body once,
    so the first one and two periods of layers, unscanned; an unscanned target its own."""
    target = compiler.t
    if not target.scan_layers:
        return [compiler], 1.0
    p, layers = layer_scan.period(target.model), target.model.num_layers
    if 2 * p > layers:
        return [_Compiler(_shallow(target, layers))], 1.0
    return [_Compiler(_shallow(target, p)), _Compiler(_shallow(target, 2 * p))], layers / p


def _jobs(compiler: _Compiler, pool, costers=(), num_pages: int = 0):
    """(what, kind, compile) of every executable the engine's warm-up compiles (runner.warmup):
    each step, its sampling call per sample-row count in each mode without and with logit
    controls (masks only), and each page-copies bucket; with costers (_cost_compilers), each
    step's again by each of them ("cost 0", "cost 1")."""
    b, sampled = compiler.t.buckets, set()
    groups = kv_groups.groups_of(compiler.t.model).num_groups
    pools = [pool if c is compiler else c.pool(num_pages) for c in costers]
    for batch, _ in warmup_batches(b, compiler.t.page_size, num_groups=groups):
        rows = batch.logits_indices.shape[0]
        what = (f"step of {batch.token_ids.shape[0]} tokens, "
                f"{batch.attn.page_tables.shape[-2]} rows, {rows} sampled")
        yield what, "step", lambda batch=batch: (batch, compiler.compile_step(batch, pool)), batch
        for i, (c, p) in enumerate(zip(costers, pools)):
            yield (f"{what}, {c.t.model.num_layers} unscanned layers (cost)", f"cost {i}",
                   lambda batch=batch, c=c, p=p: (batch, c.compile_step(
                       batch, p, roofline.COST_OPTIONS)), batch)
        if rows not in sampled:
            sampled.add(rows)
            for what, sampling, controls in compiler.samplings(batch):
                yield (what, "sampling", lambda batch=batch, s=sampling, c=controls:
                       compiler.compile_sampling(batch, s, c), None)
    for n in b.copies:
        yield (f"page copy of {n} pages", "copies",
               lambda n=n: compiler.compile_copies(n, pool), None)


def cost_report(config: EngineConfig, topology_name: str, num_pages: int,
                tokens: tuple[int, ...] | None = None) -> dict:
    """The roofline report (roofline.report) of the step shapes of `tokens` tokens (None: all)
    over a pool of num_pages pages, without the memory plan or the other executables: the cost
    compiles alone, as compile_for_topology makes them (a scanned target's 1 and 2 periods)."""
    target = tpu_target(config, topology_name)
    compiler = _Compiler(target)
    costers, periods = _cost_compilers(compiler)
    batches, costs = {}, {}
    for _, kind, fn, batch in _jobs(compiler, compiler.pool(num_pages), costers, num_pages):
        if not kind.startswith("cost") or (tokens and batch.token_ids.shape[0] not in tokens):
            continue
        i = len(batches) - (kind != "cost 0")  # a shape's cost compiles follow one another
        batches[i] = batch
        costs[kind, i] = roofline.compiled_cost(fn()[1])
    return roofline.report(target, batches, costs, periods)


def _failure(what: str, e: Exception) -> dict:
    line = (str(e).strip().splitlines() or [""])[0][:400]
    return {"shape": what, "error": f"{type(e).__name__}: {line}"}


def compile_for_topology(config: EngineConfig, topology_name: str, threads: int = 2,
                         cost: bool = True, progress=None) -> CompileReport:
    """Plan the engine's memory on the topology and, when the model fits, compile every
    executable of its warm-up, `threads` at a time, and with `cost` the roofline report of its
    steps. A compile that fails is reported, not raised; bad configurations raise ValueError.
    progress(line), when given, hears of each executable as it is compiled."""
    start = time.perf_counter()
    target = tpu_target(config, topology_name)
    compiler = _Compiler(target)
    try:
        plan = plan_memory(config, target, compiler)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
        report = CompileReport(target, None, False, failures=[_failure("largest step (memory "
                                                                       "plan)", e)])
        report.compile_seconds = time.perf_counter() - start
        return report
    fits = plan.num_pages >= 2 and plan.planned_bytes <= plan.budget_bytes
    report = CompileReport(target, plan, fits)
    say = progress or (lambda line: None)
    say(f"memory plan: {plan.num_pages} pages, fits: {fits} "
        f"({time.perf_counter() - start:.0f} s)")
    if fits:
        pool = compiler.pool(plan.num_pages)
        costers, periods = _cost_compilers(compiler) if cost else ([], 1.0)
        jobs = list(_jobs(compiler, pool, costers, plan.num_pages))
        batches, costs, done = {}, {}, collections.Counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as workers:
            futures = [(what, kind, workers.submit(fn)) for what, kind, fn, _ in jobs]
            for n, (what, kind, future) in enumerate(futures, 1):
                try:
                    compiled = future.result()
                except Exception as e:  # noqa: BLE001 - one shape's failure is reported
                    report.failures.append(_failure(what, e))
                    say(f"[{n}/{len(jobs)}] FAILED {what}")
                    continue
                finally:
                    done[kind] += 1
                say(f"[{n}/{len(jobs)}] {what} ({time.perf_counter() - start:.0f} s)")
                if kind == "step" or kind.startswith("cost"):  # (batch, compiled)
                    batches[done[kind] - 1] = compiled[0]
                    if kind != "step":
                        costs[kind, done[kind] - 1] = roofline.compiled_cost(compiled[1])
                        continue
                    compiled = compiled[1]
                m = compiled.memory_analysis()
                report.generated_code_bytes += int(m.generated_code_size_in_bytes)
                if kind == "step":
                    report.step_peak_bytes = max(report.step_peak_bytes, int(
                        m.argument_size_in_bytes + m.temp_size_in_bytes
                        + m.output_size_in_bytes - m.alias_size_in_bytes))
                if kind == "sampling":
                    report.sampling_calls += 1
                else:
                    report.shapes += 1
        if cost:
            report.cost = roofline.report(target, batches, costs, periods)
    # What the compiled steps hold, checked against the chip (the plan's own terms are estimates).
    held = report.step_peak_bytes + report.generated_code_bytes
    report.fits &= held <= target.topology.hbm_bytes_per_device
    report.compile_seconds = time.perf_counter() - start
    return report


def warm_host_cache(config: EngineConfig) -> dict:
    """Build the engine on this host's backend and run its warm-up, so that every shape lands in
    JAX's persistent compilation cache (the runner turns it on; JAX_COMPILATION_CACHE_DIR or
    --compilation_cache_dir names where). Returns the warm-up's counts and the cache's files."""
    from jaxserve.engine import make_engine

    start = time.perf_counter()
    engine = make_engine(config)
    cache_dir = jax.config.jax_compilation_cache_dir
    warm = engine.warmup()
    files = len(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else 0
    return {"topology": None, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "shapes": warm["shapes"],
            "compilations": warm["compilations"], "cache_dir": cache_dir, "cache_files": files,
            "compile_seconds": round(time.perf_counter() - start, 2)}
