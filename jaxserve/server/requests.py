"""The OpenAI request bodies as pydantic models: `CompletionRequest` (/v1/completions) and
`ChatCompletionRequest` (/v1/chat/completions), with their parts. They own the body's shape:
strict JSON types (no coercion: "1" is not 1, true is not 1, NaN and Infinity are refused),
ranges (integers that reach int32 arrays fit them), null meaning the default, unknown fields
ignored as OpenAI does except those of other servers that would change the output, and the rules
between fields. A chat's messages, tools and template fields are jaxserve/chat.py's
`Conversation` (LLM.chat takes the same); the pydantic base and `first_error`, which turns a
ValidationError into one `FieldError`, are jaxserve/json_models.py's. What needs the served model
(its name, vocabulary, context, tokenizer) is checked in protocol.py. The same models give the
OpenAPI schema (`openapi_schemas`). Host-only.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from jaxserve.chat import Conversation, FunctionDefinition  # noqa: F401 - structured_requests
from jaxserve.core.sampling_params import (INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                           MAX_REPETITION_PENALTY, SEED_MAX, SEED_MIN)
from jaxserve.json_models import FieldError, JsonObject, NonEmpty, one_error

# Fields other servers accept that would change the output; here they are a 400, never ignored.
REFUSED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "guided_decoding_backend", "guided_whitespace_pattern", "guided_options_request",
                  "structural_tag", "bad_words", "allowed_token_ids", "min_tokens",
                  "logits_processors", "use_beam_search", "length_penalty", "functions",
                  "function_call")
# Chat only: the model's own template renders every chat (vLLM takes a template per request
# only behind a server flag: a template is code the server runs).
REFUSED_CHAT_FIELDS = ("chat_template",)


TokenId = Annotated[int, Field(description="a token id of the served model's vocabulary")]


# ------------------------------------------------------------------------------- parts
class StreamOptions(JsonObject):
    include_usage: bool = False


class JsonSchemaFormat(JsonObject):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # strict or not, the schema is enforced


class ResponseFormat(JsonObject):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("'response_format.json_schema' must be an object with a 'schema' "
                             "object", "response_format")
        return self


class StructuredOutputs(JsonObject):
    """The extra body field: exactly one of its fields (StructuredOutputsParams checks)."""

    model_config = ConfigDict(extra="forbid")
    json_: Annotated[dict[str, Any] | str | bool, one_error(
        "must be a JSON schema (an object) or its JSON text")] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # llguidance's Lark
    json_object: bool = False


class FunctionName(JsonObject):
    name: str


class NamedToolChoice(JsonObject):
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
class _Request(JsonObject):
    """What both endpoints take."""

    KIND: ClassVar[str]
    REFUSED: ClassVar[tuple[str, ...]] = REFUSED_FIELDS
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
            for name in cls.REFUSED:
                if body.get(name) is not None:
                    hint = (" (use response_format or structured_outputs)"
                            if name.startswith("guided_") else
                            " (the model's own template renders the chat)"
                            if name == "chat_template" else "")
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


class ChatCompletionRequest(_Request, Conversation):
    """POST /v1/chat/completions. Extra fields (vLLM's) as for completions, and Conversation's
    (jaxserve/chat.py): add_generation_prompt, continue_final_message, chat_template_kwargs."""

    KIND: ClassVar[str] = "chat"
    REFUSED: ClassVar[tuple[str, ...]] = REFUSED_FIELDS + REFUSED_CHAT_FIELDS
    tool_choice: ToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="None: the context left")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    parallel_tool_calls: bool = True  # False: at most one call is returned

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
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
