"""The OpenAI request fields that constrain or steer the output: `response_format` (json_object,
json_schema), the extra body field `structured_outputs`, `tools` with `tool_choice`, and the
logit controls (`logit_bias`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`);
and tool calls read back from a constrained output. Fields of other servers that would change
the output and that this one does not implement (`guided_json`, ...) are refused, never ignored.
Host-only, no engine calls.
"""

from __future__ import annotations

import json
import uuid

from jaxserve.core.structured_output import StructuredOutputsParams

# Fields other servers accept that would change the output; here they are a 400.
REFUSED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "guided_decoding_backend", "guided_whitespace_pattern", "guided_options_request",
                  "structural_tag", "bad_words", "allowed_token_ids", "min_tokens",
                  "logits_processors", "use_beam_search", "length_penalty", "functions",
                  "function_call")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredRequestError(ValueError):
    """A bad field: `param` names it (the caller turns it into a 400)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def refuse_unsupported(body: dict) -> None:
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            hint = (" (use response_format or structured_outputs)"
                    if name.startswith("guided_") else "")
            raise StructuredRequestError(f"'{name}' is not supported by this server{hint}",
                                         name, "unsupported_parameter")


def logit_controls(body: dict) -> dict:
    """SamplingParams keyword arguments of the logit controls present in the body (their
    ranges are checked by SamplingParams)."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StructuredRequestError(f"'{name}' must be a number, got {value!r}", name,
                                             "invalid_type")
            if name != "repetition_penalty" and not -2 <= value <= 2:  # OpenAI's range
                raise StructuredRequestError(f"'{name}' must be in [-2, 2], got {value!r}", name,
                                             "invalid_value")
            out[name] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise StructuredRequestError("'logit_bias' must map token ids to biases",
                                         "logit_bias", "invalid_type")
        out["logit_bias"] = bias  # its keys and values are checked by SamplingParams
    return out


def _response_format(value) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object",
                                                                "json_schema"):
        raise StructuredRequestError("'response_format' must be an object with type 'text', "
                                     "'json_object' or 'json_schema'", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise StructuredRequestError("'response_format.json_schema' must be an object with a "
                                     "'schema' object", "response_format")
    # strict or not, the schema is enforced: the output is always valid against it.
    return StructuredOutputsParams(json=spec.get("schema", {}))


def _structured_field(value) -> StructuredOutputsParams:
    if not isinstance(value, dict) or set(value) - set(STRUCTURED_KEYS):
        raise StructuredRequestError(f"'structured_outputs' must be an object with one of "
                                     f"{list(STRUCTURED_KEYS)}", "structured_outputs")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise StructuredRequestError(str(e), "structured_outputs") from None


def _tools(body: dict) -> list[dict]:
    tools = body["tools"]
    if not isinstance(tools, list) or not tools:
        raise StructuredRequestError("'tools' must be a non-empty list", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"] or not isinstance(fn.get("parameters", {}), dict):
            raise StructuredRequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                f"'parameters': <JSON schema>}}}}", f"tools[{i}]")
        out.append(fn)
    return out


def _call_schema(fn: dict) -> dict:
    """A call of one function: {"name": <its name>, "arguments": <its parameters>}."""
    return {"type": "object", "properties": {
        "name": {"const": fn["name"]},
        "arguments": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}


def structured_spec(body: dict, kind: str) -> tuple[StructuredOutputsParams | None, bool,
                                                   list[dict] | None]:
    """(the body's output constraint, whether the output is a tool call, the tools offered as
    the chat template takes them). At most one of response_format, structured_outputs and a
    forced tool call constrains the output."""
    specs = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            specs.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        specs.append(("structured_outputs", _structured_field(body["structured_outputs"])))
    tools = None
    choice = body.get("tool_choice")
    if body.get("tools") is not None and kind == "chat":
        tools = _tools(body)
        choice = "auto" if choice is None else choice
        if choice == "auto":
            raise StructuredRequestError(
                "tool_choice 'auto' needs a model-specific parser of tool calls in free text, "
                "which this server does not have: use tool_choice 'required', a named function "
                "or 'none'", "tool_choice", "unsupported_parameter")
        if choice == "required":
            offered = tools
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
                choice.get("function"), dict):
            name = choice["function"].get("name")
            offered = [fn for fn in tools if fn["name"] == name]
            if not offered:
                raise StructuredRequestError(f"tool_choice names {name!r}, which is not in "
                                             "'tools'", "tool_choice")
        elif choice == "none":
            offered = None
        else:
            raise StructuredRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                         "{'type': 'function', 'function': {'name': ...}}",
                                         "tool_choice")
        if offered:
            schema = (_call_schema(offered[0]) if len(offered) == 1
                      else {"anyOf": [_call_schema(fn) for fn in offered]})
            specs.append(("tool_choice", StructuredOutputsParams(json=schema)))
    elif body.get("tool_choice") is not None:
        raise StructuredRequestError("'tool_choice' needs 'tools'", "tool_choice")
    elif body.get("tools") is not None:
        raise StructuredRequestError("'tools' are for chat completions", "tools")
    if len(specs) > 1:
        raise StructuredRequestError(f"only one of {[name for name, _ in specs]} may constrain "
                                     "the output", specs[1][0])
    forced = any(name == "tool_choice" for name, _ in specs)
    return (specs[0][1] if specs else None), forced, tools


def tool_call(text: str) -> dict | None:
    """The OpenAI tool call in a completed constrained output ({"name", "arguments"}); None if
    the output stopped early (its JSON is incomplete)."""
    try:
        call = json.loads(text)
        name, arguments = call["name"], json.dumps(call["arguments"])
    except (json.JSONDecodeError, KeyError, TypeError):  # cut short (a stop string)
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}
