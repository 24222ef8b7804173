"""Benchmark drivers: replay a workload's requests at their arrival times and record, per request,
its timestamps and tokens, and per engine step a timeline sample (KV pages, queues, RSS).

- `run_engine(engine, workload)`: in-process against an LLMEngine. A request is added when its
  arrival time has passed (its arrival_time is the scheduled one, so driver lag counts as queueing);
  the engine steps while anything is unfinished and the driver sleeps only when it is idle.
  After every step the KV pool is read (engine.kv_usage()); the step with the most referenced pages
  is kept with the lengths live at that moment, for the analytic comparison (kv_budget.pages_needed).
- `run_http(url, workload)`: against an OpenAI-compatible /v1/completions endpoint with stream=true,
  prompts sent as token-id lists; tokens are counted from stream chunks and the final usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any, Callable

import psutil

from jaxserve.tools import require
from jaxserve.tools.bench.workload import BenchRequest, WorkloadSpec

STATUSES = ("completed", "rejected", "cancelled", "failed")

__all__ = ["RequestRecord", "RunResult", "run_engine", "run_http", "RssSampler", "STATUSES"]


@dataclasses.dataclass
class RequestRecord:
    """One request's outcome; times are seconds since the run started (time.monotonic based)."""

    index: int
    prompt_len: int
    target_output_len: int
    status: str = "failed"  # completed | rejected | cancelled | failed
    output_tokens: int = 0
    arrival: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    cached_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # run start -> last request done
    timeline: list[dict[str, float]]  # per step (in-process) or per sampler tick (HTTP)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # stats, kv peak, config
    mode: str = "engine"


class RssSampler:
    """Samples a process's RSS in a background thread (default: this process)."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.05):
        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.proc.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max((r for _, r in self.samples), default=0)


# ---------------------------------------------------------------------------------------------
# In-process


def _drain(engine, requests: list[BenchRequest], params_for, lora_for) -> None:
    """Run untimed requests to completion (warm-up)."""
    for r in requests:
        engine.add_request({"prompt_token_ids": list(r.prompt_token_ids)}, params_for(r),
                           request_id=f"warmup-{r.index}", lora_request=lora_for(r))
    while engine.has_unfinished():
        engine.step()


def sampling_params_for(workload: WorkloadSpec) -> Callable[[BenchRequest], Any]:
    from jaxserve.core.sampling_params import SamplingParams

    def make(r: BenchRequest) -> SamplingParams:
        return SamplingParams(max_tokens=r.output_len, temperature=workload.temperature,
                              ignore_eos=workload.ignore_eos, seed=r.index)
    return make


def run_engine(engine, workload: WorkloadSpec, *, requests: list[BenchRequest] | None = None,
               warmup: list[BenchRequest] | None = None, progress: bool = False,
               lora_requests: list | None = None) -> RunResult:
    """Warm up, then replay `requests` (default: workload.generate) against `engine`;
    lora_requests: LoRA adapters the requests take in turn (request i: i mod their number)."""
    from jaxserve.tools import kv_budget

    vocab = engine.model_config.vocab_size
    requests = workload.generate(vocab) if requests is None else requests
    warmup = workload.generate(vocab, warmup=True) if warmup is None else warmup
    params_for = sampling_params_for(workload)
    lora_for = (lambda r: lora_requests[r.index % len(lora_requests)]) if lora_requests else (
        lambda r: None)
    proc = psutil.Process()
    compilations_before = engine.stats()["compilations"]
    t_warm = time.monotonic()
    _drain(engine, warmup, params_for, lora_for)
    warmup_s = time.monotonic() - t_warm
    stats0 = engine.stats()
    compilations_warm = stats0["compilations"]
    page_size = engine.config.cache.page_size
    bytes_per_slot = engine.kv_usage()["bytes_per_slot"]

    records = {r.index: RequestRecord(r.index, r.prompt_len, r.output_len) for r in requests}
    ids = {f"bench-{r.index}": r.index for r in requests}
    pending = sorted(requests, key=lambda r: (r.arrival_offset, r.index))
    timeline: list[dict[str, float]] = []
    peak: dict[str, Any] = {"referenced_pages": -1}
    peak_rss = proc.memory_info().rss
    out_tokens = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="bench", unit="req")
    t0 = time.monotonic()
    nxt = 0
    done = 0
    while nxt < len(pending) or engine.has_unfinished():
        now = time.monotonic() - t0
        while nxt < len(pending) and pending[nxt].arrival_offset <= now:
            r = pending[nxt]
            nxt += 1
            rec = records[r.index]
            rec.arrival = r.arrival_offset
            try:
                engine.add_request({"prompt_token_ids": list(r.prompt_token_ids)}, params_for(r),
                                   request_id=f"bench-{r.index}", arrival_time=t0 + r.arrival_offset,
                                   lora_request=lora_for(r))
            except ValueError as e:  # RequestRejected: can never run under this configuration
                rec.status, rec.error, rec.finished = "rejected", str(e), now
                done += 1
        if not engine.has_unfinished():
            if nxt < len(pending):
                time.sleep(max(0.0, pending[nxt].arrival_offset - (time.monotonic() - t0)))
            continue
        try:
            outputs = engine.step()
        except Exception as e:  # an engine failure fails every live request, and ends the run
            for rid, idx in ids.items():
                rec = records[idx]
                if rec.finished is None and rec.status != "rejected":
                    rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
                    rec.finished = time.monotonic() - t0
            break
        for out in outputs:
            idx = ids.get(out.request_id)
            if idx is None or not out.finished:
                continue
            rec = records[idx]
            m = out.metrics
            comp = out.outputs[0]
            rec.output_tokens = len(comp.token_ids)
            rec.first_token = None if m.first_token_time is None else m.first_token_time - t0
            rec.finished = (m.finished_time or time.monotonic()) - t0
            rec.token_times = [t - t0 for t in m.token_times]
            rec.cached_tokens = out.num_cached_tokens
            if out.error is not None:
                rec.status, rec.error = "failed", out.error
            else:
                rec.status = "cancelled" if comp.finish_reason == "abort" else "completed"
            out_tokens += rec.output_tokens
            done += 1
            if bar is not None:
                bar.update(1)
        usage = engine.kv_usage()
        rss = proc.memory_info().rss
        peak_rss = max(peak_rss, rss)
        st = engine.scheduler.stats()
        t = time.monotonic() - t0
        timeline.append({"t": t, "referenced_pages": usage["referenced_pages"],
                         "useful_slots": usage["useful_slots"], "cached_pages": usage["cached_pages"],
                         "running": st["running"], "waiting": st["waiting"], "rss": rss,
                         "done": done})
        if usage["referenced_pages"] > peak["referenced_pages"]:
            lengths = [s.num_computed_tokens for s in engine.scheduler.live_sequences()
                       if s.num_computed_tokens > 0]
            peak = dict(usage, t=t, step=len(timeline), live_lengths=lengths,
                        analytic_pages=kv_budget.pages_needed(lengths, page_size) if lengths else 0)
    duration = time.monotonic() - t0
    if bar is not None:
        bar.close()
    stats = engine.stats()
    peak["bytes_per_slot"] = bytes_per_slot
    info = {
        "stats": stats, "kv_peak": peak, "peak_rss_bytes": peak_rss,
        "compilations_before_warmup": compilations_before,
        "compilations_warmup": compilations_warm - compilations_before,
        "compilations_after_warmup": stats["compilations"] - compilations_warm,
        "warmup_requests": len(warmup), "warmup_s": warmup_s,
        "preemptions": stats["preemptions"] - stats0["preemptions"],
        "prefix_cache_queries": stats["prefix_cache_queries"] - stats0["prefix_cache_queries"],
        "prefix_cache_hits": stats["prefix_cache_hits"] - stats0["prefix_cache_hits"],
        **{key: stats[key] - stats0[key]
           for key in ("spec_steps", "spec_draft_tokens", "spec_accepted_tokens")},
        "num_pages": engine.num_pages, "page_size": page_size,
        "kv_pool_bytes": stats["kv_pool_bytes"], "weight_bytes": stats["weight_bytes"],
        # The options as requested, with what the engine resolved from them (dtype, ...).
        "config": {**engine.config.options(), **dataclasses.asdict(engine.resolved)},
        "backend": engine.backend.name,
        "start_seconds": stats.get("start_seconds"),
        "process_start_seconds": stats.get("process_start_seconds"),
        "max_model_len": engine.max_model_len,
    }
    return RunResult(list(records.values()), duration, timeline, info, mode="engine")


# ---------------------------------------------------------------------------------------------
# HTTP (OpenAI-compatible /v1/completions, streaming)


async def _one_http(client, url: str, model: str, r: BenchRequest, workload: WorkloadSpec,
                    t0: float, rec: RequestRecord, timeout_s: float) -> None:
    await asyncio.sleep(max(0.0, t0 + r.arrival_offset - time.monotonic()))
    rec.arrival = r.arrival_offset
    body = {"model": model, "prompt": list(r.prompt_token_ids), "max_tokens": r.output_len,
            "temperature": workload.temperature, "stream": True, "ignore_eos": workload.ignore_eos,
            "stream_options": {"include_usage": True}}
    if workload.ignore_eos:
        body["min_tokens"] = r.output_len
    usage_tokens = None
    finish_reason = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.status = "rejected" if resp.status_code in (400, 413, 422, 429, 503) else "failed"
                rec.error = f"HTTP {resp.status_code}: {text}"
                rec.finished = time.monotonic() - t0
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the server failed this request mid-stream
                    raise RuntimeError(chunk["error"].get("message"))
                now = time.monotonic() - t0
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                for choice in chunk.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                    if n:
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.token_times.extend([now] * n)
        rec.finished = time.monotonic() - t0
        rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.token_times)
        if usage_tokens is not None and usage_tokens > len(rec.token_times) and rec.token_times:
            # Chunks may carry several tokens (or empty text); spread the missing stamps evenly.
            rec.token_times = _spread(rec.token_times, usage_tokens)
        rec.status = "cancelled" if finish_reason == "abort" else "completed"
    except Exception as e:  # network, protocol or timeout: the request failed
        rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
        rec.finished = time.monotonic() - t0


def _spread(times: list[float], n: int) -> list[float]:
    """n timestamps covering the same first..last span as `times`, first and last kept."""
    if n <= 1 or len(times) == 1:
        return [times[0]] * (n - 1) + [times[-1]] if n > 1 else times[:1]
    a, b = times[0], times[-1]
    return [a + (b - a) * i / (n - 1) for i in range(n)]


def run_http(url: str, workload: WorkloadSpec, *, vocab_size: int, model: str = "default",
             server_pid: int | None = None, timeout_s: float = 600.0,
             max_concurrency: int | None = None) -> RunResult:
    """Replay the workload against `url` (a base URL; /v1/completions is appended if missing)."""
    httpx = require("httpx")

    endpoint = url.rstrip("/")
    if not endpoint.endswith("/completions"):
        endpoint += "/completions" if endpoint.endswith("/v1") else "/v1/completions"
    requests = workload.generate(vocab_size)
    warmup = workload.generate(vocab_size, warmup=True)
    records = [RequestRecord(r.index, r.prompt_len, r.output_len) for r in requests]

    async def go() -> float:
        limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 8)
        async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
            t = time.monotonic()
            await asyncio.gather(*[_one_http(client, endpoint, model, r, workload, t,
                                             RequestRecord(r.index, r.prompt_len, r.output_len),
                                             timeout_s) for r in warmup])
            t0 = time.monotonic()
            await asyncio.gather(*[_one_http(client, endpoint, model, r, workload, t0, rec,
                                             timeout_s) for r, rec in zip(requests, records)])
            return t0

    sampler = RssSampler(server_pid) if server_pid else None
    start = time.monotonic()
    if sampler:
        sampler.__enter__()
    try:
        t0 = asyncio.run(go())
    finally:
        if sampler:
            sampler.__exit__(None, None, None)
    duration = max([r.finished for r in records if r.finished is not None], default=0.0)
    timeline = []
    if sampler:
        shift = t0 - start
        timeline = [{"t": t - shift, "rss": rss} for t, rss in sampler.samples if t >= shift]
    info = {"url": endpoint, "peak_rss_bytes": sampler.peak if sampler else None,
            "warmup_requests": len(warmup)}
    return RunResult(records, duration, timeline, info, mode="http")
