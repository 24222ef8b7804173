"""LLMEngine: add_request / abort / step. Each step: the scheduler plans, the batch builder pads,
the runner executes one jitted call, the scheduler and output processor consume the tokens."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from jaxserve.batch import Buckets, build_batch, page_copies
from jaxserve.config import EngineConfig
from jaxserve.model.attention import resolve_backend
from jaxserve.output_processor import OutputProcessor
from jaxserve.outputs import RequestOutput
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import RequestRejected, Scheduler
from jaxserve.sequence import Request, Sequence, SequenceStatus
from jaxserve.step_plan import ScheduledChunk, StepPlan
from jaxserve.weights import LoadedModel, load_model

Prompt = str | list[int] | dict
# The XLA path attends prefill tokens in blocks of this many, each within one sequence; the
# packed (ragged) layout is for the C++ and Pallas kernels.
XLA_QUERY_BLOCK = 16


@dataclasses.dataclass
class _Launched:
    """A step on the device: its plan, output arrays, real sample rows and chunk offsets."""

    plan: StepPlan
    out: dict
    num_rows: int
    offsets: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load_model(config.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.num_pages = config.resolve_num_pages(loaded.config, self.max_model_len)
        eos = tuple(sorted(set(loaded.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.scheduler = Scheduler(
            config, num_pages=self.num_pages, max_model_len=self.max_model_len, eos_token_ids=eos,
            model_fingerprint=f"{loaded.fingerprint}:{config.dtype}:{config.quantization}")
        params = loaded.params
        self.backend = resolve_backend(config.attention_backend, config.dtype)
        if config.quantization == "int8":
            from jaxserve.quantize import quantize_int8

            params = quantize_int8(params)
        elif config.quantization == "bf16":
            from jaxserve.quantize import round_bf16
            from pallas_kernels import cpu_kernels

            amx = cpu_kernels.amx_bf16_available()
            if self.backend != "cpu" or not amx:
                raise ValueError(f"quantization='bf16' runs on the CPU backend with AMX-BF16 "
                                 f"(backend {self.backend!r}, AMX "
                                 f"{'available' if amx else 'unavailable'}); on GPU or TPU use "
                                 "dtype='bfloat16'")
            params = round_bf16(params)
        self.buckets = Buckets.for_engine(
            config.max_num_seqs, config.max_num_batched_tokens,
            math.ceil(self.max_model_len / config.page_size),
            query_block=XLA_QUERY_BLOCK if self.backend == "xla" else 1,
            packed=self.backend == "cpu")
        self.runner = ModelRunner(loaded.config, params, num_pages=self.num_pages,
                                  page_size=config.page_size, dtype=config.dtype,
                                  backend=self.backend,
                                  max_sample_rows=2 * self.buckets.seqs[-1],  # decode + prefill
                                  huge_pages=config.huge_pages)
        self._in_flight: _Launched | None = None  # the step on the device, not yet fetched
        self.outputs = OutputProcessor(self.tokenizer)
        self._requests: dict[str, tuple[Request, str | None]] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self.num_steps = 0
        self.peak_referenced_pages = 0
        # Wall time of step() split into host work (schedule, build, dispatch, outputs) and waiting
        # for the device; host_overlapped_seconds is the host work done while a step ran.
        self.host_seconds = 0.0
        self.host_overlapped_seconds = 0.0
        self.device_seconds = 0.0

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
                    raise ValueError(f"prompt_token_ids must be in [0, {self.model_config.vocab_size})")
                return prompt.get("prompt"), ids
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return self.tokenize({"prompt_token_ids": prompt})
        raise TypeError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids'; got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> Request:
        """Queue a request. Raises ValueError (RequestRejected) at once if it can never run.
        cache_salt (default: the engine's) isolates prefix-cache sharing per tenant."""
        text, ids = self.tokenize(prompt)
        params = dataclasses.replace(params or SamplingParams())
        if params.seed is None:  # unseeded: a fresh seed per request, fixed for its lifetime
            params.seed = int(self._rng.integers(0, 2**31 - 1))
        request = Request(request_id=request_id or f"req-{next(self._ids)}", prompt_token_ids=ids,
                          sampling_params=params, priority=params.priority,
                          cache_salt=cache_salt if cache_salt is not None else self.config.cache_salt)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self._requests[request.request_id] = (request, text)
        return request

    def abort(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        aborted = self.scheduler.abort(request_id)
        if entry is not None:
            self.outputs.release(entry[0])
        if not self.scheduler.has_unfinished():
            self._settle()
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a snapshot of every request that progressed.

        With async_scheduling the next step is planned and launched before this one's tokens are
        read back (Scheduler.schedule_next: when nothing waits and every running sequence
        decodes), so the host's planning, batch building and dispatch overlap the device."""
        t0 = time.perf_counter()
        if self._in_flight is None:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                self.scheduler.update(plan, [])
                return []
            self._in_flight = self._launch(plan)
        t_launched = time.perf_counter()
        current = self._in_flight
        self._in_flight = None
        if self.config.async_scheduling:
            plan = self.scheduler.schedule_next(current.plan)
            if plan is not None:
                self._in_flight = self._launch(plan, after=current.out)
        t1 = time.perf_counter()
        out = self.runner.fetch(current.out, current.num_rows)
        t2 = time.perf_counter()
        results = self._apply(current, out)
        ahead = self._in_flight is not None
        if ahead and not self.scheduler.has_unfinished():
            self._settle()  # everything it computes was finished meanwhile: drop it now
        t3 = time.perf_counter()
        # Host work while a step ran on the device overlapped it: planning the next step while
        # `current` ran, and applying `current` while the next one runs.
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.host_overlapped_seconds += (t1 - t_launched) + ((t3 - t2) if ahead else 0.0)
        self.device_seconds += t2 - t1
        return results

    def _launch(self, plan: StepPlan, after=None) -> "_Launched":
        batch, num_rows, offsets = build_batch(plan, self.buckets, self.config.page_size)
        copies = page_copies(plan.copies, self.buckets) if plan.copies else None
        return _Launched(plan, self.runner.dispatch(batch, copies, after), num_rows, offsets)

    def _apply(self, launched: "_Launched", out) -> list[RequestOutput]:
        plan = launched.plan
        self._record_logprobs(plan, out)
        if out.prompt_logprobs is not None:
            self._record_prompt_logprobs(plan, launched.offsets, out)
        changed = self.scheduler.update(plan, [int(t) for t in out.token_ids])
        self.num_steps += 1
        self.peak_referenced_pages = max(self.peak_referenced_pages,
                                         self.scheduler.pool.num_referenced)
        return self._process(changed)

    def _settle(self) -> None:
        """Read back and apply the step in flight, if any (its sequences are all finished or
        aborted, so its tokens are dropped): afterwards no plan is outstanding."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._apply(launched, self.runner.fetch(launched.out, launched.num_rows))

    def _record_logprobs(self, plan: StepPlan, out) -> None:
        for i, (_, seq) in enumerate(plan.sample_rows):
            if seq.sampling_params.logprobs is None or seq.status is not SequenceStatus.RUNNING:
                continue  # (a finished sequence's token from a step planned ahead is dropped)
            entry = {int(t): float(lp) for t, lp in zip(out.top_ids[i][:seq.sampling_params.logprobs],
                                                          out.top_logprobs[i])}
            entry[int(out.token_ids[i])] = float(out.logprobs[i])
            seq.output_logprobs.append(entry)

    @staticmethod
    def _record_prompt_logprobs(plan: StepPlan, offsets: list[int], out) -> None:
        """request.prompt_logprobs[i] = {prompt token i: logprob, top-k...} (None for i = 0)."""
        for chunk, first in zip(plan.chunks, offsets):
            seq = chunk.seq
            k = seq.sampling_params.prompt_logprobs
            if k is None or seq.fork_index:
                continue
            request = seq.request
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None]
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                target = p + 1
                if target >= seq.num_prompt_tokens or target < len(request.prompt_logprobs):
                    continue  # past the prompt, or already recorded (recompute after preemption)
                i = first + p - chunk.start
                entry = {int(t): float(lp) for t, lp in
                         zip(out.prompt_top_ids[i][:k], out.prompt_top_logprobs[i][:k])}
                entry[seq.token_ids[target]] = float(out.prompt_logprobs[i])
                request.prompt_logprobs.append(entry)

    def _process(self, changed: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        results = []
        for request in changed:
            for seq, stop in self.outputs.update(request, now):
                self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)
            if request.is_finished and request.finished_time is None:
                request.finished_time = now
            entry = self._requests.get(request.request_id)
            results.append(self.outputs.snapshot(request, entry[1] if entry else None))
            if request.is_finished:
                self._requests.pop(request.request_id, None)
                self.outputs.release(request)
        return results

    # ----------------------------------------------------------------- compilation
    def warmup(self, full: bool = False) -> dict:
        """Compile step shapes before traffic arrives. By default: every decode-only bucket and
        every prefill-only token bucket with one row; full=True adds every combination of decode
        rows, prefill tokens and prefill rows the scheduler can produce. Both compile the
        copy-on-write page copies for every copies bucket. Warm-up steps use only the scratch
        page 0 and change no request state. Returns counts and seconds."""
        t0, before = time.perf_counter(), self.runner.compilations
        seqs = (0,) + self.buckets.seqs
        tokens = (0,) + self.buckets.tokens
        qb = self.buckets.query_block
        max_chunk = self.buckets.pages * self.config.page_size
        max_units = -(-max_chunk // qb)  # query blocks one row's chunk can span
        combos = set()
        packed = self.buckets.packed  # decode rows are one-token chunks: Sd is always 0
        for sd, (prev, tp) in itertools.product((0,) if packed else seqs, zip((0,) + tokens, tokens)):
            if sd + tp == 0:
                continue
            if tp == 0:
                rows = [0]
            else:
                # Rows that can land in this token bucket: each fills whole query blocks, and
                # none is longer than its page table holds (max_model_len), so sp rows reach
                # past the previous bucket only if sp * max_units blocks do.
                # Rows pad to their own buckets, so r <= units rows can take a rows bucket above
                # units (3 rows in the 3-token bucket are 4 rows).
                units = tp // qb
                top = self._rows_bucket(units)
                fits = [s for s in seqs if 0 < s <= top and s * max_units * qb > prev]
                rows = fits if full else fits[:1]
            combos.update((sd, tp, sp) for sp in rows if full or sd == 0 or tp == 0)
        if packed and not full:  # decode-only steps: as many one-token rows as tokens
            combos.update((0, Buckets.fit(self.buckets.tokens, r), self._rows_bucket(r))
                          for r in range(1, min(self.buckets.seqs[-1], self.buckets.tokens[-1]) + 1))
        greedy = SamplingParams(temperature=0)
        dummy = Request("warmup", [0], greedy)
        width = self.buckets.pages

        def seq(num_tokens: int) -> Sequence:
            return Sequence(-1, dummy, [0] * num_tokens, 1, page_ids=[0] * width)

        for sd, tp, sp in sorted(combos):
            plan = StepPlan()
            for _ in range(sd):
                s = seq(2)
                plan.chunks.append(ScheduledChunk(s, 1, 1, [s]))
            units = min(tp // qb, sp * max_units)  # past the previous bucket, within this one
            r = min(sp, units)  # rows (each at least one block) that pad to sp
            for i in range(r):
                n = min((units // r + (i < units % r)) * qb, max_chunk)  # pads to those blocks
                s = seq(n)
                plan.chunks.append(ScheduledChunk(s, 0, n, [s]))
            batch, rows, _ = build_batch(plan, self.buckets, self.config.page_size)
            self.runner.execute(batch, rows)
        for n in self.buckets.copies:  # copy-on-write shapes: scratch page 0 onto itself
            self.runner.copy_pages(np.zeros(n, np.int32), np.zeros(n, np.int32))
        return {"shapes": len(combos) + len(self.buckets.copies),
                "compilations": self.runner.compilations - before,
                "seconds": time.perf_counter() - t0}

    def _rows_bucket(self, rows: int) -> int:
        """The rows bucket `rows` rows pad to (the largest bucket when none holds them)."""
        return Buckets.fit(self.buckets.seqs, min(rows, self.buckets.seqs[-1]))

    # ----------------------------------------------------------------- introspection
    def kv_usage(self) -> dict:
        """The KV pool right now, in slots: useful (computed tokens, shared pages counted once),
        tail fragmentation (allocated to live sequences but empty), cached-unreferenced and free,
        plus host page-table bytes (4 bytes per entry)."""
        filled: dict[int, int] = {}
        table_entries = 0
        b = self.config.page_size
        for seq in self.scheduler.live_sequences():
            table_entries += len(seq.page_ids)
            for j, page in enumerate(seq.page_ids):
                filled[page] = max(filled.get(page, 0),
                                   min(b, max(0, seq.num_computed_tokens - j * b)))
        stats = self.scheduler.stats()
        useful = sum(filled.values())
        return {"page_size": b, "referenced_pages": stats["referenced_pages"],
                "useful_slots": useful,
                "fragmented_slots": stats["referenced_pages"] * b - useful,
                "cached_pages": stats["cached_pages"], "free_pages": stats["free_pages"],
                "page_table_bytes": 4 * table_entries,
                "bytes_per_slot": self.model_config.kv_bytes_per_token(self.config.dtype_bytes)}

    def stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats.update(compilations=self.runner.compilations, steps=self.num_steps,
                     host_seconds=self.host_seconds, device_seconds=self.device_seconds,
                     host_overlapped_seconds=self.host_overlapped_seconds,
                     peak_referenced_pages=self.peak_referenced_pages,
                     kv_pool_bytes=self.runner.kv_pool_bytes, param_bytes=self.runner.param_bytes,
                     huge_page_bytes=self.runner.huge_page_bytes)
        return stats


__all__ = ["LLMEngine", "RequestRejected"]
