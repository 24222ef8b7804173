"""The pydantic base of what the front ends read from JSON (the server's bodies, batch lines) or
take as its Python equivalent (LLM.chat): `JsonObject` (strict JSON types, no coercion, NaN and
Infinity refused, null meaning the default, unknown fields kept), `one_error` for fields of
several shapes, and `first_error`, which turns a ValidationError into one `FieldError` naming the
field as OpenAI's errors do (`param`: "messages[0].role"). Host-only.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator

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


class JsonObject(BaseModel):
    """A JSON object: null stands for a field's default, as OpenAI's nullable fields do."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, value):
        return ({k: v for k, v in value.items() if v is not None} if isinstance(value, dict)
                else value)


NonEmpty = Annotated[str, Field(min_length=1)]


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
