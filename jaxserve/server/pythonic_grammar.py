r"""Pythonic tool calls as an llguidance Lark grammar: `[get_weather(city="Paris", days=3), ...]`,
each call a declared tool's name with keyword arguments whose values are Python literals that
satisfy the tool's JSON schema. tool_grammar.py opens it where the pythonic parser
(tool_parsers/pythonic.py) reads a call list; everything it allows, that parser reads back.

What a value's grammar enforces, by schema keyword:
- `type` string: a quoted literal ("..." or '...', escapes \\ \" \' \n \r \t only, no raw
  control characters) of minLength..maxLength characters; integer / number: a JSON-style
  number (also a Python literal), through llguidance's `%json` when it has bounds (minimum,
  maximum, exclusive ones, multipleOf); boolean: True / False; null: None; array: a list of
  `items` with minItems..maxItems; object: a dict of the declared `properties` in their order,
  the `required` ones present (no other keys, stricter than additionalProperties' default).
  A list of types is any of them.
- `enum` / `const`: exactly those values, strings spelled either way (json.dumps or repr).
- `anyOf` / `oneOf`: any of the alternatives; `$ref` within the tool's own schema.
- The top level: keyword arguments `name=value` in the declared order, the required ones present.

Where the grammar is looser than the schema (outputs can then be invalid): a string's `pattern`
and `format`; `oneOf`'s exclusivity and a sibling keyword beside anyOf / oneOf; `allOf` (its
parts merged shallowly); `not`, `if`/`then`, `prefixItems`, `uniqueItems`, `contains`;
`patternProperties`, `propertyNames`, `min/maxProperties`, `dependent*`; an object without
`properties` (any dict of literals); `false` schemas; a bounded `number` (llguidance's JSON
number) may write an exponent past a float's range, which the parser cannot read (text then).
Stricter than the schema or Python (still valid): one spelling of whitespace (", " between
items, "=" with no spaces), a value without a type is a literal nested at most two deep,
integers of at most 19 digits, floats of at most 16 integer digits and a two-digit exponent.

A property that is not a Python identifier (or is a keyword) cannot be a keyword argument: an
optional one is left out, and a tool that requires one, or whose name the parser cannot read,
is left out of the grammar; a tool without properties is called with none. Host-only.
"""

from __future__ import annotations

import json
import keyword

from jaxserve.server.tool_parsers.pythonic import NAME as _CALLABLE_NAME

_CHAR = {'"': r'[^"\\\x00-\x1f]', "'": r"[^'\\\x00-\x1f]"}
_ESCAPE = r"""\\[\\"'nrt]"""
_INT = r"-?(0|[1-9][0-9]{0,18})"
_FLOAT = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]+)?([eE][+-]?[0-9]{1,2})?"
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _any_rules() -> str:
    """`py_any`: any literal, nested at most two deep (bounded, so a `[` that logit_bias
    favours cannot nest forever)."""
    strings = " | ".join(f"/{q}({_CHAR[q]}|{_ESCAPE})*{q}/" for q in ('"', "'"))
    lines = [f"py_str: {strings}",
             f'py_scalar: py_str | /{_FLOAT}/ | "True" | "False" | "None"', "py_any0: py_scalar"]
    for depth, inner in ((1, "py_any0"), (2, "py_any1")):
        name = "py_any" if depth == 2 else "py_any1"
        entry = f'py_str ": " {inner}'
        lines.append(f'{name}: py_scalar | "[" ({inner} (", " {inner})*)? "]" | '
                     f'"{{" ({entry} (", " {entry})*)? "}}"')
    return "\n".join(lines)


def literal(value) -> list[str]:
    """The Python spellings of a JSON value (a string both ways)."""
    if isinstance(value, str):
        return list(dict.fromkeys([json.dumps(value, ensure_ascii=False), repr(value)]))
    if value is None or isinstance(value, bool):
        return [repr(value)]
    if isinstance(value, (int, float)):
        return [repr(value)]
    if isinstance(value, list):
        return ["[" + ", ".join(literal(v)[0] for v in value) + "]"]
    if isinstance(value, dict):
        return ["{" + ", ".join(f"{literal(k)[0]}: {literal(v)[0]}" for k, v in value.items())
                + "}"]
    raise ValueError(f"no Python literal for {value!r}")


def is_keyword_argument(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and name != "__debug__"


class _Rules:
    """Lark rules for one tool's values, named `<prefix>_<n>`."""

    def __init__(self, prefix: str, root: dict):
        self.prefix, self.root = prefix, root
        self.lines: list[str] = []
        self.refs: dict[str, str] = {}

    def rule(self, body: str | None = None) -> str:
        name = f"{self.prefix}_{len(self.lines)}"
        self.lines.append(f"{name}: {body}" if body is not None else "")
        return name

    def value(self, schema) -> str:
        """A Lark expression for the Python literals that satisfy `schema`."""
        if not isinstance(schema, dict) or not schema:
            return "py_any"
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self._alternatives(literal(schema["const"]))
        if "enum" in schema:
            return self._alternatives([s for v in schema["enum"] for s in literal(v)])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value(s) for s in schema[key]) + ")"
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged.update(part if isinstance(part, dict) else {})
            return self.value(merged)
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        return self._typed(kind, schema)

    def _typed(self, kind, schema: dict) -> str:
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            count = f"{{{low},{'' if high is None else high}}}"
            return "(" + " | ".join(
                f"/{q}({_CHAR[q]}|{_ESCAPE}){count}{q}/" for q in ('"', "'")) + ")"
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in _NUMBER_BOUNDS if k in schema}
            if bounds:
                return "%json " + json.dumps({"type": kind, **bounds})
            return f"/{_INT if kind == 'integer' else _FLOAT}/"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.rule(self.value(schema.get("items")))
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if high is not None and high < 1:
                return '"[" "]"'
            low_more, high_more = max(low - 1, 0), None if high is None else high - 1
            more = ("" if high_more == 0 else  # Lark refuses a {0,0} repetition
                    f' (", " {item}){{{low_more},{"" if high_more is None else high_more}}}')
            return f'"[" {item}{more} "]"' if low >= 1 else f'"[" ({item}{more})? "]"'
        if kind == "object":
            props, required = _declared(schema)
            if not props:
                return "py_any"
            return '"{" ' + self.fields(props, required, dict_keys=True) + ' "}"'
        return "py_any"

    def fields(self, props: dict, required: list, dict_keys: bool) -> str:
        """The properties in declared order, each required one present, ", " between them: as
        dict entries (`"key": value`) or keyword arguments (`key=value`). Rules from the last
        property back: after_i (something came before: a separator first) and from_i (nothing
        did), so the grammar stays linear in the number of properties."""
        items = []
        for key, schema in props.items():
            name = json.dumps(json.dumps(key, ensure_ascii=False) + ": ") if dict_keys \
                else json.dumps(f"{key}=")
            items.append((f"{name} {self.value(schema)}", key in required))
        after = from_ = ""
        for item, needed in reversed(items):
            rest_after = f" {after}" if after else ""
            if needed:
                after_body, from_body = f'", " {item}{rest_after}', f"{item}{rest_after}"
            else:
                after_body = f'(", " {item})?{rest_after}'
                from_body = f"{item}{rest_after}" + (f" | {from_}" if from_ else "")
                from_body = from_body if from_ else f"({from_body})?"
            after, from_ = self.rule(after_body), self.rule(from_body)
        return from_

    def _ref(self, ref: str) -> str:
        if ref not in self.refs:
            target = self.root
            for part in ref.lstrip("#").split("/")[1:] if ref.startswith("#") else [None]:
                part = part and part.replace("~1", "/").replace("~0", "~")
                if part is None or not isinstance(target, dict) or part not in target:
                    return "py_any"  # a remote or unresolvable ref: unconstrained
                target = target[part]
            name = self.refs[ref] = self.rule()  # named first: a recursive ref finds it
            self.lines[int(name.rsplit("_", 1)[1])] = f"{name}: {self.value(target)}"
        return self.refs[ref]

    @staticmethod
    def _alternatives(spellings: list[str]) -> str:
        return "(" + " | ".join(json.dumps(s) for s in spellings) + ")"


def _declared(schema: dict) -> tuple[dict, list]:
    """(properties, required): a required key without a property is one of any value."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    required = [k for k in required if isinstance(k, str)]
    return {**props, **{k: {} for k in required if k not in props}}, required


def _arguments(rules: _Rules, parameters: dict) -> str | None:
    """The keyword arguments of one call; None when the tool cannot be called pythonically."""
    props, required = _declared(parameters)
    if not props:
        return ""
    if any(not is_keyword_argument(k) for k in required):
        return None
    usable = {k: v for k, v in props.items() if is_keyword_argument(k)}
    if not usable:
        return ""
    return rules.fields(usable, required, dict_keys=False)


def pythonic_calls(tools: list[dict], parallel: bool) -> tuple[str, str | None]:
    """(Lark rules, the expression of a call list or None when no tool is callable)."""
    lines, calls = [_any_rules()], []
    for i, fn in enumerate(tools):
        if not _CALLABLE_NAME.fullmatch(fn["name"]):
            continue
        rules = _Rules(f"py{i}", fn.get("parameters") or {})
        args = _arguments(rules, fn.get("parameters") or {})
        if args is None:
            continue
        lines += [line for line in rules.lines if line]
        lines.append(f"pyfn_{i}: {json.dumps(fn['name'] + '(')} {args} \")\"")
        calls.append(f"pyfn_{i}")
    if not calls:
        return "\n".join(lines), None
    lines.append("pycall: " + " | ".join(calls))
    return "\n".join(lines), ('"[" pycall (", " pycall)* "]"' if parallel else '"[" pycall "]"')
