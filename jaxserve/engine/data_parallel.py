"""Data parallelism: data_parallel_size engine replicas, each with its own scheduler, KV pool and
row of the ("dp", "tp") mesh, behind the interface of one LLMEngine (the LLM, the server and the
batch runner take either; `make_engine` builds the right one).

Routing (`Router`): a request goes to a replica whose prefix cache holds its first full page, or
to which a request with the same first page was last sent (its pages will be cached there:
prompts that share a system prompt arrive together); otherwise, and when the affine replica is
a whole batch (max_num_seqs) busier than the least loaded, to the least loaded (fewest
unfinished requests, then fewest routed tokens, then the lowest index).
"""

from __future__ import annotations

import collections

from jaxserve import backends
from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine, Prompt
from jaxserve.engine.weight_update import as_update
from jaxserve.runtime import distributed, sharding
from jaxserve.weights import LoadedModel, load_model, numpy_dtype

_RECENT_FIRST_PAGES = 4096  # first pages whose replica the router remembers
# Stats that describe one device of a replica (the same on every replica): not summed.
_PER_DEVICE = ("tensor_parallel_size", "kv_pool_bytes_per_device", "kv_page_bytes_per_device",
               "weight_bytes_per_device")


class Router:
    """Host-only routing decisions over replicas that report their load and cached pages."""

    def __init__(self, replicas: list[LLMEngine], page_size: int, max_num_seqs: int):
        self.replicas, self.page_size, self.slack = replicas, page_size, max_num_seqs
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self.requests = [0] * len(replicas)  # routed so far, per replica
        self.tokens = [0] * len(replicas)  # prompt tokens routed so far

    def choose(self, token_ids: list[int], cache_salt: str | None) -> int:
        loads = [(r.num_unfinished, self.tokens[i], i) for i, r in enumerate(self.replicas)]
        least = min(loads)[2]
        first = (cache_salt, tuple(token_ids[:self.page_size]))
        affine = None
        if len(token_ids) > self.page_size:  # a full page that a later token follows
            cached = [i for i, r in enumerate(self.replicas)
                      if r.caches_first_page(token_ids, cache_salt)]
            affine = cached[0] if cached else self._recent.get(first)
        if affine is not None and loads[affine][0] - loads[least][0] < self.slack:
            chosen = affine
        else:
            chosen = least
        if len(token_ids) > self.page_size:
            self._recent[first] = chosen
            self._recent.move_to_end(first)
            if len(self._recent) > _RECENT_FIRST_PAGES:
                self._recent.popitem(last=False)
        self.requests[chosen] += 1
        self.tokens[chosen] += len(token_ids)
        return chosen


class DataParallelEngine:
    """The LLMEngine interface over data_parallel_size replicas (weights loaded once)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        loaded = loaded or load_model(config.load.model, lazy=True,
                                      dtype=backends.resolve_dtype(config.load.dtype))
        parallel = config.parallel
        mesh = sharding.make_mesh(parallel.tensor_parallel_size, parallel.data_parallel_size)
        self.replicas = [LLMEngine(config, loaded, mesh=sharding.replica_mesh(mesh, i))
                         for i in range(parallel.data_parallel_size)]
        first = self.replicas[0]
        self.config, self.resolved = first.config, first.resolved
        self.tokenizer, self.model_config = first.tokenizer, first.model_config
        self.max_model_len, self.backend, self.num_pages = (first.max_model_len, first.backend,
                                                            first.num_pages)
        for replica in self.replicas[1:]:  # one grammar cache (the same tokenizer and vocab)
            replica.share_grammars(first)
        self.router = Router(self.replicas, config.cache.page_size, config.scheduler.max_num_seqs)
        self._owner: dict[str, int] = {}  # unfinished request id -> replica
        self._ids = 0

    @property
    def served_model(self):
        return self.replicas[0].served_model  # the replicas serve one model

    def compile_grammar(self, spec):
        return self.grammars.compile(spec)

    @property
    def grammars(self):
        """Structured outputs' grammar compiler, shared by the replicas: a server compiles a
        request's grammar before it is routed, and the replica finds it cached."""
        return self.replicas[0].grammars

    def check_params(self, params: SamplingParams):
        """LLMEngine.check_params (the replicas share the model and the grammar cache)."""
        return self.replicas[0].check_params(params)

    def tokenize(self, prompt: Prompt):
        return self.replicas[0].tokenize(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request=None):
        if lora_request is None and isinstance(prompt, dict):  # a server's request names one
            lora_request = prompt.get("lora_request")
        text, ids = self.tokenize(prompt)
        if request_id is None:  # ids unique across replicas (each counts its own)
            request_id, self._ids = f"req-{self._ids}", self._ids + 1
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        salt = cache_salt if cache_salt is not None else self.config.cache.cache_salt
        i = self.router.choose(ids, salt)
        request = self.replicas[i].add_request({"prompt_token_ids": ids, "prompt": text}, params,
                                               request_id=request_id, arrival_time=arrival_time,
                                               cache_salt=cache_salt,
                                               lora_request=lora_request)
        self._owner[request.request_id] = i
        return request

    def abort(self, request_id: str) -> bool:
        i = self._owner.pop(request_id, None)
        return i is not None and self.replicas[i].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (each launches its next step before reading this
        one's tokens back, so the replicas' devices overlap)."""
        results = []
        for replica in self.replicas:
            if replica.has_unfinished():
                results += replica.step()
        for out in results:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return results

    # ---- weights and memory (engine/client.RolloutControl, docs/rl.md): every replica
    def update_weights(self, weights, in_flight: str = "finish") -> list[RequestOutput]:
        """LLMEngine.update_weights on every replica. Names are converted once; with "finish"
        the replicas run their requests to the end together first, their devices overlapping."""
        weights = as_update(weights, self.replicas[0].params_like(), self.model_config,
                            numpy_dtype(self.resolved.dtype))
        outputs = []
        if in_flight == "finish" and self.has_unfinished():
            if self.is_paused:  # refused before any replica changes
                raise ValueError("paused with requests unfinished: resume() first, or update "
                                 "with in_flight='abort'")
            while self.has_unfinished():
                outputs += self.step()
        for replica in self.replicas:
            outputs += replica.update_weights(weights, in_flight)
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def params_like(self) -> dict:
        """Replica 0's (the others' differ in their devices only: a tree placed for replica 0
        is copied to the others)."""
        return self.replicas[0].params_like()

    @property
    def weights_version(self) -> int:
        return self.replicas[0].weights_version

    @property
    def is_paused(self) -> bool:
        return self.replicas[0].is_paused

    @property
    def is_sleeping(self) -> bool:
        return any(r.is_sleeping for r in self.replicas)

    def pause(self) -> None:
        for replica in self.replicas:
            replica.pause()

    def resume(self) -> None:
        for replica in self.replicas:
            replica.resume()

    def sleep(self, level: int = 1) -> None:
        if self.has_unfinished():  # checked for all before any replica sleeps
            raise ValueError("sleep with requests unfinished: let them finish or abort them first")
        for replica in self.replicas:
            replica.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        for replica in self.replicas:
            replica.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.reset_prefix_cache()

    def stop_followers(self) -> None:
        """The replicas' (data parallelism runs in one process: each has none to stop)."""
        for replica in self.replicas:
            replica.stop_followers()

    def warmup(self, full: bool = False, **options) -> dict:
        return _summed([r.warmup(full, **options) for r in self.replicas])

    @property
    def compilations_pending(self) -> int:
        return sum(r.compilations_pending for r in self.replicas)

    @property
    def compilations(self) -> int:
        return sum(r.compilations for r in self.replicas)

    def kv_usage(self) -> dict:
        return _summed([r.kv_usage() for r in self.replicas])

    def stats(self) -> dict:
        """Counters summed over the replicas, and each replica's own under "replicas" (with the
        requests and prompt tokens the router sent it)."""
        per = [dict(r.stats(), routed_requests=n, routed_tokens=t)
               for r, n, t in zip(self.replicas, self.router.requests, self.router.tokens)]
        total = {**_summed(per), **{k: per[0][k] for k in _PER_DEVICE}}
        queries = total.get("prefix_cache_queries", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries \
            else 0.0
        return {**total, "replicas": per}


def _summed(dicts: list[dict]) -> dict:
    """The numbers of a list of dicts with the same keys, added key by key."""
    return {k: sum(d[k] for d in dicts) for k, v in dicts[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def make_engine(config: EngineConfig, loaded: LoadedModel | None = None):
    """An LLMEngine, or a DataParallelEngine of data_parallel_size replicas. With several
    processes, joins them first (before anything else touches a device); then only process
    0's engine serves, the others `follow()` it."""
    parallel = config.parallel
    if parallel.num_processes > 1:
        distributed.initialize(parallel.coordinator_address, parallel.num_processes,
                               parallel.process_id, parallel.distributed_timeout_s)
    if parallel.data_parallel_size > 1:
        return DataParallelEngine(config, loaded)
    return LLMEngine(config, loaded)


__all__ = ["DataParallelEngine", "Router", "make_engine"]
