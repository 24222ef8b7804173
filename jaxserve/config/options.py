"""A requested option as a dataclass field: its default, its help and its choices live here once,
and the absl flags (jaxserve/cli/engine_flags.py) are generated from them."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           flag: str | None = None, switch: bool = False) -> Any:
    """A field of a requested config. choices: the accepted values (an enum flag, checked by
    check_choices); flag: the flag's name when it differs from the field's; switch: the flag
    defaults to None, and giving it turns its config on (speculative decoding)."""
    metadata = {"help": help, "choices": choices, "flag": flag, "switch": switch}
    return dataclasses.field(default=default, metadata=metadata)


def check_choices(config: Any) -> None:
    """ValueError for a field with choices whose value is not one of them."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices and not (value is None and f.default is None):
            raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")


def option_type(cls: type, field: dataclasses.Field) -> type:
    """The field's value type, None left out of an optional one (int | None -> int); a
    repeated option (tuple[str, ...]) is a tuple."""
    hint = typing.get_type_hints(cls)[field.name]
    if typing.get_origin(hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))
