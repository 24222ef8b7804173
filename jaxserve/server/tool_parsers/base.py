"""What every tool-call parser shares: the parse result, the interface, and the scanning of
JSON text that may still be growing.

A parser reads a model's whole output text so far, `parse(text, final)`, and returns the content
and the calls in it. Parses grow: for a prefix p of a text t, parse(p, False) is a prefix of
parse(t, True) (its content a prefix of the content, each call's name equal and arguments a
prefix, no call the final parse lacks), so streaming sends the differences between successive
parses and the deltas reassemble to the non-streamed answer. Text that may still turn out to be
a call (a trigger's first characters, a call whose name is not complete) is held back until it
is known. Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import ClassVar


@dataclasses.dataclass
class Call:
    name: str
    arguments: str  # JSON text of an object (a prefix of it while the call is being written)


@dataclasses.dataclass
class Parsed:
    content: str
    calls: list[Call]


class ToolParser:
    """One model family's tool-call format."""

    name: ClassVar[str]
    # Text in a chat template that shows it teaches this format (`auto` picks by it).
    template_markers: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call a function in this format, for the system message that lists the tools
        when the chat template renders none."""
        raise NotImplementedError

    def format_calls(self, calls: list[dict]) -> str:
        """Earlier assistant calls (OpenAI's shape) as the model would have written them, for
        chat templates that render no tool calls."""
        raise NotImplementedError


# ------------------------------------------------------------------------------- content
def held_prefix(text: str, triggers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a trigger (it may yet become
    one, so it is held back)."""
    longest = 0
    for trigger in triggers:
        for n in range(min(len(trigger) - 1, len(text)), longest, -1):
            if text.endswith(trigger[:n]):
                longest = n
                break
    return longest


def join_content(pieces: list[str], has_calls: bool, final: bool) -> str:
    """The text around calls as one content: pieces beside a call lose their whitespace there
    and are joined by a newline; a growing text holds its trailing whitespace back (it is
    dropped when a call follows), so every parse's content is a prefix of the final one."""
    out = ""
    for piece in pieces:
        piece = piece.strip() if has_calls else piece
        if piece:
            out = f"{out}\n{piece}" if out and has_calls else out + piece
    return out if final and not has_calls else out.rstrip()


# ------------------------------------------------------------------------------- JSON
class Malformed(Exception):
    """The text cannot be the JSON it was read as."""


_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"', re.S)
_PLAIN = re.compile(r'[^"{}\[\]]*')
_LITERAL = re.compile(r'[-+0-9.eEa-zA-Z]+')
_SPACE = re.compile(r"\s*")


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def string_end(text: str, i: int) -> int | None:
    """End of the JSON string starting at text[i] == '"'; None while it is unterminated."""
    m = _STRING.match(text, i)
    if m is not None:
        return m.end()
    if "\n" in text[i:]:
        raise Malformed("a newline inside a JSON string")
    return None


def value_end(text: str, i: int) -> int | None:
    """End of the JSON value starting at text[i]; None while the text ends inside it."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] not in "{[":
        m = _LITERAL.match(text, i)
        if m is None:
            raise Malformed(f"no JSON value at {text[i]!r}")
        return None if m.end() == len(text) else m.end()
    closers, j = [], i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]":
            if not closers or closers.pop() != c:
                raise Malformed(f"unbalanced {c!r}")
            if not closers:
                return j + 1
        j = _PLAIN.match(text, j + 1).end()
    return None


@dataclasses.dataclass
class ObjectScan:
    fields: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None)
    end: int | None  # after the closing brace; None while open
    malformed: bool = False


def scan_object(text: str, i: int) -> ObjectScan:
    """The top-level fields of the JSON object starting at text[i] == '{', as far as the text
    goes. A malformed object keeps the fields read before the fault."""
    scan = ObjectScan({}, None)
    j = i + 1
    try:
        while True:
            j = skip_space(text, j)
            if j >= len(text):
                return scan
            if text[j] == "}":
                scan.end = j + 1
                return scan
            if text[j] != '"':
                raise Malformed("a key must be a string")
            key_end = string_end(text, j)
            if key_end is None:
                return scan
            key = json.loads(text[j:key_end])
            j = skip_space(text, key_end)
            if j >= len(text):
                return scan
            if text[j] != ":":
                raise Malformed("':' must follow a key")
            j = skip_space(text, j + 1)
            scan.fields[key] = (j, None)  # a malformed value keeps its text so far
            end = value_end(text, j)
            scan.fields[key] = (j, end)
            if end is None:
                return scan
            j = skip_space(text, end)
            if j >= len(text):
                return scan
            if text[j] == ",":
                j += 1
            elif text[j] != "}":
                raise Malformed("',' or '}' must follow a value")
    except (Malformed, json.JSONDecodeError):
        scan.malformed = True
        return scan


def json_call(text: str, scan: ObjectScan, final: bool,
              name_key: str = "name", argument_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> Call | None:
    """The call a {"name": ..., "arguments": {...}} object holds so far; None until its name is
    complete. Arguments that are an object are its JSON text as written (growing with the text);
    a string holding JSON is taken once complete; absent arguments are {} once the object
    closes."""
    start, end = scan.fields.get(name_key, (0, None))
    if end is None:
        return None
    name = json.loads(text[start:end])
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in argument_keys if k in scan.fields), None)
    if key is None:
        return Call(name, "{}" if scan.end is not None or final else "")
    start, end = scan.fields[key]
    raw = text[start:len(text) if end is None else end].rstrip()
    if raw.startswith("{"):
        return Call(name, raw)
    if end is None:
        return Call(name, "")
    value = json.loads(raw)
    return Call(name, value if isinstance(value, str) else raw)


def dumps_arguments(arguments: str | dict) -> str:
    """OpenAI's arguments (JSON text) as the JSON object to write in a format."""
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), ensure_ascii=False)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False)


# ------------------------------------------------------------------------------- triggers
@dataclasses.dataclass
class Block:
    """The calls read after a trigger: `end` where the block stops (None: the text ends inside
    it); `calls` empty means the trigger opened no call (it is then content)."""

    calls: list[Call]
    end: int | None


def parse_triggered(text: str, final: bool, trigger: str, read_block) -> Parsed:
    """Content with calls that each open at `trigger`; read_block(text, after_trigger, final)
    -> Block reads what follows one."""
    pieces, calls, i = [], [], 0
    while True:
        k = text.find(trigger, i)
        if k < 0:
            tail = text[i:]
            pieces.append(tail if final else tail[:len(tail) - held_prefix(tail, (trigger,))])
            break
        pieces.append(text[i:k])
        block = read_block(text, k + len(trigger), final)
        if not block.calls:  # not a call: the trigger is text, unless it may still be one
            if block.end is None and not final:
                break
            pieces.append(trigger)
            i = k + len(trigger)
            continue
        calls += block.calls
        if block.end is None:
            break
        i = block.end
    return Parsed(join_content(pieces, bool(calls), final), calls)
