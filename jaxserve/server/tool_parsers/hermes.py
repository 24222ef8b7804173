"""Hermes / Qwen 2.5-3: each call a JSON object between tags, several in a row for parallel
calls; text may come before them:

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (Block, Parsed, ToolParser, dumps_arguments,
                                               json_call, parse_triggered, scan_object,
                                               skip_space)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    template_markers = (OPEN,)

    def parse(self, text: str, final: bool) -> Parsed:
        return parse_triggered(text, final, OPEN, self._block)

    @staticmethod
    def _block(text: str, start: int, final: bool) -> Block:
        # A well-formed object decides where the block may close: a close tag inside one of its
        # strings is text (a constrained call's string may hold one).
        j = skip_space(text, start)
        whole = scan_object(text, j) if text.startswith("{", j) else None
        after = start if whole is None or whole.malformed else whole.end or len(text)
        close = text.find(CLOSE, after)
        region = text[start:len(text) if close < 0 else close]
        j = skip_space(region, 0)
        if j >= len(region):
            return Block([], None if close < 0 else close + len(CLOSE))
        if region[j] != "{":
            return Block([], start)  # not a call
        scan = scan_object(region, j)
        call = json_call(region, scan, final or close >= 0)
        if call is None:  # no name yet: undecided until the block or the text ends
            done = close >= 0 or scan.end is not None or scan.malformed
            return Block([], start if done else None)
        if close >= 0:
            return Block([call], close + len(CLOSE))
        if scan.end is None:
            return Block([call], None)
        rest = text[start + scan.end:]
        after = skip_space(rest, 0)
        if not final and CLOSE.startswith(rest[after:]):  # the close tag may be coming
            return Block([call], None)
        return Block([call], start + scan.end)

    def instructions(self) -> str:
        return ("To call a function, write a JSON object with its name and arguments between "
                f"{OPEN} and {CLOSE} tags:\n{OPEN}\n"
                '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
                f"{CLOSE}\nWrite one such block per call.")

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(
            f'{OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{dumps_arguments(c["function"].get("arguments") or "{}")}}}\n{CLOSE}'
            for c in calls)
