"""The engine's LoRA adapters (one owner): the registered ones, read from their PEFT directories
on first use (or at start: lora_modules, served by name) and kept on the host (weights/lora.py),
their device slots (core/lora.py's LoRASlots: admission asks it, each launched plan is stamped
with its chunks' slots), and the copies into those slots a step needs first (the runner's
LoRAStack.place: an in-place update, no compilation)."""

from __future__ import annotations

import threading

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.core.lora import LoRARequest, LoRASlots
from jaxserve.core.sequence import Request, Sequence
from jaxserve.core.step_plan import StepPlan
from jaxserve.runtime import custom_model
from jaxserve.runtime.runner import ModelRunner
from jaxserve.weights.lora import LoRAWeights, read_adapter


class LoRAAdapters:
    def __init__(self, config: LoRAConfig, model: ModelConfig):
        self.config, self.model = config, model
        self.slots = LoRASlots(config.max_loras)
        self._registered: dict[int, tuple[LoRARequest, LoRAWeights]] = {}
        self._lock = threading.Lock()  # a server reads adapters from worker threads
        # lora_modules: served by name (ids 1..n), read now so that a bad one fails the start.
        self.modules = {}
        for i, module in enumerate(config.lora_modules):
            name, _, path = module.partition("=")
            self.modules[name] = LoRARequest(name, i + 1, path)
            self.register(self.modules[name])

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

    def register(self, lora: LoRARequest) -> LoRAWeights:
        """Read `lora`'s adapter unless its lora_int_id is registered already (with the same
        path; another path under a known id is refused). LoRAAdapterError naming what is not
        served."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        with self._lock:
            known = self._registered.get(lora.lora_int_id)
        if known is not None:
            if known[0].lora_path != lora.lora_path:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter "
                                 f"{known[0].lora_name!r} ({known[0].lora_path}), not "
                                 f"{lora.lora_path}")
            return known[1]
        weights = read_adapter(lora.lora_path, self.model, self.config.max_lora_rank)
        with self._lock:
            return self._registered.setdefault(lora.lora_int_id, (lora, weights))[1]

    def attach(self, request: Request, lora: LoRARequest | None) -> None:
        """Run `request` under `lora` (None: the base model), registering it first."""
        if lora is None:
            return
        # The adapter's pages are its own: its fingerprint joins the prefix cache's key.
        request.cache_salt = (request.cache_salt, self.register(lora).fingerprint)
        request.lora_int_id = lora.lora_int_id

    def place(self, plan: StepPlan, running: list[Sequence], runner: ModelRunner) -> None:
        """Before `plan` runs: each chunk's adapter slot (LoRASlots.stamp, over the running
        sequences), and the adapters given a slot copied into it."""
        for slot, adapter_id in self.slots.stamp(plan, running):
            runner.lora.place(slot, self._registered[adapter_id][1].layers)
