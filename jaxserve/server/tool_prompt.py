"""Tools in the prompt for every model. A chat template that renders `tools` gets them as it
expects; one that renders none (SmolLM2's) gets them in a system message in the default format
below, with the tool-call parser's own instructions, and earlier assistant calls written into
the content in that parser's format. Host-only.

The default tools message (prepended to the first system message's content, or a system message
of its own):

    # Tools

    These functions are available. Each line between <tools> and </tools> is one function's
    JSON definition (name, description, parameters as a JSON schema):
    <tools>
    {"type": "function", "function": {...}}
    </tools>

    <the parser's instructions: how to write a call>
    Answer in plain text when no function is needed.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.server.tool_parsers import ToolParser

_PROBE = "jaxserve_probe_function"


@dataclasses.dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools, found once by rendering probes."""

    renders_tools: bool
    renders_calls: bool  # assistant messages' tool_calls


def probe_template(tokenizer) -> TemplateTools:
    def shows(messages, **kwargs) -> bool:
        try:
            return _PROBE in tokenizer.apply_chat_template(messages, **kwargs)
        except Exception:  # noqa: BLE001 - a template that fails on the probe renders nothing
            return False

    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": "{}"}}]}
    return TemplateTools(renders_tools=shows([user], tools=[tool]),
                         renders_calls=shows([user, call, {"role": "user", "content": "ok"}],
                                             tools=[tool]))


def tools_message(tools: list[dict], parser: ToolParser) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": fn}, ensure_ascii=False)
                      for fn in tools)
    return ("# Tools\n\nThese functions are available. Each line between <tools> and </tools> "
            "is one function's JSON definition (name, description, parameters as a JSON "
            f"schema):\n<tools>\n{lines}\n</tools>\n\n{parser.instructions()}\n"
            "Answer in plain text when no function is needed.")


def with_tools(messages: list[dict], tools: list[dict], parser: ToolParser,
               template: TemplateTools) -> list[dict]:
    """The messages a template that renders no tools needs to show them (a copy)."""
    messages = [dict(m) for m in messages]
    if not template.renders_calls:
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                written = parser.format_calls(m["tool_calls"])
                m["content"] = f"{m['content']}\n{written}" if m.get("content") else written
    if not template.renders_tools and tools:
        text = tools_message(tools, parser)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages
