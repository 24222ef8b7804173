"""tool_choice "auto": the output is free text until the model opens a call in its parser's
format, then the call is constrained to the offered tools (a name among them, arguments valid
against that tool's JSON schema, the closing markup), then free again. One llguidance Lark
grammar per request, built on llguidance's own machinery: a trigger that is an added token,
special or not (llguidance matches every added token only by its id), is named as one (`<[id]>`:
free text, a plain regex over bytes, cannot hold it, so the token alone opens a call); a
trigger that is text closes a lazy lexeme (`trig[lazy]: TEXT "<tool_call>"`: it ends at the
trigger's first occurrence, and what follows is the call); each tool's arguments are its schema
inlined (`%json`, its own root, so its `$defs` and `#` refs resolve), objects that declare
properties closed to them unless the schema says otherwise (OpenAI's strict mode). With a
reasoning parser the grammar first allows a free `<think>...</think>`, as that parser reads it
(tool calls inside are thoughts). A forced call (tool_choice "required" or named) is the same
call rules alone (`forced_call_grammar`); a response format after reasoning is the reasoning
rules before the format's own grammar (`after_reasoning`).

Formats: hermes (`<tool_call>` call `</tool_call>`, anywhere in the text), mistral
(`[TOOL_CALLS]` and a JSON list of calls, or `name[ARGS]{...}` when the template shows `[ARGS]`),
llama3_json (the whole answer is calls when it opens with `{` or `<|python_tag|>`; text may not
open so), pythonic (likewise with `[` or `<|python_start|>`: a list of calls whose keyword
arguments are Python literals, pythonic_grammar.py, which says where it is looser than the
schemas).

Special tokens the grammar names (triggers, closing tags, think tags) are kept in the output's
text (`StructuredOutputsParams.special_text_ids`), as added tokens that are not special always
are, so the parsers see them; they never reach a message's content, since the parsers take them
out. Host-only.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.server.pythonic_grammar import pythonic_calls
from jaxserve.server.reasoning import CLOSE as THINK_CLOSE
from jaxserve.server.reasoning import OPEN as THINK_OPEN
from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.tool_parsers import ToolParser
from jaxserve.server.tool_parsers.pythonic import END as PY_END
from jaxserve.server.tool_parsers.pythonic import START as PY_START

# The arguments as the templates write them (json.dumps' separators, no other whitespace), so
# a constrained call looks like the calls the model saw in its prompt. Lenient: a keyword
# llguidance cannot enforce (an unknown format, if/then) is left unenforced rather than making
# every request offering that tool a 400 (a pattern it cannot compile still is one).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": True}
_TEXT = r"/(.|\n)*/"


@dataclasses.dataclass(frozen=True)
class ToolGrammar:
    lark: str
    special_text_ids: tuple[int, ...]  # special tokens the grammar names: kept in the text


class _Markup:
    """Literal markup in Lark: an added token as `<[id]>`, any other text as a string. Every
    added token counts, special or not (Qwen's and Hermes' `<tool_call>` and `<think>` are
    not): llguidance's tokenizer takes them all as special, so text can never spell one and a
    grammar that writes its text as a string would mask the model's own token."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.tokens = {tok.content: int(i) for i, tok in added.items()}
        self.special = {int(i) for i, tok in added.items() if tok.special}
        self.used: set[int] = set()

    @property
    def kept(self) -> tuple[int, ...]:
        """The special tokens the grammar names, which the output's text must keep (a decode
        skips them; the others are in it already)."""
        return tuple(sorted(self.used & self.special))

    def is_token(self, text: str) -> bool:
        return text in self.tokens

    def __call__(self, text: str) -> str:
        if text in self.tokens:
            self.used.add(self.tokens[text])
            return f"<[{self.tokens[text]}]>"
        return json.dumps(text)


# Schema keywords whose value is a schema (or a list of them), or names schemas.
_SUBSCHEMA = ("additionalProperties", "items", "prefixItems", "contains", "not", "if", "then",
              "else", "propertyNames", "unevaluatedItems", "additionalItems", "anyOf", "oneOf",
              "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object with one of these says itself what else it holds (or shares its keys with another
# schema, which closing it would refuse): left as it is.
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "$ref", "allOf")


def _closed(schema, close: bool = True):
    """The schema with every object that lists `properties` closed to them
    (`additionalProperties: false`), as OpenAI's strict mode requires, so a call ends once its
    keys are written; an allOf's branches stay open (each would refuse the others' keys)."""
    if isinstance(schema, list):
        return [_closed(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _closed(out[key], key != "allOf")
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def _arguments_schema(parameters: dict | None) -> str:
    schema = _closed(parameters) if parameters else {}
    schema.setdefault("type", "object")  # OpenAI's arguments are always an object
    schema["x-guidance"] = {**schema.get("x-guidance", {}), **_JSON_STYLE}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _call_rules(tools: list[dict], arguments_key: str) -> str:
    """`call`: one JSON object {"name": <a tool's name>, "<arguments_key>": <its arguments>},
    one alternative per tool (each schema its own root, so its $refs resolve)."""
    rules = []
    for i, fn in enumerate(tools):
        head = json.dumps({"name": fn["name"], arguments_key: 0}, ensure_ascii=False)[:-2]
        rules.append(f"fn_{i}: {json.dumps(head)} {_arguments_schema(fn.get('parameters'))} "
                     '"}"')
    return "\n".join(rules) + "\ncall: " + " | ".join(f"fn_{i}" for i in range(len(tools)))


def _opened(name: str, trigger: str, markup: _Markup) -> str:
    """Rules `name_first` and `name`: free text, then the trigger (after which the call is
    constrained); the first text is FIRST_TEXT (it may not open a think block)."""
    if markup.is_token(trigger):  # free text cannot hold an added token: no laziness needed
        return (f"{name}_first: FIRST_TEXT {markup(trigger)}\n"
                f"{name}: TEXT {markup(trigger)}")
    return (f"{name}_first[lazy]: FIRST_TEXT {json.dumps(trigger)}\n"
            f"{name}[lazy]: TEXT {json.dumps(trigger)}")


def _triggered_answer(block: str, trigger: str, markup: _Markup, parallel: bool) -> str:
    """An answer of free text and blocks that each open at `trigger` (hermes, mistral): several
    blocks and text around them, or (parallel_tool_calls false) one block that ends the
    output."""
    rules = [_opened("open", trigger, markup), f"block: {block}"]
    if parallel:
        rules.append("answer: open_first block (open block)* TEXT | FIRST_TEXT")
    else:
        rules.append("answer: open_first block | FIRST_TEXT")
    return "\n".join(rules)


def _hermes(tools, markup, parallel, template) -> str:
    close = markup("</tool_call>")
    return _call_rules(tools, "arguments") + "\n" + _triggered_answer(
        f"SPACE call SPACE {close}", "<tool_call>", markup, parallel)


def _mistral(tools, markup, parallel, template) -> str:
    if "[ARGS]" in (template or ""):  # v11: [TOOL_CALLS]name[ARGS]{...}, one trigger per call
        args = markup("[ARGS]")
        rules = [f"fn_{i}: {json.dumps(fn['name'])} {args} "
                 f"{_arguments_schema(fn.get('parameters'))}" for i, fn in enumerate(tools)]
        rules.append("call: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
        block = "call"
    else:
        rules = [_call_rules(tools, "arguments")]
        block = '"[" call (", " call)* "]"' if parallel else '"[" call "]"'
    return "\n".join(rules) + "\n" + _triggered_answer(block, "[TOOL_CALLS]", markup, parallel)


def _llama3_json(tools, markup, parallel, template) -> str:
    """The answer is calls when it opens with `{` or the python tag; text may open with
    neither (the parser would read it as a call)."""
    tag = "<|python_tag|>"
    opens = r"\{" if markup.is_token(tag) else r"\{|" + _escape(tag)
    calls = 'call (";" " " call)*' if parallel else "call"
    return "\n".join([
        _call_rules(tools, "parameters"),
        f"answer: ({_tag_opening(tag, markup)} SPACE | SPACE) {calls} SPACE | PLAIN",
        f"PLAIN: FIRST_TEXT & ~/\\s*({opens})(.|\\n)*/"])


def _pythonic(tools, markup, parallel, template) -> str:
    """The answer is a call list when it opens with `[` or the python start tag; text may
    open with neither (as llama3_json)."""
    rules, calls = pythonic_calls(tools, parallel)
    opens = r"\[" if markup.is_token(PY_START) else r"\[|" + _escape(PY_START)
    plain = f"PLAIN: FIRST_TEXT & ~/\\s*({opens})(.|\\n)*/"
    if calls is None:  # no tool can be called pythonically: text only
        return "\n".join([rules, "answer: PLAIN", plain])
    return "\n".join([rules, f"answer: ({_tag_opening(PY_START, markup)} SPACE | SPACE) {calls} "
                              f"SPACE ({markup(PY_END)} SPACE)? | PLAIN", plain])


def _tag_opening(tag: str, markup: _Markup) -> str:
    """Whitespace and then `tag`: one lexeme when the tag is text (llguidance's lexer is
    greedy, so a whitespace lexeme before it would lose to the free text, which also holds the
    tag's first characters)."""
    if markup.is_token(tag):
        return f"SPACE {markup(tag)}"
    return f"/[ \\t\\r\\n]{{0,4}}{_escape(tag)}/"


_FORMATS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3_json,
            "pythonic": _pythonic}


def _reasoning_rules(reasoning: ReasoningParser | None, markup: _Markup
                     ) -> tuple[str, str | None, str | None]:
    """(`start` and its thinking rules, what the answer's first text and a thought that never
    closes may not hold besides the free text's exclusions: regexes or None). The think block
    is read as the reasoning parser reads it: qwen3 when the output opens with `<think>` (the
    answer may then not open so), deepseek_r1 up to the first `</think>` (an opening tag first
    is skipped), all of the output when the block never closes."""
    if reasoning is None:
        return "start: answer", None, None
    opened, closed = markup(THINK_OPEN), markup(THINK_CLOSE)
    # thoughts: text up to the first closing tag (an added token cannot be inside text)
    if markup.is_token(THINK_CLOSE):
        rules, thought, unclosed = [], f"THOUGHT {closed}", None
    else:
        rules = [f"thought[lazy]: /(.|\\n)*{_escape(THINK_CLOSE)}/"]
        thought, unclosed = "thought", f"(.|\\n)*{_escape(THINK_CLOSE)}(.|\\n)*"
    # The opening tag with the whitespace before it: one lexeme when it is text (llguidance's
    # lexer is greedy, so a separate whitespace lexeme would lose to the answer's text).
    if markup.is_token(THINK_OPEN):
        rules.append(f"think_open: SPACE {opened}")
    else:
        rules += ["think_open: THINK_OPEN", f"THINK_OPEN: /\\s*{_escape(THINK_OPEN)}/"]
    if reasoning.thinks_from_start:
        rules.append(f"start: think_open? ({thought} answer | UNCLOSED)")
        return "\n".join(rules), None, unclosed
    rules.append(f"start: think_open ({thought} answer | UNCLOSED) | answer")
    first = None if markup.is_token(THINK_OPEN) else f"\\s*{_escape(THINK_OPEN)}(.|\\n)*"
    return "\n".join(rules), first, unclosed


def _free_text(markup: _Markup, *excluded: str | None) -> str:
    """Free text: any, but not the text of an added token the grammar names (its parser could
    not tell it from the token, which the text keeps), nor what `excluded` matches."""
    names = [_escape(text) for text, i in markup.tokens.items() if i in markup.used]
    regexes = ([f"(.|\\n)*({'|'.join(names)})(.|\\n)*"] if names else []) + [
        e for e in excluded if e]
    return " & ".join([_TEXT] + [f"~/{r}/" for r in regexes])


def _escape(text: str) -> str:
    """Literal text inside a Lark regex."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/-" else c for c in text)


def forced_call_grammar(tools: list[dict]) -> str:
    """A forced call (tool_choice "required" or named): `{"name": ..., "arguments": ...}` of
    one of `tools` and nothing else, as the call rules write it (forced_call reads it back)."""
    return "\n".join(["%llguidance {}", "start: call", _call_rules(tools, "arguments")])


def after_reasoning(tokenizer, reasoning: ReasoningParser) -> ToolGrammar:
    """The thinking first, as the reasoning parser reads it, then `@answer`: a response
    format's own grammar (StructuredOutputsParams.wrapper), so the format constrains the answer
    and not the thoughts (vLLM applies it after the end of reasoning alike)."""
    markup = _Markup(tokenizer)
    start, _, unclosed = _reasoning_rules(reasoning, markup)
    lark = "\n".join([
        "%llguidance {}", start, "answer: SPACE @answer", f"THOUGHT: {_free_text(markup)}",
        f"UNCLOSED: {_free_text(markup, unclosed)}", r"SPACE: /[ \t\r\n]{0,4}/"])
    return ToolGrammar(lark, markup.kept)


def tool_grammar(parser: ToolParser, tools: list[dict], tokenizer,
                 reasoning: ReasoningParser | None, parallel: bool) -> ToolGrammar | None:
    """The grammar of an answer that may call `tools` (OpenAI function definitions) in the
    parser's format; None for a format that is not constrained."""
    build = _FORMATS.get(parser.name)
    if build is None or not tools:
        return None
    markup = _Markup(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    answer = build(tools, markup, parallel, template)
    start, first, unclosed = _reasoning_rules(reasoning, markup)
    lark = "\n".join([
        "%llguidance {}", start, answer, f"TEXT: {_free_text(markup)}",
        f"FIRST_TEXT: {_free_text(markup, first)}", f"THOUGHT: {_free_text(markup)}",
        f"UNCLOSED: {_free_text(markup, unclosed)}", r"SPACE: /[ \t\r\n]{0,4}/"])
    return ToolGrammar(lark, markup.kept)
