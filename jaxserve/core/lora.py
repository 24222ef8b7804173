"""LoRA adapters on the host: LoRARequest (vLLM's names: which adapter a request runs under) and
LoRASlots, the device slots' owner. Slot 0 is the base model (no adapter); slots 1..max_loras
hold adapters. The adapters of the running sequences keep their slots (the scheduler admits a
sequence only while its adapter has or can get one); an adapter no longer running keeps its
slot until another needs it, the least recently used going first. Plain Python, no JAX."""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.core.sequence import Request, Sequence
from jaxserve.core.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) named for a
    request. lora_int_id >= 1 identifies it: requests naming the same id share it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")


def named_adapters(lora_modules: tuple[str, ...]) -> tuple[LoRARequest, ...]:
    """LoRAConfig.lora_modules' name=path entries as the adapters served by those names, ids
    1..n in their order (the engine and the benchmark name them alike)."""
    pairs = [module.partition("=") for module in lora_modules]
    return tuple(LoRARequest(name, i + 1, path) for i, (name, _, path) in enumerate(pairs))


class LoRASlots:
    """Which adapter (by lora_int_id) each of the `max_loras` device slots holds. The adapters of
    the running sequences are live: their slots are kept; an adapter that needs a slot takes
    the least recently used one of an adapter not live."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._adapter_in: dict[int, int] = {}  # slot -> adapter id
        self._lru = collections.OrderedDict.fromkeys(range(1, max_loras + 1))  # oldest first

    @staticmethod
    def _live(seqs) -> set[int]:
        return {s.request.lora_int_id for s in seqs} - {0}

    def admits(self, request: Request, running: list[Sequence]) -> bool:
        """Whether `request` may join `running` (the base always; an adapter while the running
        sequences' adapters leave it a slot)."""
        live = self._live(running)
        return request.lora_int_id in live | {0} or len(live) < self.max_loras

    def stamp(self, plan: StepPlan, running: list[Sequence]) -> list[tuple[int, int]]:
        """Give each of `plan`'s chunks its adapter's slot (0: the base model), assigning slots
        to adapters without one; returns those (slot, adapter id), to be placed on the device
        before the plan runs."""
        live = self._live(running) | self._live(c.seq for c in plan.chunks)
        if len(live) > self.max_loras:
            raise ValueError(f"{len(live)} adapters running for max_loras={self.max_loras}")
        slot_of = {a: s for s, a in self._adapter_in.items()}
        loads = []
        for adapter in sorted(live - set(slot_of)):
            slot = next(s for s in self._lru if self._adapter_in.get(s) not in live)
            self._adapter_in[slot], slot_of[adapter] = adapter, slot
            loads.append((slot, adapter))
        for adapter in live:
            self._lru.move_to_end(slot_of[adapter])
        for chunk in plan.chunks:
            chunk.lora_slot = slot_of.get(chunk.seq.request.lora_int_id, 0)
        return loads

    def forget(self, adapter_id: int) -> None:
        """Free `adapter_id`'s slot (an adapter removed or dropped from the host, with no
        sequence left under it): the slot goes first to the next adapter that needs one."""
        for slot, adapter in list(self._adapter_in.items()):
            if adapter == adapter_id:
                del self._adapter_in[slot]
                self._lru.move_to_end(slot, last=False)
