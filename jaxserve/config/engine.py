"""EngineConfig: what was requested of the engine, one frozen sub-config per concern (load,
cache, scheduler, parallel, speculative), each validating itself. The user-facing surface is
flat (`LLM(**options)`, the server's and CLI's flags): from_options maps those names onto the
sub-configs in one place, options() maps back. What the engine resolves from it (dtype "auto",
max_model_len, ...) is a separate ResolvedConfig (config/resolved.py); this one is never
rewritten."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config.cache import CacheConfig
from jaxserve.config.load import LoadConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.options import field_names
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig

# The flat options' sub-configs, by EngineConfig field; their field names are the option names.
OPTION_GROUPS = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "lora": LoRAConfig}
SPECULATIVE_OPTION = "speculative_config"  # a SpeculativeConfig, or a dict of its fields
_GROUP_OF = {name: group for group, cls in OPTION_GROUPS.items() for name in field_names(cls)}
assert len(_GROUP_OF) == sum(len(field_names(c)) for c in OPTION_GROUPS.values()), \
    "a flat option name belongs to one sub-config"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self):
        for name, cls in (*OPTION_GROUPS.items(), ("speculative", SpeculativeConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls) and not (name == "speculative" and value is None):
                raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}, got "
                                 f"{type(value).__name__} (flat options: "
                                 "EngineConfig.from_options)")
        spec = self.speculative
        if self.parallel.num_processes > 1 and spec is not None and spec.method == "draft":
            raise ValueError("speculative method 'draft' runs its model on process 0 alone; with "
                             "num_processes > 1 use method 'ngram'")
        if self.lora.enable_lora:
            self._check_lora()

    def _check_lora(self) -> None:
        """What LoRA serving does not combine with yet, refused by name."""
        unsupported = {"speculative decoding": self.speculative is not None,
                       "num_processes > 1": self.parallel.num_processes > 1,
                       "batch_invariant": self.load.batch_invariant,
                       "scan_layers=on": self.load.scan_layers == "on"}
        for what, used in unsupported.items():
            if used:
                raise ValueError(f"enable_lora is not supported with {what} yet")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (every sub-config's field names, and
        speculative_config), refusing unknown names with the list of known ones."""
        unknown = sorted(set(options) - set(_GROUP_OF) - {SPECULATIVE_OPTION})
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: "
                             f"{option_names()}")
        groups: dict[str, dict[str, Any]] = {group: {} for group in OPTION_GROUPS}
        for name, value in options.items():
            if name != SPECULATIVE_OPTION:
                groups[_GROUP_OF[name]][name] = value
        # The speculative options first, as before: a bad dict is reported over other errors.
        spec = SpeculativeConfig.parse(options.get(SPECULATIVE_OPTION))
        return cls(**{group: OPTION_GROUPS[group](**values) for group, values in groups.items()},
                   speculative=spec)

    def options(self) -> dict[str, Any]:
        """The flat options that build this config again (from_options(**c.options()) == c)."""
        flat = {name: getattr(getattr(self, group), name) for name, group in _GROUP_OF.items()}
        flat[SPECULATIVE_OPTION] = (dataclasses.asdict(self.speculative)
                                    if self.speculative is not None else None)
        return flat


def option_names() -> list[str]:
    """Every flat engine option's name, sorted."""
    return sorted([*_GROUP_OF, SPECULATIVE_OPTION])
