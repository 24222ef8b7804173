"""ServedAdapters: the LoRA adapters a server serves by name (one owner): those of
--lora_modules, and those loaded or unloaded at runtime (lora_routes.py). /v1/models, request
validation (protocol.py) and the app's submit read it; only the event loop changes it."""

from __future__ import annotations

from jaxserve.core.lora import LoRARequest


class ServedAdapters:
    def __init__(self, modules: tuple[LoRARequest, ...] = ()):
        self._by_name = {lora.lora_name: lora for lora in modules}
        self._loading: set[str] = set()
        # Ids are never reused: a removed adapter's may still run its last requests.
        self._next_id = max((lora.lora_int_id for lora in modules), default=0) + 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def reserve(self, name: str, path: str) -> LoRARequest:
        """A new adapter's request (a fresh lora_int_id), its name held until `added` or
        `released`. ValueError if the name is served or being loaded."""
        if name in self._by_name or name in self._loading:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        self._loading.add(name)
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return lora

    def added(self, lora: LoRARequest) -> None:
        self._loading.discard(lora.lora_name)
        self._by_name[lora.lora_name] = lora

    def released(self, lora: LoRARequest) -> None:
        self._loading.discard(lora.lora_name)

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name` (None if it is not served): requests naming it 404 from now."""
        return self._by_name.pop(name, None)
