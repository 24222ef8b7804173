"""Cheap size limits on a request body, checked on the parsed JSON before anything validates,
renders, tokenizes or compiles it: how many prompts a completion holds, how many tools a chat
offers, their size as JSON, and the prompt's characters. Each refusal is a 400 naming the field and the flag that sets the limit.
(2000 tools, or 1.2 MB descriptions, or a 3.9 MB prompt cost seconds to render and tokenize
before the context check refused them.)"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.server.protocol import APIError

CHARS_PER_TOKEN = 32  # max_prompt_chars' default per token of context: far above any text's


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    max_prompts: int  # ServerConfig.max_prompts_per_request
    max_tools: int
    max_tools_bytes: int
    max_prompt_chars: int

    @classmethod
    def of(cls, max_prompts: int, max_tools: int, max_tools_bytes: int,
           max_prompt_chars: int | None, max_model_len: int) -> "BodyLimits":
        return cls(max_prompts, max_tools, max_tools_bytes,
                   max_prompt_chars or CHARS_PER_TOKEN * max_model_len)

    def check(self, body: Any) -> None:
        """APIError (400) when a limit is passed; bodies of the wrong shape pass, for the
        request models to name what is wrong."""
        if not isinstance(body, dict):
            return
        prompt = body.get("prompt")
        count = len(prompt) if isinstance(prompt, list) and prompt \
            and not isinstance(prompt[0], int) else 1  # a list of ints is one prompt
        if count > self.max_prompts:
            raise APIError(f"'prompt' holds {count} prompts; at most max_prompts_per_request="
                           f"{self.max_prompts} are accepted in one request",
                           param="prompt", code="too_many_prompts")
        tools = body.get("tools")
        if isinstance(tools, list):
            if len(tools) > self.max_tools:
                raise _refused("tools", f"offers {len(tools)} tools", self.max_tools,
                               "max_tools")
            size = len(json.dumps(tools, allow_nan=True))
            if size > self.max_tools_bytes:
                raise _refused("tools", f"are {size} bytes of JSON", self.max_tools_bytes,
                               "max_tools_bytes")
        field, chars = _prompt_chars(body)
        if chars > self.max_prompt_chars:
            raise _refused(field, f"holds {chars} characters", self.max_prompt_chars,
                           "max_prompt_chars")


def _prompt_chars(body: dict) -> tuple[str, int]:
    """(the field, its characters): a completion's longest prompt text, or a chat's message
    contents together (text parts included)."""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        return "messages", sum(_text_chars(m.get("content")) for m in messages
                               if isinstance(m, dict))
    prompt = body.get("prompt")
    texts = prompt if isinstance(prompt, list) else [prompt]
    return "prompt", max((len(t) for t in texts if isinstance(t, str)), default=0)


def _text_chars(content: Any) -> int:
    parts = content if isinstance(content, list) else [content]
    texts = (p.get("text") if isinstance(p, dict) else p for p in parts)
    return sum(len(t) for t in texts if isinstance(t, str))


def _refused(field: str, what: str, limit: int, flag: str) -> APIError:
    return APIError(f"'{field}' {what}; this server accepts at most {limit} (--{flag})",
                    param=field, code="invalid_value")
