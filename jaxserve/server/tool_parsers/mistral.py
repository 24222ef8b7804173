"""Mistral: `[TOOL_CALLS]` and then either a JSON list of calls (v0.3 tokenizers) or a name,
`[ARGS]` and the arguments' JSON object (v11 and later, one `[TOOL_CALLS]` per call); text may
come before:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""

from __future__ import annotations

import json
import re

from jaxserve.server.tool_parsers.base import (Block, Call, Parsed, ToolParser, dumps_arguments,
                                               json_call, parse_triggered, scan_object,
                                               skip_space, value_end)
from jaxserve.server.tool_parsers.base import Malformed

TRIGGER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolParser):
    name = "mistral"
    template_markers = (TRIGGER,)

    def parse(self, text: str, final: bool) -> Parsed:
        return parse_triggered(text, final, TRIGGER, self._block)

    @staticmethod
    def _block(text: str, start: int, final: bool) -> Block:
        j = skip_space(text, start)
        if j >= len(text):
            return Block([], None)
        if text[j] == "[":
            return _json_list(text, j, final)
        m = _NAME.match(text, j)
        if m is None:
            return Block([], start)
        k = m.end()
        if text.startswith(ARGS, k):
            k += len(ARGS)
        elif k >= len(text) or (ARGS.startswith(text[k:]) and not final):
            return Block([], start if final else None)
        k = skip_space(text, k)
        if k >= len(text):  # the arguments are still to come
            return Block([Call(m.group(), "{}" if final else "")], k if final else None)
        if text[k] != "{":
            return Block([], start)
        try:
            end = value_end(text, k)
        except Malformed:
            end = len(text)
        raw = text[k:len(text) if end is None else end].rstrip()
        return Block([Call(m.group(), raw)], end)

    def instructions(self) -> str:
        return (f"To call functions, write {TRIGGER} and then a JSON list of calls, each an "
                'object of its name and arguments: [{"name": <function name>, "arguments": '
                "<arguments as a JSON object>}].")

    def format_calls(self, calls: list[dict]) -> str:
        return TRIGGER + json.dumps([
            {"name": c["function"]["name"],
             "arguments": json.loads(dumps_arguments(c["function"].get("arguments") or "{}"))}
            for c in calls], ensure_ascii=False)


def _json_list(text: str, i: int, final: bool) -> Block:
    """[{"name": ..., "arguments": ...}, ...] from text[i] == '['."""
    calls, j = [], skip_space(text, i + 1)
    while j < len(text) and text[j] == "{":
        scan = scan_object(text, j)
        call = json_call(text, scan, final)
        if call is None:
            if scan.end is None and not scan.malformed and not final:
                return Block(calls, None)  # undecided
            return Block(calls, j)  # the rest is text
        calls.append(call)
        if scan.end is None:
            return Block(calls, None)
        j = skip_space(text, scan.end)
        if text.startswith(",", j):
            j = skip_space(text, j + 1)
    if j < len(text) and text[j] == "]":
        return Block(calls, j + 1)
    if j >= len(text) and not final:
        return Block(calls, None)
    return Block(calls, j if calls else i)
