"""Prometheus metrics for the server (official prometheus_client), on a per-app CollectorRegistry.

Request metrics (histograms, token and request counters) are observed when a request finishes or
is aborted, on the engine loop thread (prometheus_client is thread-safe). Engine gauges and
cumulative counters (queues, KV pages, preemptions, prefix cache) come from the latest
engine.stats() snapshot, which the /metrics handler refreshes on the loop thread before rendering.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0)

# (metric suffix, stats key, help) for gauges read from engine.stats() / kv_usage().
_GAUGES = (
    ("num_requests_running", "running", "Sequences in the running batch."),
    ("num_requests_waiting", "waiting", "Sequences waiting for admission (preempted included)."),
    ("kv_referenced_pages", "referenced_pages", "KV pages referenced by live sequences."),
    ("kv_free_pages", "free_pages", "KV pages on the free list."),
    ("kv_cached_pages", "cached_pages", "Unreferenced KV pages kept findable by the prefix cache."),
    ("kv_total_pages", "total_pages", "Usable KV pages (the scratch page excluded)."),
    ("kv_peak_referenced_pages", "peak_referenced_pages", "Most KV pages referenced at once."),
    ("num_compilations", "compilations", "Jitted step compilations so far."),
    ("weight_bytes", "weight_bytes", "Bytes of the model's weights on one device."),
    ("kv_pool_bytes", "kv_pool_bytes", "Bytes of the KV pool on one device (scales included)."),
    ("activation_peak_bytes", "activation_peak_bytes",
     "The largest step's temporaries the memory plan reserved (0 without a plan)."),
    ("draft_weight_bytes", "draft_weight_bytes", "Bytes of the draft model's weights."),
    ("draft_kv_pool_bytes", "draft_kv_pool_bytes",
     "Bytes of the draft model's KV pool (the target's page ids, the draft's shape)."),
)
_COUNTERS = (
    ("num_preemptions", "num_preempted_total", "Sequences preempted (recompute)."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache lookups."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits."),
    ("num_engine_steps", "steps", "Engine steps run."),
    ("request_rejected", "num_rejected_total", "Requests the engine refused at admission."),
    ("spec_decode_num_drafts", "spec_steps", "Speculative verifications (a sequence's step)."),
    ("spec_decode_num_verifying_steps", "spec_verifying_steps",
     "Engine steps that verified drafts of any sequence."),
    ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Speculative tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Speculative tokens accepted."),
)


class _EngineStatsCollector:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        for name, key, help_ in _GAUGES:
            yield GaugeMetricFamily(f"{self.prefix}:{name}", help_, value=float(s.get(key) or 0))
        total = s.get("total_pages", 0)
        yield GaugeMetricFamily(f"{self.prefix}:kv_cache_usage_perc",
                                "Fraction of KV pages referenced by live sequences (0-1).",
                                value=s.get("referenced_pages", 0) / total if total else 0.0)
        by_group = GaugeMetricFamily(f"{self.prefix}:kv_referenced_pages_by_group",
                                     "KV pages referenced by live sequences, per layer group "
                                     "(core/kv_groups.py; one group for a uniform model).",
                                     labels=["group"])
        for g, n in enumerate(s.get("referenced_pages_per_group") or ()):
            by_group.add_metric([str(g)], float(n))
        yield by_group
        for name, key, help_ in _COUNTERS:
            yield CounterMetricFamily(f"{self.prefix}:{name}", help_, value=float(s.get(key, 0)))


class ServerMetrics:
    """Observer of the AsyncEngine plus the engine-stats collector, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "jaxserve"):
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, prefix
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}:inter_token_latency_seconds",
                             "Time between consecutive output tokens (sample 0).",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(f"{p}:request_queue_time_seconds", "Arrival to first scheduled.",
                               buckets=_REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished or aborted "
                                     "requests.", registry=r)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens (all "
                                         "samples) of finished or aborted requests.", registry=r)
        self.success = Counter(f"{p}:request_success", "Requests ended, by finish reason.",
                               ["finished_reason"], registry=r)
        self.http_rejected = Counter(f"{p}:request_rejected_http", "Requests the server refused, "
                                     "by HTTP status.", ["status"], registry=r)
        self._engine = _EngineStatsCollector(p)
        r.register(self._engine)

    # ---- Observer protocol (engine loop thread)
    def on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        reasons = [c.finish_reason for c in out.outputs]
        self.success.labels(finished_reason=reasons[0] if reasons else "stop").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        times = m.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def on_aborted(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.success.labels(finished_reason="abort").inc()

    # ---- exposition
    def set_engine_stats(self, stats: dict) -> None:
        self._engine.stats = dict(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
