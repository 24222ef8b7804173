"""The output constraint of a validated request (requests.py holds the fields' shapes): one of
`response_format` (json_object, json_schema), the extra body field `structured_outputs`, or
`tools` with a `tool_choice` that forces a call, as one StructuredOutputsParams; a response
format put after the thinking when a reasoning parser reads it (`after_thinking`); and a forced
call read back from its output (`forced_call`). Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.requests import (ChatCompletionRequest, CompletionRequest, FieldError,
                                      FunctionDefinition, ResponseFormat, StructuredOutputs)
from jaxserve.server.tool_grammar import after_reasoning, forced_call_grammar


@dataclasses.dataclass(frozen=True)
class OutputConstraint:
    spec: StructuredOutputsParams | None  # what the output must match; None: free text
    field: str | None = None  # the body's field it came from (an error about it names it)
    tool_call: bool = False  # the output is a call of an offered function
    tools: list[dict] | None = None  # the functions offered, as the chat template takes them
    auto_tools: bool = False  # tool_choice "auto" (or none given): calls are read from the text


def _response_format(value: ResponseFormat) -> StructuredOutputsParams | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    # strict or not, the schema is enforced: the output is always valid against it.
    return StructuredOutputsParams(json=value.json_schema.schema_)


def _structured_field(value: StructuredOutputs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**value.model_dump(by_alias=True, exclude_unset=True))
    except ValueError as e:  # not exactly one, JSON text that is not JSON, ...
        raise FieldError(str(e), "structured_outputs") from None
    except RecursionError:  # JSON text nested deeper than the C parser goes
        raise FieldError("structured_outputs.json nests too deeply", "structured_outputs") \
            from None


def _forced(functions: list[FunctionDefinition], choice) -> list[FunctionDefinition]:
    """The functions that tool_choice forces a call of (none for 'none' and 'auto': the model
    chooses, and its calls are read back by its tool-call parser)."""
    if choice in (None, "auto", "none"):
        return []
    if choice == "required":
        return functions
    offered = [fn for fn in functions if fn.name == choice.function.name]
    if not offered:
        raise FieldError(f"tool_choice names {choice.function.name!r}, which is not in 'tools'",
                         "tool_choice")
    return offered


def output_constraint(request: CompletionRequest | ChatCompletionRequest) -> OutputConstraint:
    """At most one of response_format, structured_outputs and a forced tool call constrains the
    output; FieldError otherwise, or for a tool_choice that names no offered function."""
    specs = []
    if request.response_format is not None:
        spec = _response_format(request.response_format)
        if spec is not None:
            specs.append(("response_format", spec))
    if request.structured_outputs is not None:
        specs.append(("structured_outputs", _structured_field(request.structured_outputs)))
    tools = getattr(request, "tools", None)  # chat only
    choice = getattr(request, "tool_choice", None)
    if tools is not None:
        forced = _forced([tool.function for tool in tools], request.tool_choice)
        if forced:  # each tool's parameters their own root, so their $refs resolve
            grammar = forced_call_grammar([fn.model_dump(exclude_unset=True) for fn in forced])
            specs.append(("tool_choice", StructuredOutputsParams(grammar=grammar)))
    elif choice is not None:
        raise FieldError("'tool_choice' needs 'tools'", "tool_choice")
    if len(specs) > 1:
        raise FieldError(f"only one of {[name for name, _ in specs]} may constrain the output",
                         specs[1][0])
    return OutputConstraint(
        spec=specs[0][1] if specs else None, field=specs[0][0] if specs else None,
        tool_call=any(name == "tool_choice" for name, _ in specs),
        tools=[tool.function.model_dump(exclude_unset=True) for tool in tools] if tools else None,
        auto_tools=bool(tools) and choice in (None, "auto"))


def after_thinking(constraint: OutputConstraint, tokenizer,
                   reasoning: ReasoningParser | None) -> OutputConstraint:
    """A chat's response_format or structured_outputs with a reasoning parser: the thinking
    comes first, free, and the format constrains the answer after it, so the answer lands in
    `content` (a forced call and tool_choice "auto"'s grammar are left as they are)."""
    spec = constraint.spec
    if reasoning is None or spec is None or constraint.field not in (
            "response_format", "structured_outputs"):
        return constraint
    wrapper = after_reasoning(tokenizer, reasoning)
    return dataclasses.replace(constraint, spec=dataclasses.replace(
        spec, wrapper=wrapper.lark,
        special_text_ids=tuple(sorted({*spec.special_text_ids, *wrapper.special_text_ids}))))


# A forced call's output, as forced_call_grammar writes it: its name, then its arguments.
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def forced_call(text: str) -> tuple[dict | None, bool]:
    """The OpenAI tool call in a forced call's output, and whether it is complete. An output
    cut short (max_tokens, a stop string) is the call as far as it was written, arguments
    partial JSON, as OpenAI returns a call cut by max_tokens; None before its name is whole."""
    head = _HEAD.match(text)
    if head is None:
        return None, False
    try:
        json.loads(text)
        complete, arguments = True, text[head.end():-1]
    except json.JSONDecodeError:
        complete, arguments = False, text[head.end():]
    call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": json.loads(head.group(1)), "arguments": arguments}}
    return call, complete
