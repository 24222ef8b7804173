"""Llama 3.1-3.3 JSON calls: the whole answer is the calls, each a JSON object with `name` and
`parameters` (or `arguments`), after an optional `<|python_tag|>`, several joined by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with a call is text; so is one whose first object holds no name.
"""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers.base import (Parsed, ToolParser, dumps_arguments, join_content,
                                               json_call, scan_object, skip_space)

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    template_markers = ("<|python_tag|>", '"parameters": dictionary of argument name')

    def parse(self, text: str, final: bool) -> Parsed:
        j = skip_space(text, 0)
        if text.startswith(TAG, j):
            j = skip_space(text, j + len(TAG))
        elif not final and TAG.startswith(text[j:]) and j < len(text):
            return Parsed("", [])  # may be the tag
        if j >= len(text) or text[j] != "{":
            return Parsed(text if final else text.rstrip(), []) \
                if j < len(text) or final else Parsed("", [])
        calls, i = [], j
        while i < len(text) and text[i] == "{":
            scan = scan_object(text, i)
            call = json_call(text, scan, final)
            if call is None:
                if scan.end is None and not scan.malformed and not final:
                    return Parsed("", calls)  # undecided
                break  # not a call: the rest is text
            calls.append(call)
            if scan.end is None:
                return Parsed("", calls)
            i = skip_space(text, scan.end)
            if text.startswith(";", i):
                i = skip_space(text, i + 1)
        if not calls:
            return Parsed(text if final else text.rstrip(), [])
        return Parsed(join_content([text[i:]], True, final), calls)

    def instructions(self) -> str:
        return ("To call a function, answer with only a JSON object of its name and "
                'arguments: {"name": <function name>, "parameters": <arguments as a JSON '
                "object>}. Join several calls with '; '.")

    def format_calls(self, calls: list[dict]) -> str:
        return "; ".join(
            f'{{"name": {json.dumps(c["function"]["name"])}, "parameters": '
            f'{dumps_arguments(c["function"].get("arguments") or "{}")}}}' for c in calls)
