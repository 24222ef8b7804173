"""OpenAI requests, shared by the HTTP server and batch files.

`parse_request(kind, body, ctx)` validates a JSON body of /v1/completions ("completion") or
/v1/chat/completions ("chat") and turns it into engine prompts plus one SamplingParams; every
problem raises `APIError` carrying OpenAI's error shape. Unknown fields are ignored, as OpenAI
does, except those of other servers that would change the output (structured_requests.py). Responses are built in responses.py. Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.core.sampling_params import INT32_MAX, SamplingParams
from jaxserve.server.structured_requests import (StructuredRequestError, logit_controls,
                                                 refuse_unsupported, structured_spec)

MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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

    model_names: tuple[str, ...]
    tokenizer: Any  # jaxserve.tokenizer.Tokenizer
    max_model_len: int
    vocab_size: int
    max_tokens_limit: int | None = None  # refuse larger max_tokens; None: only the context bounds

    @classmethod
    def for_engine(cls, engine, model_names: tuple[str, ...] | None = None,
                   max_tokens_limit: int | None = None) -> "ProtocolContext":
        return cls(model_names=model_names or (engine.config.model,),
                   tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                   vocab_size=engine.model_config.vocab_size, max_tokens_limit=max_tokens_limit)


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


# ------------------------------------------------------------------------------- field readers
def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    """A numeric field: of its type, finite (JSON's NaN and Infinity literals are refused), in
    range; integers within int32 unless `hi` says otherwise."""
    value = body.get(name, default)
    if value is None:
        return default
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise APIError(f"'{name}' must be {kind}, got {value!r}", param=name,
                       code="invalid_type")
    if not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number, got {value!r}", param=name,
                       code="invalid_value")
    if integer and hi is None:
        hi = INT32_MAX
    if (lo is not None and (value <= lo if lo_open else value < lo)) or \
            (hi is not None and value > hi):
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        raise APIError(f"'{name}' must be {' and '.join(s for s in (lo_s, hi_s) if s)}, "
                       f"got {value!r}", param=name, code="invalid_value")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be a boolean, got {value!r}", param=name,
                       code="invalid_type")
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of non-empty strings",
                       param="stop", code="invalid_value")
    if len(stop) > 16:
        raise APIError("'stop' takes at most 16 strings", param="stop", code="invalid_value")
    return stop


def _token_list(value, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(f"'{name}' must be a list of token ids", param=name, code="invalid_type")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'{name}' holds token ids outside [0, {vocab_size}): {bad[:5]}",
                       param=name, code="invalid_value")
    return list(value)


def _unsupported(body: dict) -> None:
    refuse_unsupported(body)
    if body.get("suffix"):
        raise APIError("'suffix' is not supported by this server", param="suffix",
                       code="unsupported_parameter")


# ------------------------------------------------------------------------------- prompts
def _completion_prompts(body: dict, ctx: ProtocolContext) -> list[dict]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise APIError("'prompt' must be a string, a list of strings, a list of token ids or a "
                       "list of lists of token ids, and not empty", param="prompt",
                       code="invalid_type")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = ctx.tokenizer.encode(item)
            text = item
        elif isinstance(item, list):
            ids = _token_list(item, "prompt", ctx.vocab_size)
            text = None
        else:
            raise APIError("each prompt must be a string or a list of token ids", param="prompt",
                           code="invalid_type")
        if not ids:
            raise APIError("the prompt is empty", param="prompt", code="invalid_value")
        prompts.append({"prompt_token_ids": ids, "prompt": text})
    return prompts


def _message_text(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise APIError(f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def _chat_prompt(body: dict, ctx: ProtocolContext, tools: list[dict] | None) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages",
                       code="invalid_value" if "messages" in body else "missing_required_parameter")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise APIError(f"messages[{i}] must be an object with a role in {list(CHAT_ROLES)}",
                           param=f"messages[{i}].role", code="invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": _message_text(m, i)}
        # Tool calls and results pass through to templates that render them.
        message.update((k, m[k]) for k in ("tool_calls", "tool_call_id", "name") if k in m)
        conversation.append(message)
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    extra = {"tools": [{"type": "function", "function": fn} for fn in tools]} if tools else {}
    try:
        text = ctx.tokenizer.apply_chat_template(conversation,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **extra)
    except ValueError as e:  # ChatTemplateError
        raise APIError(str(e), param="messages", code="invalid_value") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    return {"prompt_token_ids": ids, "prompt": text}


# ------------------------------------------------------------------------------- parse
def parse_request(kind: str, body: Any, ctx: ProtocolContext) -> ParsedRequest:
    """Validate one /v1/completions ("completion") or /v1/chat/completions ("chat") body. Any
    problem is an APIError (400 unless it says otherwise), never another exception."""
    try:
        return _parse(kind, body, ctx)
    except StructuredRequestError as e:
        raise APIError(str(e), param=e.param, code=e.code) from None
    except (ValueError, TypeError) as e:  # text that is not Unicode, a value SamplingParams refuses
        raise APIError(str(e), param=getattr(e, "param", None), code="invalid_value") from None


def _parse(kind: str, body: Any, ctx: ProtocolContext) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is None:
        model = ctx.model_names[0]
    if model not in ctx.model_names:
        raise APIError(f"The model `{model}` does not exist. Served: {list(ctx.model_names)}",
                       status=404, param="model", code="model_not_found")
    _unsupported(body)
    spec, tool_call, tools = structured_spec(body, kind)
    prompts = (_completion_prompts(body, ctx) if kind == "completion"
               else [_chat_prompt(body, ctx, tools)])

    echo = kind == "completion" and _bool(body, "echo", False)
    if kind == "completion":
        lp = _number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        num_logprobs = lp
    else:
        want = _bool(body, "logprobs", False)
        top = _number(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        if top is not None and not want:
            raise APIError("'top_logprobs' requires 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        num_logprobs = (top or 0) if want else None

    name = "max_tokens"
    max_tokens = _number(body, "max_tokens", None, lo=0, integer=True)
    if kind == "chat" and max_tokens is None:
        max_tokens = _number(body, "max_completion_tokens", None, lo=0, integer=True)
        name = "max_completion_tokens" if max_tokens is not None else name
    if max_tokens is None and kind == "completion":
        max_tokens = 16  # OpenAI's default for completions; chat defaults to the context left
    if max_tokens == 0 and not echo:
        raise APIError(f"'{name}' must be >= 1 (0 is allowed only with echo=true)", param=name,
                       code="invalid_value")
    if max_tokens is not None and ctx.max_tokens_limit is not None \
            and max_tokens > ctx.max_tokens_limit:
        raise APIError(f"'{name}' is {max_tokens} but this server allows at most "
                       f"{ctx.max_tokens_limit}", param=name, code="invalid_value")
    hide_generated = max_tokens == 0
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    left = ctx.max_model_len - longest
    to_context = max_tokens is None and (ctx.max_tokens_limit is None
                                         or left <= ctx.max_tokens_limit)
    if max_tokens is None:
        max_tokens = left if ctx.max_tokens_limit is None else min(left, ctx.max_tokens_limit)
    engine_max = max(max_tokens, 1)
    if longest + engine_max > ctx.max_model_len:
        raise APIError(f"This model's maximum context length is {ctx.max_model_len} tokens. "
                       f"However, you requested {longest + max_tokens} tokens ({longest} in the "
                       f"prompt, {max_tokens} for the completion). Please reduce the prompt or "
                       f"max_tokens.", param="messages" if kind == "chat" else "prompt",
                       code="context_length_exceeded")

    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else _token_list(
        stop_token_ids, "stop_token_ids", ctx.vocab_size)
    n = _number(body, "n", 1, lo=1, hi=128, integer=True)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError("'best_of' other than n is not supported", param="best_of",
                       code="unsupported_parameter")
    top_k = _number(body, "top_k", 0, lo=-1, integer=True)
    seed = _number(body, "seed", None, lo=-2**63, hi=2**64 - 1, integer=True)
    if seed is not None:
        seed %= 2**31 - 1
    params = SamplingParams(
        n=n, temperature=float(_number(body, "temperature", 1.0, lo=0, hi=2)),
        top_p=float(_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
        top_k=top_k, min_p=float(_number(body, "min_p", 0.0, lo=0, hi=1)), seed=seed,
        # Up to the context: None, which the engine bounds itself (a KV pool shorter than the
        # context ends it with "length"); an explicit max_tokens the pool cannot hold is refused.
        max_tokens=None if to_context else engine_max, stop=_stops(body),
        stop_token_ids=stop_token_ids, ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=num_logprobs if (num_logprobs is not None and not hide_generated) else None,
        prompt_logprobs=num_logprobs if (echo and num_logprobs is not None) else None,
        structured_outputs=spec, **logit_controls(body))
    bad = [t for t in params.logit_bias or () if t >= ctx.vocab_size]
    if bad:
        raise APIError(f"'logit_bias' holds token ids outside [0, {ctx.vocab_size}): {bad[:5]}",
                       param="logit_bias", code="invalid_value")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options",
                       code="invalid_type")
    include_usage = bool(options and _bool(options, "include_usage", False))
    if include_usage and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true",
                       param="stream_options", code="invalid_value")
    return ParsedRequest(kind=kind, model=model, prompts=prompts, params=params, stream=stream,
                         include_usage=include_usage, echo=echo, hide_generated=hide_generated,
                         num_logprobs=num_logprobs, tool_call=tool_call)
