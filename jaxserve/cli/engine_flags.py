"""Engine options as absl flags, generated from the requested configs' fields (their defaults,
help and choices: jaxserve/config/), and read back as EngineConfig.from_options's flat options;
`define_flags` and `config_of` do the same for any requested config (serve's ServingConfig)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from absl import flags

from jaxserve.config import OPTION_GROUPS, SpeculativeConfig
from jaxserve.config.options import option_type

_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string, tuple: flags.DEFINE_multi_string}


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or field.name


def define_flags(cls: type, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """One flag per field of config class `cls`: the field's default (None for a switch, whose
    default then closes its help) and help, an enum of its choices, a repeated flag for a
    tuple (given as often as it has values; none: its default)."""
    for field in dataclasses.fields(cls):
        meta, default = field.metadata, field.default
        help_ = meta["help"]
        if meta.get("switch"):
            help_, default = f"{help_} (default when on: {default})", None
        if meta.get("choices"):
            flags.DEFINE_enum(flag_name(field), default, meta["choices"], help_,
                              flag_values=flag_values)
        else:
            kind = option_type(cls, field)
            _DEFINE[kind](flag_name(field), list(default) if kind is tuple else default, help_,
                          flag_values=flag_values)


def config_of(cls: type, flag_values: flags.FlagValues = flags.FLAGS):
    """Config class `cls` from its flags (define_flags'), repeated flags as tuples."""
    return cls(**{f.name: _tuple_of_list(flag_values[flag_name(f)].value)
                  for f in dataclasses.fields(cls)})


def _tuple_of_list(value):  # absl gives a repeated flag's values as a list
    return tuple(value) if isinstance(value, list) else value


def speculative_options(flag_values: flags.FlagValues = flags.FLAGS) -> dict | None:
    """speculative_config's dict from the flags, or None when no switch flag is given."""
    fields = dataclasses.fields(SpeculativeConfig)
    if all(flag_values[flag_name(f)].value is None for f in fields if f.metadata.get("switch")):
        return None
    # A flag left None keeps the field's default; a draft model given with another method is
    # passed on, so the config refuses it clearly.
    return {f.name: flag_values[flag_name(f)].value for f in fields
            if flag_values[flag_name(f)].value is not None}


def engine_options(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """The flat engine options the flags give (EngineConfig.from_options takes them), repeated
    flags as tuples."""
    options = {f.name: _tuple_of_list(flag_values[f.name].value)
               for cls in OPTION_GROUPS.values() for f in dataclasses.fields(cls)}
    spec = speculative_options(flag_values)
    if spec is not None:
        options["speculative_config"] = spec
    return options


for _cls in (*OPTION_GROUPS.values(), SpeculativeConfig):
    define_flags(_cls)
FLAGS = flags.FLAGS
# `jaxserve <subcommand> --help` lists the key flags of the program run: these are among them.
for _flag in FLAGS.get_flags_for_module(__name__):
    FLAGS.register_key_flag_for_module(sys.argv[0], _flag)
