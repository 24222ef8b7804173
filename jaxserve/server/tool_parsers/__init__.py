"""Tool-call parsers: one small class per format that models are trained on, behind one
interface (base.ToolParser: `parse(text, final)` -> content and calls, growing with the text).
`--tool_call_parser` names one; `auto` picks the one whose markup the chat template holds, and
hermes when it holds none (the format of the default tools message, tool_prompt.py)."""

from __future__ import annotations

from jaxserve.server.tool_parsers.base import Call, Parsed, ToolParser
from jaxserve.server.tool_parsers.hermes import HermesParser
from jaxserve.server.tool_parsers.llama3_json import Llama3JsonParser
from jaxserve.server.tool_parsers.mistral import MistralParser
from jaxserve.server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}
DEFAULT = HermesParser


def tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name` names, or for "auto" the one the chat template's markup shows."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}: one of "
                             f"{['auto', *PARSERS]}")
        return PARSERS[name]()
    for cls in PARSERS.values():
        if any(marker in (chat_template or "") for marker in cls.template_markers):
            return cls()
    return DEFAULT()


__all__ = ["Call", "Parsed", "ToolParser", "PARSERS", "tool_parser"]
