"""The OpenAI request bodies as pydantic models: `CompletionRequest` (/v1/completions) and
`ChatCompletionRequest` (/v1/chat/completions), with their parts. They own the body's shape:
strict JSON types (no coercion: "1" is not 1, true is not 1, NaN and Infinity are refused),
ranges (integers that reach int32 arrays fit them), null meaning the default, unknown fields
ignored as OpenAI does except those of other servers that would change the output, and the rules
between fields. What needs the served model (its name, vocabulary, context, tokenizer) is checked
in protocol.py; `first_error` turns pydantic's ValidationError into one `FieldError`. The same
models give the OpenAPI schema (`openapi_schemas`). Host-only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator

from jaxserve.core.sampling_params import (INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                           MAX_REPETITION_PENALTY, SEED_MAX, SEED_MIN)

# Fields other servers accept that would change the output; here they are a 400, never ignored.
REFUSED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "guided_decoding_backend", "guided_whitespace_pattern", "guided_options_request",
                  "structural_tag", "bad_words", "allowed_token_ids", "min_tokens",
                  "logits_processors", "use_beam_search", "length_penalty", "functions",
                  "function_call")
# What the server itself passes to a chat template.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                "eos_token"})
NOT_UNICODE = "is not valid Unicode text (a lone surrogate?)"


class FieldError(ValueError):
    """A refused field: `param` names it as OpenAI's error does, `code` says why."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


class _Shapeless(ValueError):
    """A field of several shapes that matched none of them; says what it must be."""

    def __init__(self, what: str, code: str):
        super().__init__(what)
        self.code = code


def one_error(what: str) -> WrapValidator:
    """Report any failure of a field of several shapes (a union) as one error, '<field> <what>',
    rather than one per shape."""
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            if any(err["type"] == "string_unicode" for err in e.errors()):
                raise _Shapeless(NOT_UNICODE, "invalid_value") from None
            raise _Shapeless(what, "invalid_type") from None
    return WrapValidator(validate)


class _Object(BaseModel):
    """A JSON object of a request body: null stands for a field's default, as OpenAI's
    nullable fields do."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, value):
        return ({k: v for k, v in value.items() if v is not None} if isinstance(value, dict)
                else value)


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(description="a token id of the served model's vocabulary")]


# ------------------------------------------------------------------------------- parts
class StreamOptions(_Object):
    include_usage: bool = False


class TextPart(_Object):
    type: Literal["text"]
    text: str


class Message(_Object):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart], one_error(
        "must be a string or a list of text parts {'type': 'text', 'text': ...} (only text "
        "parts are supported)")] = ""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # passed to templates that render them
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it: text content, developer as system."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        message.update((k, getattr(self, k)) for k in ("tool_calls", "tool_call_id", "name")
                       if getattr(self, k) is not None)
        return message


class JsonSchemaFormat(_Object):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # strict or not, the schema is enforced


class ResponseFormat(_Object):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("'response_format.json_schema' must be an object with a 'schema' "
                             "object", "response_format")
        return self


class StructuredOutputs(_Object):
    """The extra body field: exactly one of its fields (StructuredOutputsParams checks)."""

    model_config = ConfigDict(extra="forbid")
    json_: Annotated[dict[str, Any] | str | bool, one_error(
        "must be a JSON schema (an object) or its JSON text")] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # llguidance's Lark
    json_object: bool = False


class FunctionDefinition(_Object):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Object):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Object):
    name: str


class NamedToolChoice(_Object):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, one_error(
    "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")]
Stop = Annotated[NonEmpty | Annotated[list[NonEmpty], Field(max_length=16)], one_error(
    "must be a non-empty string or a list of at most 16 non-empty strings")]
Penalty = Annotated[float, Field(ge=-2, le=2), one_error(
    "must be a finite number in [-2, 2] (OpenAI's range)")]
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
         Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    one_error(f"must map token ids (ASCII decimal strings) to finite biases in "
              f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")]
Prompt = Annotated[
    str | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[str | list[TokenId]], Field(min_length=1)],
    one_error("must be a string, a list of strings, a list of token ids or a list of lists of "
              "token ids, and not empty")]


# ------------------------------------------------------------------------------- requests
class _Request(_Object):
    """What both endpoints take."""

    KIND: ClassVar[str]
    model: str | None = None  # None: the first served name
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = None  # only equal to n
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1: disabled")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Stop = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)
    logit_bias: LogitBias | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_servers_fields(cls, body):
        if isinstance(body, dict):
            for name in REFUSED_FIELDS:
                if body.get(name) is not None:
                    hint = (" (use response_format or structured_outputs)"
                            if name.startswith("guided_") else "")
                    raise FieldError(f"'{name}' is not supported by this server{hint}", name,
                                     "unsupported_parameter")
            if body.get("suffix"):
                raise FieldError("'suffix' is not supported by this server", "suffix",
                                 "unsupported_parameter")
        return body

    @model_validator(mode="after")
    def _shared_rules(self):
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("'best_of' other than n is not supported", "best_of",
                             "unsupported_parameter")
        if self.stream_options is not None and self.stream_options.include_usage \
                and not self.stream:
            raise FieldError("'stream_options' is only allowed when 'stream' is true",
                             "stream_options")
        return self


class CompletionRequest(_Request):
    """POST /v1/completions. Extra fields (vLLM's): top_k, min_p, stop_token_ids, ignore_eos,
    repetition_penalty, structured_outputs."""

    KIND: ClassVar[str] = "completion"
    prompt: Prompt
    echo: bool = False  # return the prompt (and its logprobs) before the completion
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int = Field(16, ge=0, le=INT32_MAX, description="0 only with echo (scoring)")

    @model_validator(mode="before")
    @classmethod
    def _tools_are_for_chat(cls, body):
        for name in ("tools", "tool_choice"):
            if isinstance(body, dict) and body.get(name) is not None:
                raise FieldError(f"'{name}' is for chat completions", name)
        return body

    @model_validator(mode="after")
    def _zero_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("'max_tokens' must be >= 1 (0 is allowed only with echo=true)",
                             "max_tokens")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. Extra fields (vLLM's) as for completions, and
    add_generation_prompt."""

    KIND: ClassVar[str] = "chat"
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="None: the context left")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    add_generation_prompt: bool = True
    parallel_tool_calls: bool = True  # False: at most one call is returned
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _template_kwargs_add_variables(self):
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise FieldError(f"'chat_template_kwargs' may not set {taken} (the request's own "
                             "fields do)", "chat_template_kwargs")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


REQUEST_MODELS = {model.KIND: model for model in (CompletionRequest, ChatCompletionRequest)}


def openapi_schemas() -> dict[str, dict]:
    """The request models' JSON schemas and their parts', as OpenAPI's components.schemas."""
    out = {}
    for model in REQUEST_MODELS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


# ------------------------------------------------------------------------------- errors
_MESSAGES = {  # pydantic's error type -> how the field is described
    "missing": "is required", "int_type": "must be an integer", "float_type": "must be a number",
    "bool_type": "must be a boolean", "string_type": "must be a string",
    "list_type": "must be a list", "dict_type": "must be an object",
    "model_type": "must be an object", "model_attributes_type": "must be an object",
    "finite_number": "must be a finite number", "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}", "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}", "too_long": "takes at most {max_length} items",
    "string_too_short": "must be a non-empty string", "literal_error": "must be {expected}",
    "string_pattern_mismatch": "must match {pattern}",
    "string_unicode": NOT_UNICODE,
}
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _param(loc: tuple) -> str | None:
    """("messages", 0, "role") -> "messages[0].role" (union tags such as "list[int]" left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part):
            out += f".{part}" if out else part
    return out or None


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _describe(kind: str, ctx: dict, fallback: str) -> str:
    """How an error of pydantic's type `kind` describes the field."""
    if kind == "too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else \
            f"must hold at least {ctx.get('min_length')} items"
    if kind in _MESSAGES:
        return _MESSAGES[kind].format(**{k: _number(v) for k, v in ctx.items()})
    return fallback


def first_error(e: ValidationError) -> FieldError:
    """The first problem pydantic found, as one FieldError naming the field."""
    err = e.errors(include_url=False)[0]
    loc, kind, ctx = err["loc"], err["type"], err.get("ctx") or {}
    cause = ctx.get("error")  # what a validator raised
    if isinstance(cause, FieldError):  # a rule between fields: its message says it all
        return cause
    if not loc and kind == "model_type":
        return FieldError("the request body must be a JSON object", None, "invalid_type")
    if kind == "extra_forbidden":  # named by the object that does not take it
        param = _param(loc[:-1])
        return FieldError(f"'{param}' takes no field {loc[-1]!r}", param)
    param = _param(loc)
    if isinstance(cause, _Shapeless):
        what, code = str(cause), cause.code
    elif isinstance(cause, Exception):  # another ValueError of a validator
        return FieldError(str(cause), getattr(cause, "param", None) or param)
    else:
        what = _describe(kind, ctx, err["msg"])
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith("_type") else "invalid_value")
    got = "" if kind == "missing" else f", got {_short(err['input'])}"
    return FieldError(f"'{param or 'body'}' {what}{got}", param, code)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
