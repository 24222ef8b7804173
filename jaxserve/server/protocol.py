"""OpenAI requests, shared by the HTTP server and batch files.

`parse_request(kind, body, ctx)` validates a JSON body of /v1/completions ("completion") or
/v1/chat/completions ("chat") through its pydantic model (requests.py: the body's shape, ranges
and rules between fields), checks it against the served model (its name, vocabulary, context and
the server's max_tokens limit) and turns it into engine prompts plus one SamplingParams; every
problem raises `APIError` carrying OpenAI's error shape. Responses are built in responses.py.
Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import ValidationError

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.json_models import first_error
from jaxserve.server.requests import REQUEST_MODELS, ChatCompletionRequest, CompletionRequest
from jaxserve.server.chat_output import ChatOutputParser
from jaxserve.server.reasoning import ReasoningParser, reasoning_parser
from jaxserve.server.served_adapters import ServedAdapters
from jaxserve.server.structured_requests import (OutputConstraint, after_thinking,
                                                 output_constraint)
from jaxserve.server.tool_grammar import tool_grammar
from jaxserve.server.tool_parsers import ToolParser, tool_parser
from jaxserve.server.tool_prompt import TemplateTools, probe_template, with_tools
from jaxserve.tokenizer import ChatTemplateError


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus {"error": {message, type, param, code}}."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = \
            message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ProtocolContext:
    """What request validation needs to know about the served model and the server's limits."""

    model_names: tuple[str, ...]  # the base model's; served_names adds the adapters'
    tokenizer: Any  # jaxserve.tokenizer.Tokenizer
    max_model_len: int
    vocab_size: int
    max_tokens_limit: int | None = None  # refuse larger max_tokens; None: only the context bounds
    tool_call_parser: str = "auto"  # a name of tool_parsers.PARSERS; auto: from the template
    reasoning_parser: str | None = None  # a name of reasoning.REASONING_PARSERS; None: none
    # A chat's rendered text (tools included) longer than this is refused before tokenizing;
    # None: no limit (the server sets --max_prompt_chars's, server/body_limits.py)
    max_prompt_chars: int | None = None
    # The LoRA adapters served by name (changed at runtime by /v1/load_lora_adapter)
    adapters: ServedAdapters = dataclasses.field(default_factory=ServedAdapters)

    def __post_init__(self):
        self.tool_parser, self.reasoning  # noqa: B018 - unknown names fail at construction

    @classmethod
    def for_engine(cls, engine, model_names: tuple[str, ...] | None = None,
                   max_tokens_limit: int | None = None, tool_call_parser: str = "auto",
                   reasoning_parser: str | None = None) -> "ProtocolContext":
        served = engine.served_model  # engine/client.py's ServedModel
        return cls(model_names=model_names or (served.name,),
                   adapters=ServedAdapters(served.lora_modules),  # served by name too
                   tokenizer=served.tokenizer, max_model_len=served.max_model_len,
                   vocab_size=served.vocab_size, max_tokens_limit=max_tokens_limit,
                   tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's "model" may give: the base model's, then the adapters'."""
        return self.model_names + self.adapters.names()

    @functools.cached_property
    def tool_parser(self) -> ToolParser:
        return tool_parser(self.tool_call_parser, getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def reasoning(self) -> ReasoningParser | None:
        return reasoning_parser(self.reasoning_parser)

    @functools.cached_property
    def template_tools(self) -> TemplateTools:
        return probe_template(self.tokenizer)


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompts: list[dict]  # engine prompts: {"prompt_token_ids": [...], "prompt": text or None}
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: return the prompt (and its logprobs) before the completion
    hide_generated: bool = False  # echo with max_tokens=0: one token is generated, not returned
    num_logprobs: int | None = None  # top logprobs per token to return; None: no logprobs
    tool_call: bool = False  # chat: the output is constrained to a call of the offered tools
    # chat: reads reasoning and (tool_choice "auto") tool calls back from the text; None: plain
    output_parser: ChatOutputParser | None = None
    constraint_field: str | None = None  # the field that constrains the output, if any


# ------------------------------------------------------------------------------- parse
def parse_request(kind: str, body: Any, ctx: ProtocolContext) -> ParsedRequest:
    """Validate one /v1/completions ("completion") or /v1/chat/completions ("chat") body. Any
    problem is an APIError (400 unless it says otherwise), never another exception."""
    try:
        return _parsed(REQUEST_MODELS[kind].model_validate(body), ctx)
    except ValidationError as e:
        error = first_error(e)
        raise APIError(str(error), param=error.param, code=error.code) from None
    except (ValueError, TypeError) as e:  # a FieldError, text that is not Unicode, a value
        # SamplingParams refuses (InvalidParam names it)
        raise APIError(str(e), param=getattr(e, "param", None),
                       code=getattr(e, "code", "invalid_value")) from None


def _token_ids(ids: list[int], name: str, vocab_size: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'{name}' holds token ids outside [0, {vocab_size}): {bad[:5]}",
                       param=name, code="invalid_value")
    return list(ids)


def _completion_prompts(request: CompletionRequest, ctx: ProtocolContext) -> list[dict]:
    prompt = request.prompt
    items = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    prompts = []
    for item in items:
        text = item if isinstance(item, str) else None
        ids = (ctx.tokenizer.encode(item) if text is not None
               else _token_ids(item, "prompt", ctx.vocab_size))
        if not ids:
            raise APIError("the prompt is empty", param="prompt", code="invalid_value")
        prompts.append({"prompt_token_ids": ids, "prompt": text})
    return prompts


def _chat_prompt(request: ChatCompletionRequest, ctx: ProtocolContext,
                 constraint: OutputConstraint) -> dict:
    """The rendered chat. When the template renders no tools and the model chooses whether to
    call (tool_choice "auto"), they go into a system message (tool_prompt.py); a forced call's
    output is constrained to the tools' schemas and its prompt is left as it was."""
    messages = request.template_messages()
    if constraint.auto_tools or any(m.get("tool_calls") for m in messages):
        messages = with_tools(messages, constraint.tools if constraint.auto_tools else [],
                              ctx.tool_parser, ctx.template_tools)
    try:
        text = request.render(ctx.tokenizer, messages)
    except ChatTemplateError as e:
        raise APIError(str(e), param=e.param, code="invalid_value") from None
    if ctx.max_prompt_chars is not None and len(text) > ctx.max_prompt_chars:
        raise APIError(f"the chat renders to {len(text)} characters (its tools included); this "
                       f"server accepts at most {ctx.max_prompt_chars} (--max_prompt_chars)",
                       param="messages", code="invalid_value")
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    return {"prompt_token_ids": ids, "prompt": text}


def _parsed(request: CompletionRequest | ChatCompletionRequest,
            ctx: ProtocolContext) -> ParsedRequest:
    """The engine's request from a valid body, checked against the served model."""
    model = request.model or ctx.model_names[0]
    if model not in ctx.served_names:
        raise APIError(f"The model `{model}` does not exist. Served: {list(ctx.served_names)}",
                       status=404, param="model", code="model_not_found")
    constraint = output_constraint(request)
    chat = isinstance(request, ChatCompletionRequest)
    if chat:
        constraint = _auto_tool_constraint(request, ctx, constraint)
        constraint = after_thinking(constraint, ctx.tokenizer, ctx.reasoning)
    prompts = ([_chat_prompt(request, ctx, constraint)] if chat
               else _completion_prompts(request, ctx))
    echo = not chat and request.echo
    num_logprobs = request.num_logprobs

    name, max_tokens = "max_tokens", request.max_tokens
    if chat and max_tokens is None and request.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", request.max_completion_tokens
    if max_tokens is not None and ctx.max_tokens_limit is not None \
            and max_tokens > ctx.max_tokens_limit:
        raise APIError(f"'{name}' is {max_tokens} but this server allows at most "
                       f"{ctx.max_tokens_limit}", param=name, code="invalid_value")
    hide_generated = max_tokens == 0  # echo with max_tokens=0: one token generated, not returned
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    left = ctx.max_model_len - longest
    to_context = max_tokens is None and (ctx.max_tokens_limit is None
                                         or left <= ctx.max_tokens_limit)
    if max_tokens is None:  # chat's default: the context left
        max_tokens = left if ctx.max_tokens_limit is None else min(left, ctx.max_tokens_limit)
    engine_max = max(max_tokens, 1)
    if longest + engine_max > ctx.max_model_len:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. "
                       f"However, you requested {longest + max_tokens} tokens ({longest} in the "
                       f"prompt, {max_tokens} for the completion). Please reduce the prompt or "
                       f"max_tokens.", param="messages" if chat else "prompt",
                       code="context_length_exceeded")

    params = SamplingParams(
        n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, seed=request.seed,
        # Up to the context: None, which the engine bounds itself (a KV pool shorter than the
        # context ends it with "length"); an explicit max_tokens the pool cannot hold is refused.
        max_tokens=None if to_context else engine_max, stop=request.stop,
        stop_token_ids=_token_ids(request.stop_token_ids, "stop_token_ids", ctx.vocab_size),
        ignore_eos=request.ignore_eos,
        logprobs=num_logprobs if (num_logprobs is not None and not hide_generated) else None,
        prompt_logprobs=num_logprobs if (echo and num_logprobs is not None) else None,
        logit_bias=request.logit_bias, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty, structured_outputs=constraint.spec)
    bad = [t for t in params.logit_bias or () if t >= ctx.vocab_size]
    if bad:
        raise APIError(f"'logit_bias' holds token ids outside [0, {ctx.vocab_size}): {bad[:5]}",
                       param="logit_bias", code="invalid_value")
    return ParsedRequest(
        kind=request.KIND, model=model, prompts=prompts, params=params, stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        echo=echo, hide_generated=hide_generated, num_logprobs=num_logprobs,
        tool_call=constraint.tool_call, constraint_field=constraint.field,
        output_parser=_output_parser(request, ctx, constraint) if chat else None)


def _auto_tool_constraint(request: ChatCompletionRequest, ctx: ProtocolContext,
                          constraint: OutputConstraint) -> OutputConstraint:
    """tool_choice "auto" (or tools without one) and no other constraint: the answer is free
    text whose calls are constrained once opened (tool_grammar.py); unchanged otherwise (an
    explicit response_format or structured_outputs wins)."""
    if not constraint.auto_tools or constraint.spec is not None:
        return constraint
    grammar = tool_grammar(ctx.tool_parser, constraint.tools, ctx.tokenizer, ctx.reasoning,
                           parallel=request.parallel_tool_calls)
    if grammar is None:
        return constraint
    return dataclasses.replace(constraint, field="tools", spec=StructuredOutputsParams(
        grammar=grammar.lark, special_text_ids=grammar.special_text_ids))


def _output_parser(request: ChatCompletionRequest, ctx: ProtocolContext,
                   constraint: OutputConstraint) -> ChatOutputParser | None:
    """How the answer's text is read back: reasoning split off, and tool calls read when the
    model chooses whether to call (a forced call is a constrained output of its own)."""
    tools = ctx.tool_parser if constraint.auto_tools else None
    if tools is None and ctx.reasoning is None or constraint.tool_call:
        return None
    return ChatOutputParser(tools=tools, reasoning=ctx.reasoning,
                            parallel_tool_calls=request.parallel_tool_calls)
