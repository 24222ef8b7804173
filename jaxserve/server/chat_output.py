"""A chat answer's text read back into OpenAI's message parts: reasoning (`reasoning_content`),
content and `tool_calls`, through the configured reasoning parser and, when the request offers
tools with tool_choice "auto", the model's tool-call parser. `ChatOutputParser.parse` reads a
whole text; `ChatOutputStream` sends what each new text adds, as OpenAI's deltas (a call's id,
type and name first, then argument fragments), so the deltas reassemble to the whole parse.
Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import uuid

from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.tool_parsers import Call, ToolParser


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass
class ChatOutput:
    reasoning: str | None
    content: str
    calls: list[Call]


@dataclasses.dataclass(frozen=True)
class ChatOutputParser:
    tools: ToolParser | None = None  # None: no tool calls are read (no tools, or not "auto")
    reasoning: ReasoningParser | None = None
    parallel_tool_calls: bool = True  # False: only the first call is returned

    def parse(self, text: str, final: bool = True) -> ChatOutput:
        reasoning, answer = (self.reasoning.split(text, final) if self.reasoning is not None
                             else (None, text))
        if self.tools is None:
            return ChatOutput(reasoning, answer, [])
        parsed = self.tools.parse(answer, final)
        calls = parsed.calls if self.parallel_tool_calls else parsed.calls[:1]
        return ChatOutput(reasoning, parsed.content, calls)

    def message(self, text: str) -> dict:
        """The non-streamed assistant message of a finished text."""
        out = self.parse(text)
        message = {"role": "assistant", "content": out.content or (None if out.calls else "")}
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = [
                {"id": call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
        return message


class ChatOutputStream:
    """One choice's stream: `delta(text, final)` -> the delta fields new since the last call."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.sent_reasoning = self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call already opened

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_arguments)

    def delta(self, text: str, final: bool) -> dict:
        out = self.parser.parse(text, final)
        delta = {}
        if out.reasoning and len(out.reasoning) > self.sent_reasoning:
            delta["reasoning_content"] = out.reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(out.reasoning)
        if len(out.content) > self.sent_content:
            delta["content"] = out.content[self.sent_content:]
            self.sent_content = len(out.content)
        calls = []
        for index, call in enumerate(out.calls):
            if index == len(self.sent_arguments):  # a new call: id, type and name first
                self.sent_arguments.append(0)
                calls.append({"index": index, "id": call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            fragment = call.arguments[self.sent_arguments[index]:]
            if fragment:
                self.sent_arguments[index] = len(call.arguments)
                if calls and calls[-1]["index"] == index:
                    calls[-1]["function"]["arguments"] += fragment
                else:
                    calls.append({"index": index, "function": {"arguments": fragment}})
        if calls:
            delta["tool_calls"] = calls
        return delta
