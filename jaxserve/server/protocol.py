"""OpenAI request/response translation, shared by the HTTP server and batch files.

`parse_request(kind, body, ctx)` validates a JSON body of /v1/completions ("completion") or
/v1/chat/completions ("chat") and turns it into engine prompts plus one SamplingParams; every
problem raises `APIError` carrying OpenAI's error shape. `build_response` turns the finished
RequestOutputs into the response body; `StreamEncoder` turns progressing RequestOutputs into
server-sent-event chunks. Unknown fields are ignored, as OpenAI does. Host-only, no engine calls.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

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


# ------------------------------------------------------------------------------- field readers
def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise APIError(f"'{name}' must be {kind}, got {value!r}", param=name,
                       code="invalid_type")
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
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(f"'{name}' is not supported by this server (only 0)", param=name,
                           code="unsupported_parameter")
    if body.get("logit_bias"):
        raise APIError("'logit_bias' is not supported by this server", param="logit_bias",
                       code="unsupported_parameter")
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


def _chat_prompt(body: dict, ctx: ProtocolContext) -> dict:
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
        conversation.append({"role": role, "content": _message_text(m, i)})
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    try:
        text = ctx.tokenizer.apply_chat_template(conversation,
                                                 add_generation_prompt=add_generation_prompt)
    except ValueError as e:  # ChatTemplateError
        raise APIError(str(e), param="messages", code="invalid_value") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    return {"prompt_token_ids": ids, "prompt": text}


# ------------------------------------------------------------------------------- parse
def parse_request(kind: str, body: Any, ctx: ProtocolContext) -> ParsedRequest:
    """Validate one /v1/completions ("completion") or /v1/chat/completions ("chat") body."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is None:
        model = ctx.model_names[0]
    if model not in ctx.model_names:
        raise APIError(f"The model `{model}` does not exist. Served: {list(ctx.model_names)}",
                       status=404, param="model", code="model_not_found")
    _unsupported(body)
    prompts = _completion_prompts(body, ctx) if kind == "completion" else [_chat_prompt(body, ctx)]

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
    seed = _number(body, "seed", None, integer=True)
    if seed is not None:
        seed %= 2**31 - 1
    params = SamplingParams(
        n=n, temperature=float(_number(body, "temperature", 1.0, lo=0, hi=2)),
        top_p=float(_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
        top_k=top_k, min_p=float(_number(body, "min_p", 0.0, lo=0, hi=1)), seed=seed,
        max_tokens=engine_max, stop=_stops(body), stop_token_ids=stop_token_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=num_logprobs if (num_logprobs is not None and not hide_generated) else None,
        prompt_logprobs=num_logprobs if (echo and num_logprobs is not None) else None)
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
                         num_logprobs=num_logprobs)


# ------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


class _Tokens:
    """Token id -> its text, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok: _Tokens, token_ids: list[int], entries: list, k: int,
                        offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(token_ids, entries):
        s = tok(t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:  # the first prompt token has no logprob
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.get(t))
        top = {tok(i): lp for i, lp in _top(entry, k)}
        top.setdefault(s, entry.get(t))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tok: _Tokens, token_ids: list[int], entries: list, k: int) -> dict:
    def item(t, lp):
        s = tok(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, entry in zip(token_ids, entries):
        d = item(t, entry.get(t))
        d["top_logprobs"] = [item(i, lp) for i, lp in _top(entry, k)]
        content.append(d)
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason


class ResponseBuilder:
    """Builds response bodies (whole, or as stream chunks) for one parsed request."""

    def __init__(self, parsed: ParsedRequest, ctx: ProtocolContext, request_id: str | None = None):
        self.p = parsed
        self.id = request_id or new_id(parsed.kind)
        self.created = int(time.time())
        self.tok = _Tokens(ctx.tokenizer)
        n = parsed.params.n
        self._sent_text = [0] * (n * len(parsed.prompts))
        self._sent_tokens = [0] * (n * len(parsed.prompts))
        self._started = [False] * (n * len(parsed.prompts))
        self._finished = [False] * (n * len(parsed.prompts))
        self._usage = [(len(pr["prompt_token_ids"]), 0) for pr in parsed.prompts]

    # ---- pieces
    def _generated(self, c: CompletionOutput) -> tuple[str, list[int], list]:
        if self.p.hide_generated:
            return "", [], []
        return c.text, c.token_ids, c.logprobs or []

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tok.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _completion_tokens(self, out: RequestOutput) -> int:
        return 0 if self.p.hide_generated else sum(len(c.token_ids) for c in out.outputs)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.p.model}

    # ---- whole responses
    def response(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed body from the final RequestOutput of each prompt (in prompt order)."""
        choices, completion_tokens = [], 0
        n = self.p.params.n
        for pi, out in enumerate(outputs):
            completion_tokens += self._completion_tokens(out)
            for c in out.outputs:
                text, ids, lps = self._generated(c)
                index = pi * n + c.index
                if self.p.kind == "completion":
                    logprobs = None
                    if self.p.echo:
                        prompt_text = self._prompt_text(out)
                        if self.p.num_logprobs is not None:
                            logprobs = completion_logprobs(
                                self.tok, out.prompt_token_ids, out.prompt_logprobs or [None],
                                self.p.num_logprobs)
                        text = prompt_text + text
                    if self.p.num_logprobs is not None and ids:
                        gen = completion_logprobs(
                            self.tok, ids, lps, self.p.num_logprobs,
                            offset=len(text) - len(c.text) if self.p.echo else 0)
                        logprobs = gen if logprobs is None else {
                            key: logprobs[key] + gen[key] for key in gen}
                    if logprobs is None and self.p.num_logprobs is not None:
                        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
                    choices.append({"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": _finish_reason(c),
                                    "stop_reason": c.stop_reason})
                else:
                    logprobs = (chat_logprobs(self.tok, ids, lps, self.p.num_logprobs)
                                if self.p.num_logprobs is not None else None)
                    choices.append({"index": index,
                                    "message": {"role": "assistant", "content": text},
                                    "logprobs": logprobs, "finish_reason": _finish_reason(c),
                                    "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        obj = "text_completion" if self.p.kind == "completion" else "chat.completion"
        return {**self._head(obj), "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}

    # ---- streaming
    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Stream chunks for what is new in `out` since the last call for this prompt."""
        n = self.p.params.n
        result = []
        for c in out.outputs:
            i = prompt_index * n + c.index
            if self._finished[i]:
                continue
            text, ids, lps = self._generated(c)
            delta_text = text[self._sent_text[i]:]
            new_ids = ids[self._sent_tokens[i]:]
            new_lps = lps[self._sent_tokens[i]:len(ids)]
            first = not self._started[i]
            finish = _finish_reason(c)
            if not (delta_text or new_ids or first or finish):
                continue
            self._sent_text[i] = len(text)
            self._sent_tokens[i] = len(ids)
            self._started[i] = True
            self._finished[i] = finish is not None
            if self.p.kind == "completion":
                logprobs = None
                prefix = ""
                if first and self.p.echo:
                    prefix = self._prompt_text(out)
                if self.p.num_logprobs is not None:
                    logprobs = completion_logprobs(self.tok, new_ids, new_lps, self.p.num_logprobs)
                    if first and self.p.echo:
                        pl = completion_logprobs(self.tok, out.prompt_token_ids,
                                                 out.prompt_logprobs or [None],
                                                 self.p.num_logprobs)
                        logprobs = {k: pl[k] + logprobs[k] for k in pl}
                choice = {"index": i, "text": prefix + delta_text, "logprobs": logprobs,
                          "finish_reason": finish, "stop_reason": c.stop_reason}
                obj = "text_completion"
            else:
                delta = {"content": delta_text}
                if first:
                    delta = {"role": "assistant", "content": delta_text}
                logprobs = (chat_logprobs(self.tok, new_ids, new_lps, self.p.num_logprobs)
                            if self.p.num_logprobs is not None else None)
                choice = {"index": i, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish, "stop_reason": c.stop_reason}
                obj = "chat.completion.chunk"
            chunk = {**self._head(obj), "choices": [choice]}
            if self.p.include_usage:
                chunk["usage"] = None
            result.append(chunk)
        if out.finished:
            self._usage[prompt_index] = (len(out.prompt_token_ids), self._completion_tokens(out))
        return result

    def usage_chunk(self) -> dict:
        obj = "text_completion" if self.p.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [],
                "usage": _usage(sum(u[0] for u in self._usage), sum(u[1] for u in self._usage))}


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return APIError(message, type=type, param=param, code=code).body()
