"""The memory plan: one budget in, the KV pool's size out (docs/design.md, "KV memory accounting").

    budget = weights + activation peak + runtime + margin + KV pool

per device. The weights are what the runner placed on the device. The activation peak is the
largest step's temporary buffers (fixed by max_num_batched_tokens and the largest rows bucket,
not by the requests admitted), read from the compiled step (XLA's memory analysis) for a plain
and a scoring (prompt logprobs) step, and confirmed by running the plain one: the larger of the
three counts. The runtime term is what the engine held beyond its arrays after that probe
(compiled code, the runtime's own buffers), as measured. The margin is MARGIN of the budget, for
what the probes cannot see (later compilations, allocator fragmentation). The KV pool gets the
rest, in whole pages (int8 scales, a draft model's pages and sharding counted by measuring one
page of the pool as the runner built it).

Admission then reserves KV pages only (plus the watermark, and speculative lookahead slots when
on): the activation peak is reserved once, here, whatever the requests.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from jaxserve.config import CacheConfig, ParallelConfig
from jaxserve.core.kv_groups import groups_of
from jaxserve.runtime import memory
from jaxserve.runtime.buckets import Buckets

MARGIN = 0.05
PROBE_SHAPES = 6
GIB = 2 ** 30
log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device."""

    budget_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    runtime_bytes: int
    margin_bytes: int
    page_bytes: int  # one page of every layer slot's pool (scales included)
    page_size: int
    num_pages: int  # scratch page 0 included
    # Each layer group's window (core/kv_groups.py; None: full attention): a request holds
    # pages in every group, a sliding group's only over its window.
    group_windows: tuple = (None,)

    def pages_per_group(self, max_model_len: int) -> list[int]:
        """Pages a decoding request of max_model_len tokens holds in each group."""
        n = math.ceil(max_model_len / self.page_size)
        return [n if w is None else min(n, math.ceil(w / self.page_size) + 1)
                for w in self.group_windows]

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def planned_bytes(self) -> int:
        """What the plan expects the engine to hold at its peak (the margin excluded)."""
        return (self.weight_bytes + self.activation_peak_bytes + self.runtime_bytes
                + self.kv_pool_bytes)

    def max_requests(self, max_model_len: int) -> int:
        """Requests of max_model_len tokens the pool holds at once."""
        return (self.num_pages - 1) // sum(self.pages_per_group(max_model_len))

    def describe(self, max_model_len: int) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:.3f} GiB"

        groups = "" if len(self.group_windows) == 1 else "; pages per request by layer group: " \
            + " + ".join(f"{n} ({'full' if w is None else f'window {w}'})" for n, w in
                         zip(self.pages_per_group(max_model_len), self.group_windows))
        return (f"memory plan per device: budget {gib(self.budget_bytes)} = weights "
                f"{gib(self.weight_bytes)} + activation peak {gib(self.activation_peak_bytes)}"
                f" + runtime {gib(self.runtime_bytes)} + margin {gib(self.margin_bytes)} "
                f"+ KV pool {gib(self.kv_pool_bytes)} ({self.num_pages} pages of "
                f"{self.page_size} tokens; {self.max_requests(max_model_len)} requests of "
                f"max_model_len {max_model_len} at once{groups})")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kv_pool_bytes": self.kv_pool_bytes,
                "planned_bytes": self.planned_bytes}


def largest_shape(buckets: Buckets, page_size: int) -> tuple[int, int, int]:
    """The step shape with the most tokens (decode rows + prefill tokens), then prefill rows,
    among all the scheduler can produce: the activation peak's step."""
    return max(buckets.step_shapes(page_size, full=True), key=lambda s: (s[0] + s[1], s[2]))


def plan(runner, buckets: Buckets, budget_bytes: int, held_before: int,
         compiled_shapes: int, draft=None) -> MemoryPlan:
    """Size the KV pool for a runner built with a probe pool, and resize the pool to the plan.
    held_before: memory.in_use(device) before the runner was built (the process's other holdings are
    not the engine's); compiled_shapes: how many step shapes the engine will compile (warm-up's
    count: each keeps its code in host memory, which on the CPU is the device's); draft: the
    draft model's runner (speculative method "draft"), on the same first device, whose pool
    has as many pages: its weights and pages are paid from the same budget."""
    shape = largest_shape(buckets, runner.page_size)
    runners = [runner] + ([draft] if draft is not None else [])
    device = runner.mesh.devices.flat[0]
    weights = sum(memory.bytes_on_device(r.params) for r in runners)
    probe_pool = sum(memory.bytes_on_device(r.pool) for r in runners)
    page_bytes = probe_pool // runner.num_pages
    # The step's temporaries, from XLA's analysis of the largest step, plain and scoring.
    compiled = max(runner.step_temp_bytes(shape, buckets, prompt_logprobs=k)
                   for k in (None, buckets.logprobs[-1]))
    # What a compiled step keeps: the median growth over compiling and running up to
    # PROBE_SHAPES more shapes on the probe pool (the first, the largest, also starts the
    # compiler and the runtime's pools; a compile's growth is noisy: allocator arenas grow in
    # jumps, or a compile reuses memory another freed).
    runner.run_shape(shape, buckets)
    growth = []
    others = [s for s in buckets.step_shapes(runner.page_size) if s != shape]
    for probe in sorted(others, key=sum)[:PROBE_SHAPES]:
        held = memory.in_use(device)
        runner.run_shape(probe, buckets)
        growth.append(max(0, memory.in_use(device) - held))
    per_shape = int(np.median(growth)) if growth else 0
    log.debug("plan probes grew %s", growth)
    runtime = max(0, memory.in_use(device) - held_before - weights - probe_pool)
    log.debug("plan runtime: %d held + %d per shape x %d", runtime, per_shape, compiled_shapes)
    runtime += per_shape * compiled_shapes  # each compiles again for the planned pool
    # Confirm the activation peak with one real step of the largest shape (its temporaries do
    # not depend on the pool's size, so the probe pool shows them): the plan takes the larger.
    # Where the peak cannot be reset (an accelerator's allocator keeps the lifetime peak) the
    # run confirms only what it adds above that peak.
    fresh = memory.reset_peak()
    start = memory.in_use(device)
    floor = start if fresh else max(start, memory.peak(device))
    runner.run_shape(shape, buckets)
    ran = max(0, memory.peak(device) - floor)
    if ran > compiled:
        log.info("the largest step held %d bytes beyond its arguments, more than XLA's "
                 "analysis (%d): the plan counts the measured peak", ran, compiled)
    activation = max(compiled, ran)
    margin = int(MARGIN * budget_bytes)
    num_pages = (budget_bytes - weights - activation - runtime - margin) // page_bytes
    if num_pages < 2:
        need = weights + activation + runtime + 2 * page_bytes
        raise ValueError(
            f"a memory budget of {budget_bytes} bytes ({budget_bytes / GIB:.3f} GiB) cannot hold "
            f"the weights ({weights}), the largest step's activations ({activation}), the "
            f"runtime ({runtime}) and 2 KV pages ({2 * page_bytes}) with a {MARGIN:.0%} margin:"
            f" the minimum is {math.ceil(need / (1 - MARGIN))} bytes (or lower "
            "max_num_batched_tokens / max_num_seqs)")
    for r in runners:
        r.reset_pool(int(num_pages))
    runner.run_shape(shape, buckets)  # compiled for the planned pool: warm-up finds it ready
    return MemoryPlan(budget_bytes=budget_bytes, weight_bytes=weights,
                      activation_peak_bytes=activation, runtime_bytes=runtime,
                      margin_bytes=margin, page_bytes=page_bytes, page_size=runner.page_size,
                      num_pages=int(num_pages), group_windows=groups_of(runner.cfg).windows)


def budget(config: CacheConfig, parallel: ParallelConfig, platform: str) -> int | None:
    """The budget per device in bytes, or None: no plan, the pool is sized by num_pages or
    kv_cache_bytes (which override a budget) or, on CPU, by CacheConfig.resolve_num_pages.
    A budget or a KV size larger than the device's memory is refused (ValueError) before
    anything is allocated."""
    for name in ("memory_budget_bytes", "kv_cache_bytes"):
        value = getattr(config, name)
        if value is not None and value > (capacity := memory.capacity()):
            raise ValueError(f"{name}={value} ({value / GIB:.1f} GiB) is more than a device here "
                             f"holds: {capacity} bytes ({capacity / GIB:.1f} GiB)")
    if config.num_pages is not None or config.kv_cache_bytes is not None:
        return None
    if parallel.num_processes > 1:  # the plan is one process's: the default pool size instead
        if config.memory_budget_bytes or config.memory_utilization:
            raise ValueError("a memory budget is planned by one process: with num_processes > "
                             "1 give num_pages or kv_cache_bytes")
        return None
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    utilization = config.planned_utilization(platform)
    return None if utilization is None else int(utilization * memory.capacity())
