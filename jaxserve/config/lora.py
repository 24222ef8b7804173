"""LoRA adapters as requested (LoRAConfig): vLLM's option names. Adapters are PEFT directories
named per request (core/lora.py's LoRARequest); jaxserve/weights/lora.py reads them and
model/lora.py adds their deltas inside the one compiled step."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import option


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = option(False, "Serve LoRA adapters (PEFT directories) per request "
                               "over the base model.")
    max_loras: int = option(1, "Adapters held on the device at once (one step's distinct "
                            "adapters); more registered ones swap in by use (LRU).")
    max_lora_rank: int = option(16, "The largest adapter rank served; every adapter is padded "
                                "to it on the device.")
    lora_modules: tuple[str, ...] = option((), "Adapters served by name, name=path (a PEFT "
                                           "directory), read at start; a request's model names "
                                           "one.")
    max_cpu_loras: int | None = option(None, "Adapters kept on the host (at least max_loras); "
                                       "beyond it the least recently used one no request is "
                                       "using is dropped and read again from its path on next "
                                       "use. Default: every registered adapter stays.")

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for module in self.lora_modules:
            name, _, path = module.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules entries are name=path, got {module!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
