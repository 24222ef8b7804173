"""Pythonic calls (Llama 3.2 and 4, several fine-tunes): the whole answer is a Python list of
calls with keyword arguments of literal values, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", unit="c"), get_time(zone=1)]

Each call is read once its closing parenthesis arrives (name and arguments together); its
arguments become a JSON object (True -> true, None -> null). An answer that does not open with
`[name(` is text, and so is a call cut short (max_tokens) before its closing parenthesis.
"""

from __future__ import annotations

import ast
import json
import re

from jaxserve.server.tool_parsers.base import (Call, Parsed, ToolParser, join_content,
                                               skip_space)

START, END = "<|python_start|>", "<|python_end|>"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # a callable name (pythonic_grammar.py too)
_PY_STRING = re.compile(r"""'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*\"""", re.S)


def _paren_end(text: str, i: int) -> int | None:
    """End of the parenthesised arguments from text[i] == '('; None while open. Raises
    ValueError on unbalanced brackets."""
    closers, j = [], i
    while j < len(text):
        c = text[j]
        if c in "'\"":
            m = _PY_STRING.match(text, j)
            if m is None:
                return None
            j = m.end()
            continue
        if c in "([{":
            closers.append({"(": ")", "[": "]", "{": "}"}[c])
        elif c in ")]}":
            if not closers or closers.pop() != c:
                raise ValueError("unbalanced brackets")
            if not closers:
                return j + 1
        j += 1
    return None


def _arguments(source: str) -> str:
    """'f(a=1, b="x")' -> '{"a": 1, "b": "x"}'; ValueError unless every argument is a keyword
    with a literal value."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None
                                                               for k in node.keywords):
            raise ValueError("only keyword arguments")
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords},
                          ensure_ascii=False, allow_nan=False)
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(str(e)) from None


class PythonicParser(ToolParser):
    name = "pythonic"
    template_markers = ("<|python_start|>", "[func_name1(params_name1=params_value1")

    def parse(self, text: str, final: bool) -> Parsed:
        j = skip_space(text, 0)
        if text.startswith(START, j):
            j = skip_space(text, j + len(START))
        elif not final and j < len(text) and START.startswith(text[j:]):
            return Parsed("", [])
        as_text = Parsed(text if final else text.rstrip(), [])
        if j >= len(text):
            return as_text if final else Parsed("", [])
        if text[j] != "[":
            return as_text
        calls, i = [], skip_space(text, j + 1)
        while i < len(text):
            m = NAME.match(text, i)
            if m is None:
                break
            if m.end() >= len(text):
                return self._undecided(text, i, calls, final)
            if text[m.end()] != "(":
                break
            try:
                end = _paren_end(text, m.end())
                if end is None:
                    return self._undecided(text, i, calls, final)
                calls.append(Call(m.group(), _arguments("f" + text[m.end():end])))
            except ValueError:
                break
            i = skip_space(text, end)
            if text.startswith(",", i):
                i = skip_space(text, i + 1)
            elif text.startswith("]", i):
                i = skip_space(text, i + 1)
                if text.startswith(END, i):
                    i += len(END)
                elif not final and END.startswith(text[i:]) and i < len(text):
                    return Parsed("", calls)
                return Parsed(join_content([text[i:]], True, final), calls)
            elif i < len(text):
                break
        if not calls:
            return as_text if final or i < len(text) else Parsed("", [])
        return Parsed(join_content([text[i:]], True, final), calls) if final or i < len(text) \
            else Parsed("", calls)

    @staticmethod
    def _undecided(text: str, start: int, calls: list[Call], final: bool) -> Parsed:
        """The text ends inside the call from `start`: held back while it grows; at the end
        (max_tokens) the cut call's text is content, the whole text when no call came before
        it (as every parser gives back an opening that holds no call yet)."""
        if not final:
            return Parsed("", calls)
        return Parsed(text, []) if not calls else Parsed(
            join_content([text[start:]], True, True), calls)

    def instructions(self) -> str:
        return ("To call functions, answer with only a Python list of calls with keyword "
                "arguments: [func_name(arg=value, ...), ...].")

    def format_calls(self, calls: list[dict]) -> str:
        parts = []
        for c in calls:
            try:
                args = json.loads(c["function"].get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {}
            kwargs = ", ".join(f"{k}={v!r}" for k, v in (args.items()
                                                         if isinstance(args, dict) else ()))
            parts.append(f"{c['function']['name']}({kwargs})")
        return "[" + ", ".join(parts) + "]"
