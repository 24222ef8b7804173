"""OpenAI response bodies from RequestOutputs, shared by the HTTP server and batch files:
`ResponseBuilder` builds a whole response or server-sent-event chunks (with usage and logprobs)
for one parsed request. Host-only, no engine calls."""

from __future__ import annotations

import time
import uuid

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.server.chat_output import ChatOutputStream
from jaxserve.server.protocol import ParsedRequest, ProtocolContext
from jaxserve.server.structured_requests import forced_call


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
        self._streams = ([ChatOutputStream(parsed.output_parser) for _ in self._started]
                         if parsed.output_parser is not None else None)

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

    def _forced_message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A forced call's message fields and finish reason: the call, "tool_calls" once it is
        complete; cut short, the call as far as it was written (no call before its name is
        whole) with the engine's reason. Never content: the output is the call's JSON."""
        call, complete = forced_call(text)
        return ({"content": None, "tool_calls": [call]} if call else {"content": None},
                "tool_calls" if complete else finish)

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
                    message, finish = {"role": "assistant", "content": text}, _finish_reason(c)
                    if self.p.output_parser is not None:  # reasoning, text or calls
                        message = self.p.output_parser.message(text)
                        if "tool_calls" in message and finish == "stop":
                            finish = "tool_calls"
                    elif self.p.tool_call:
                        fields, finish = self._forced_message(text, finish)
                        message = {"role": "assistant", **fields}
                    choices.append({"index": index, "message": message,
                                    "logprobs": logprobs, "finish_reason": finish,
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
                if self._streams is not None:  # reasoning, text or calls, as parsed so far
                    stream = self._streams[i]
                    delta = stream.delta(text, finish is not None)
                    if stream.has_calls and finish == "stop":
                        finish = "tool_calls"
                    logprobs_due = bool(new_ids) and self.p.num_logprobs is not None
                    if not (delta or first or finish or logprobs_due):
                        continue
                    if first:
                        delta = {"role": "assistant", "content": "", **delta}
                elif self.p.tool_call:  # the call goes out whole when the output ends
                    delta = {}
                    if finish is not None:
                        fields, finish = self._forced_message(text, finish)
                        if "tool_calls" in fields:
                            delta = {"tool_calls": [{"index": 0, **fields["tool_calls"][0]}]}
                    elif not first:
                        continue
                if first:
                    delta = {"role": "assistant", **delta}
                    delta.setdefault("content", None if self.p.tool_call else delta_text)
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
