"""The engine's LoRA adapters (one owner): the registered ones, read from their PEFT directories
on first use (or at start: lora_modules, served by name; or by add_lora, a server's runtime
loading) and kept on the host (weights/lora.py; at most max_cpu_loras, LRU, never one a live
request runs under), removed by remove_lora once no live request runs under them,
their device slots (core/lora.py's LoRASlots: admission asks it, each launched plan is stamped
with its chunks' slots), and the copies into those slots a step needs first (the runner's
LoRAStack.place: an in-place update, no compilation)."""

from __future__ import annotations

import collections
import threading

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.core.live_requests import LiveRequests
from jaxserve.core.lora import LoRARequest, LoRASlots, named_adapters
from jaxserve.core.sequence import Request, Sequence
from jaxserve.core.step_plan import StepPlan
from jaxserve.runtime import custom_model
from jaxserve.runtime.runner import ModelRunner
from jaxserve.weights.lora import LoRAWeights, read_adapter


class LoRAAdapters:
    def __init__(self, config: LoRAConfig, model: ModelConfig):
        self.config, self.model = config, model
        self.slots = LoRASlots(config.max_loras)
        # lora_int_id -> (its LoRARequest, its fingerprint); the weights of some on the host,
        # least recently used first (at most max_cpu_loras: the others are read again on use)
        self._registered: dict[int, tuple[LoRARequest, str]] = {}
        self._host: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        self._removed: set[int] = set()  # removed while live requests still run under them
        self._lock = threading.Lock()
        # lora_modules: served by name (ids 1..n), read now so that a bad one fails the start.
        # Replaced, never changed in place: a front end reads it from its own thread.
        self.modules = {lora.lora_name: lora for lora in named_adapters(config.lora_modules)}
        for lora in self.modules.values():
            self.register(lora)

    @classmethod
    def of(cls, config: LoRAConfig, model: ModelConfig, scan_layers: bool,
           tp: int = 1) -> LoRAAdapters | None:
        """The engine's adapters, None unless enable_lora; what is not served is refused."""
        if not config.enable_lora:
            return None
        if custom_model.is_registered(model):
            raise ValueError("enable_lora is not supported for a registered (custom) model")
        if model.num_experts:
            raise ValueError("enable_lora is not supported for a mixture of experts yet")
        if model.num_kv_heads % tp:  # the pool repeats KV heads: a k or v delta would too
            raise ValueError(f"enable_lora under tensor parallelism needs num_kv_heads "
                             f"({model.num_kv_heads}) divisible by tensor_parallel_size ({tp})")
        if scan_layers:
            raise ValueError("enable_lora runs unrolled layers: set scan_layers='off'")
        return cls(config, model)

    def runner_options(self) -> dict:
        """The runner's stack: slot 0 (the base) and max_loras adapters, of max_lora_rank."""
        return dict(lora=(self.config.max_loras + 1, self.config.max_lora_rank))

    def register(self, lora: LoRARequest, live: LiveRequests | None = None) -> LoRAWeights:
        """`lora`'s weights, read from its directory unless they are on the host already (an id
        registered under another path is refused). LoRAAdapterError naming what is not
        served. live: the engine's live requests, whose adapters are never dropped from the
        host to keep max_cpu_loras."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        adapter = lora.lora_int_id
        with self._lock:
            known = self._registered.get(adapter)
            weights = self._host.get(adapter)
            if weights is not None:
                self._host.move_to_end(adapter)
        if known is not None and known[0].lora_path != lora.lora_path:
            raise ValueError(f"lora_int_id {adapter} is adapter {known[0].lora_name!r} "
                             f"({known[0].lora_path}), not {lora.lora_path}")
        if weights is not None:
            return weights
        weights = read_adapter(lora.lora_path, self.model, self.config.max_lora_rank)
        with self._lock:
            if known is not None and known[1] != weights.fingerprint:
                self.slots.forget(adapter)  # changed on disk while off the host: place anew
            self._registered[adapter] = (lora, weights.fingerprint)
            self._host[adapter] = weights
        self._keep_host_within(lambda: {adapter} | (live.lora_ids() if live else set()))
        return weights

    def _keep_host_within(self, in_use) -> None:
        """Drop the least recently used adapters' weights beyond max_cpu_loras, never one in
        in_use() (those of live requests): re-read from their path on next use."""
        cap = self.config.max_cpu_loras
        if cap is None or len(self._host) <= cap:
            return
        keep = in_use()
        with self._lock:
            for adapter in [a for a in self._host if a not in keep]:
                if len(self._host) <= cap:
                    break
                del self._host[adapter]  # a device slot may keep its copy (register checks)

    def attach(self, request: Request, lora: LoRARequest | None,
               live: LiveRequests | None = None) -> None:
        """Run `request` under `lora` (None: the base model), registering it first."""
        if lora is None:
            return
        # The adapter's pages are its own: its fingerprint joins the prefix cache's key.
        request.cache_salt = (request.cache_salt, self.register(lora, live).fingerprint)
        request.lora_int_id = lora.lora_int_id
        self._removed.discard(lora.lora_int_id)  # named again: registered again

    # ---- runtime loading (vLLM's add_lora / remove_lora / list_loras), on the engine's thread
    def add_lora(self, lora: LoRARequest, live: LiveRequests | None = None) -> bool:
        """Register `lora` now (read from its directory: LoRAAdapterError or OSError naming
        what is wrong); False if its id was registered already."""
        new = lora.lora_int_id not in self.list_loras(live)
        self.register(lora, live)
        self._removed.discard(lora.lora_int_id)
        return new

    def remove_lora(self, lora_int_id: int, live: LiveRequests | None = None) -> bool:
        """Unregister an adapter (and its lora_modules name); False if unknown. The requests
        running or waiting under it finish with it: it is dropped, and its slot freed, once
        none is left."""
        if lora_int_id not in self.list_loras(live):
            return False
        self._removed.add(lora_int_id)
        self.modules = {n: m for n, m in self.modules.items() if m.lora_int_id != lora_int_id}
        self._release(live)
        return True

    def list_loras(self, live: LiveRequests | None = None) -> set[int]:
        """The registered adapters' ids (those removed left out)."""
        self._release(live)
        return set(self._registered) - self._removed

    def _release(self, live: LiveRequests | None) -> None:
        """Drop the removed adapters no live request runs under any more, freeing their
        slots."""
        if not self._removed:
            return
        in_use = live.lora_ids() if live is not None else set()
        with self._lock:
            for adapter in self._removed - in_use:
                del self._registered[adapter]
                self._host.pop(adapter, None)
                self.slots.forget(adapter)
                self._removed.discard(adapter)

    def place(self, plan: StepPlan, running: list[Sequence], runner: ModelRunner,
              live: LiveRequests | None = None) -> None:
        """Before `plan` runs: each chunk's adapter slot (LoRASlots.stamp, over the running
        sequences), and the adapters given a slot copied into it (live: the engine's live
        requests, whose removed adapters are released first)."""
        self._release(live)
        for slot, adapter_id in self.slots.stamp(plan, running):
            runner.lora.place(slot, self.register(self._registered[adapter_id][0], live).layers)
