"""JSON in and out of the API, strict both ways: request bodies are parsed with a nesting limit
(a deeply nested body is a 400, never a RecursionError), and every response body, whole or an
event of a stream, is standard JSON (NaN and Infinity cannot leave: encoding one raises). Shared
by the HTTP server and batch files."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from jaxserve.server.protocol import APIError

MAX_DEPTH = 64  # OpenAI bodies nest a JSON schema at most a few dozen levels deep


def parse_body(data: bytes | str) -> Any:
    """The JSON value of a request body; APIError (400 invalid_json) if it is not JSON, not
    Unicode, uses NaN or Infinity literals (refused again by the field readers, with the field's
    name), or nests deeper than MAX_DEPTH arrays and objects."""
    too_deep = APIError(f"the request body nests arrays and objects more than {MAX_DEPTH} "
                        "levels deep", code="invalid_json")
    try:
        value = json.loads(data)
    except RecursionError:  # the C parser's own bound, far deeper than ours
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if _deeper_than(value, MAX_DEPTH):
        raise too_deep
    return value


def parse_object(data: bytes | str, empty: dict | None = None) -> dict:
    """parse_body's value, which must be a JSON object (APIError 400 invalid_type otherwise); an
    empty body is `empty` where one is allowed (None: it is not JSON, a 400)."""
    if empty is not None and not data.strip():
        return empty
    body = parse_body(data)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def dumps(value: Any) -> str:
    """Standard JSON, ASCII (a lone surrogate echoed in an error message cannot break the
    encoding): ValueError on NaN or an infinity rather than a body no client can parse."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    """FastAPI's JSON response, rendered by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")
