"""tool_choice "auto"'s grammar (server/tool_grammar.py) on its own, through llguidance's
matcher over a byte-level tokenizer: free text and calls in each format are accepted, a call
whose name or arguments break the tools' schemas is refused at its first wrong byte, whether
the trigger is a special token or text; a reasoning parser's think block comes first; special
markup the grammar names stays in the detokenized text; the request picks the grammar."""

from __future__ import annotations

import json

import llguidance
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jaxserve.server.protocol import ProtocolContext, parse_request
from jaxserve.server.reasoning import reasoning_parser
from jaxserve.server.tool_grammar import tool_grammar
from jaxserve.server.tool_parsers import PARSERS
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
    "$defs": {"unused": {"type": "string"}}}}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n' \
         "</tool_call>"
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]",
          "<|python_tag|>", "<|python_start|>", "<|python_end|>")


def byte_tokenizer(special: tuple[str, ...] = (), template: str | None = None,
                   added: bool = False) -> Tokenizer:
    """One token per byte, then `special` as special tokens, or (`added`) as added tokens that
    are not special, as Qwen's and Hermes' `<tool_call>` and `<think>` are."""
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
        merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.add_tokens([AddedToken(t, special=not added, normalized=False) for t in special])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[256], chat_template=template)


def accepts(parser: str, text: str | list[str], *, special: bool | str,
            reasoning: str | None = None, parallel: bool = True, template: str | None = None,
            tools: tuple[dict, ...] = ()) -> str:
    """What `matches` says of the grammar of `tools` (WEATHER and TIME by default) in the
    parser's format; markup is text (special False), special tokens (True) or added tokens
    that are not special ("added")."""
    tok = byte_tokenizer(MARKUP if special else (), template, added=special == "added")
    grammar = tool_grammar(PARSERS[parser](), list(tools) or [WEATHER, TIME], tok,
                           reasoning_parser(reasoning), parallel)
    return matches(llguidance.LLMatcher.grammar_from_lark(grammar.lark), tok, text)


def matches(grammar: str, tok: Tokenizer, text: str | list[str]) -> str:
    """'accept' (the output may end here), 'open' (it may not: a call is open), 'stop' (it must
    end here) or the refused prefix's end, for llguidance's `grammar` (its JSON form). A list
    of texts is encoded piece by piece (markup split across pieces is spelled in bytes)."""
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=300, eos_token=[256])
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = [t for piece in ([text] if isinstance(text, str) else text)
           for t in tok.encode(piece, add_special_tokens=False)]
    for i, t in enumerate(ids):
        if not matcher.consume_token(t):
            return tok.decode(ids[:i + 1], skip_special_tokens=False)[-12:]
    return "stop" if matcher.is_stopped() else "accept" if matcher.is_accepting() else "open"


@pytest.mark.parametrize("special", [False, True, "added"],
                         ids=["text-markup", "special-markup", "added-markup"])
def test_hermes(special):
    assert accepts("hermes", "Just text, <tool no call.", special=special) == "accept"
    assert accepts("hermes", f"Let me see.\n{HERMES}\n{HERMES} done.", special=special) == "accept"
    assert accepts("hermes", f"x {HERMES}", special=special, parallel=False) == "stop"
    assert accepts("hermes", 'x <tool_call>\n{"name": "get_wind', special=special).endswith(
        '"get_wi')  # a name among the tools
    assert accepts("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "1',
                   special=special).endswith('"zone": "')  # the arguments' schema
    assert accepts("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": 1}} x',
                   special=special).endswith("}} x")  # the closing markup


@pytest.mark.parametrize("special", [False, True, "added"],
                         ids=["text-markup", "special-markup", "added-markup"])
def test_mistral_and_llama3_json(special):
    two = ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 2}}, {"name": "get_weather", '
           '"arguments": {"city": "Oslo", "unit": "f"}}] ok')
    assert accepts("mistral", "hi " + two, special=special) == "accept"
    assert accepts("mistral", "hi " + two, special=special, parallel=False).endswith("}},")
    v11 = '[TOOL_CALLS]get_time[ARGS]{"zone": 2}'
    assert accepts("mistral", v11, special=special, template="[ARGS]") == "accept"
    assert accepts("mistral", v11.replace("2", '"2"'), special=special,
                   template="[ARGS]").endswith('"zone": "')
    call = '{"name": "get_time", "parameters": {"zone": 2}}'
    assert accepts("llama3_json", f"<|python_tag|>{call}; {call}", special=special) == "accept"
    assert accepts("llama3_json", f" {call}", special=special, parallel=False) == "accept"
    assert accepts("llama3_json", f" <|python_tag|> {call}", special=special) == "accept"
    assert accepts("llama3_json", "It is {not} a call.", special=special) == "accept"
    assert accepts("llama3_json", '{"name": "x', special=special).endswith('"x')


@pytest.mark.parametrize("special", [False, True, "added"],
                         ids=["text-markup", "special-markup", "added-markup"])
def test_the_think_block_comes_first(special):
    thought = "<think>\nmaybe <tool call> later\n</think>\n\n"
    assert accepts("hermes", thought + HERMES, special=special, reasoning="qwen3") == "accept"
    assert accepts("hermes", "<think>\nstill thinking", special=special,
                   reasoning="qwen3") == "accept"
    assert accepts("hermes", thought + '<tool_call>{"name": "nope', special=special,
                   reasoning="qwen3").endswith('"n')
    assert accepts("hermes", "thinking</think>" + HERMES, special=special,
                   reasoning="deepseek_r1") == "accept"
    if not special:  # a text trigger inside the thoughts is a thought, not a call
        assert accepts("hermes", "<think><tool_call>{oops</think>" + HERMES, special=False,
                       reasoning="qwen3") == "accept"
        # the answer may not open a think block the reasoning parser would read
        assert accepts("hermes", " <think>", special=False, reasoning="qwen3") == "accept"


def test_special_markup_spelled_in_bytes_is_refused_in_free_text():
    """The parsers read text: a special token's text written byte by byte would read as the
    token, so free text may not hold it (nor thoughts their closing tag's)."""
    assert accepts("hermes", ["hi <tool_", "call>"], special=True).endswith("call>")
    assert accepts("hermes", ["hi <tool_", "call>"], special=False) == "open"  # a call opens
    assert accepts("hermes", ["<think>a </th", "ink>"], special=True,
                   reasoning="qwen3").endswith("ink>")
    assert accepts("llama3_json", ["<|python", "_tag|>"], special=True).endswith("tag|>")
    assert accepts("mistral", ["x [TOOL_", "CALLS]"], special=True).endswith("CALLS]")


def test_keywords_llguidance_cannot_enforce_do_not_refuse_the_tools():
    odd = {"name": "odd", "parameters": {"type": "object", "properties": {
        "when": {"type": "string", "format": "no-such-format", "maxLength": 3},
        "x": {"if": {"type": "string"}, "then": {"maxLength": 1}}}, "required": ["when"]}}
    tok = byte_tokenizer()
    grammar = tool_grammar(PARSERS["hermes"](), [odd], tok, None, True)
    assert llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(grammar.lark)) == ""


@pytest.mark.parametrize("special", [False, True, "added"],
                         ids=["text-markup", "special-markup", "added-markup"])
def test_pythonic(special):
    two = "[get_weather(city='Pa\\'ris', unit=\"c\"), get_time(zone=-3)]"
    assert accepts("pythonic", two, special=special) == "accept"
    assert accepts("pythonic", f" <|python_start|>{two} <|python_end|>", special=special) == \
        "accept"
    assert accepts("pythonic", "It is [not] a call.", special=special) == "accept"
    assert accepts("pythonic", two, special=special, parallel=False).endswith("c\"),")
    assert accepts("pythonic", "[1, 2]", special=special).endswith("[1")  # text may not open so
    assert accepts("pythonic", "[get_wind", special=special).endswith("get_wi")  # a tool's name
    assert accepts("pythonic", '[get_time(zone="1', special=special).endswith('zone="')  # type
    assert accepts("pythonic", '[get_weather(unit="c"', special=special).endswith(
        "(u")  # a required argument first
    assert accepts("pythonic", '[get_weather(city="P", unit="k"', special=special).endswith(
        'unit="k')  # an enum
    assert accepts("pythonic", "[get_time(zone=1)] and", special=special).endswith("] a")


def test_special_markup_stays_in_the_text():
    tok = byte_tokenizer(MARKUP)
    ids = tok.encode("hi<tool_call>\n{}</tool_call>é", add_special_tokens=False)
    keep = [tok.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>")]
    kept = IncrementalDetokenizer(tok, keep_ids=keep)
    assert "".join(kept.add(t) for t in ids) + kept.flush() == "hi<tool_call>\n{}</tool_call>é"
    plain = IncrementalDetokenizer(tok)
    assert "".join(plain.add(t) for t in ids) + plain.flush() == "hi\n{}é"


def test_the_request_picks_the_grammar():
    tok = byte_tokenizer(("<tool_call>", "</tool_call>"), template="{{ messages }} <tool_call>")
    ctx = ProtocolContext(model_names=("m",), tokenizer=tok, max_model_len=4096, vocab_size=300)
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": WEATHER}]}
    parsed = parse_request("chat", body, ctx)
    spec = parsed.params.structured_outputs
    assert parsed.constraint_field == "tools" and "%json" in spec.grammar
    assert spec.special_text_ids == tuple(tok.backend.token_to_id(t)
                                          for t in ("<tool_call>", "</tool_call>"))
    assert parse_request("chat", {**body, "tool_choice": "none"}, ctx).params \
        .structured_outputs is None
    own = parse_request("chat", {**body, "response_format": {"type": "json_object"}}, ctx)
    assert own.constraint_field == "response_format"  # an explicit constraint wins
    assert "start: call" in parse_request("chat", {**body, "tool_choice": "required"}, ctx) \
        .params.structured_outputs.grammar  # a forced call


def test_a_close_tag_inside_a_string_argument_is_text():
    """The grammar lets a string argument hold `</tool_call>`; hermes reads the call whole, and
    every prefix's parse grows into it."""
    parser = PARSERS["hermes"]()
    text = 'Hi <tool_call>\n{"name": "note", "arguments": {"s": "a</tool_call>b"}}\n</tool_call> ok'
    final = parser.parse(text, True)
    assert [(c.name, c.arguments) for c in final.calls] == [
        ("note", '{"s": "a</tool_call>b"}')] and final.content == "Hi\nok"
    for n in range(len(text)):
        grown = parser.parse(text[:n], False)
        assert final.content.startswith(grown.content) and len(grown.calls) <= 1
        assert all(final.calls[0].arguments.startswith(c.arguments) for c in grown.calls)


RICH = {"name": "rich.tool", "parameters": {
    "type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1.5, "maximum": 2}, "y": {"type": "integer"}},
        "required": ["x"]}},
    "properties": {
        "s": {"type": "string", "minLength": 1, "maxLength": 4},
        "n": {"type": ["integer", "null"]},
        "f": {"type": "number"},
        "b": {"type": "boolean"},
        "e": {"enum": ["it's", 'd"e', "é", 3, True, None, [1, "a"]]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1,
                 "maxItems": 3},
        "at": {"$ref": "#/$defs/point"},
        "either": {"anyOf": [{"type": "boolean"}, {"type": "array", "maxItems": 2}]},
        "free": {},
        "class": {"type": "string"}},  # a Python keyword: left out (optional)
    "required": ["s", "e", "at"], "additionalProperties": False}}


def random_walk(lark: str, tok: Tokenizer, rng, start: str, steps: int = 400
                ) -> tuple[str, bool]:
    """Text sampled from the grammar after `start` and whether it ended (else it was cut after
    `steps` tokens): a random allowed token each step, markup, closers and the end favoured so
    the walk ends."""
    import numpy as np

    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=300, eos_token=[256])
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark),
                                   log_level=0)
    favoured = set(tok.encode("\"',)]}=", add_special_tokens=False)) | {256}
    ids = tok.encode(start, add_special_tokens=False)
    assert matcher.consume_tokens(ids)
    for _ in range(steps):
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(
            matcher.compute_bitmask(), np.uint8), bitorder="little")[:300])
        weights = np.array([30.0 if t in favoured else 1.0 for t in allowed])
        token = int(rng.choice(allowed, p=weights / weights.sum()))
        if token == 256:
            return tok.decode(ids, skip_special_tokens=False), True
        assert matcher.consume_token(token)
        ids.append(token)
    return tok.decode(ids, skip_special_tokens=False), False


@pytest.mark.parametrize("special", [False, True, "added"],
                         ids=["text-markup", "special-markup", "added-markup"])
def test_every_pythonic_call_the_grammar_allows_is_read_and_valid(special):
    """Random walks through the pythonic grammar: the parser reads each text as calls of the
    offered tools, and every call's arguments are valid against its tool's schema."""
    import numpy as np

    jsonschema = pytest.importorskip("jsonschema")
    tok = byte_tokenizer(MARKUP if special else ())
    tools = [WEATHER, TIME, RICH]
    grammar = tool_grammar(PARSERS["pythonic"](), tools, tok, None, True)
    schemas = {t["name"]: t["parameters"] for t in tools}
    rng, calls, seen = np.random.default_rng(0), 0, set()
    for i in range(60):
        text, ended = random_walk(grammar.lark, tok, rng,
                                  ["[", " <|python_start|>[", "T"][i % 3])
        parsed = PARSERS["pythonic"]().parse(text, True)
        if text.startswith("T"):
            assert parsed.calls == [] and parsed.content == text
            continue
        assert parsed.calls or not ended, text
        assert parsed.content == "" or not ended, text  # a cut walk's last call is content
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            seen.update(json.loads(call.arguments)) if call.name == "rich.tool" else None
            calls += 1
    assert calls >= 30 and {"s", "e", "at", "tags"} <= seen and "class" not in seen


def test_a_tool_pythonic_calls_cannot_name_is_left_out():
    bad = [{"name": "get-weather", "parameters": {}},
           {"name": "f", "parameters": {"type": "object", "properties": {"for": {}},
                                        "required": ["for"]}}]
    grammar = tool_grammar(PARSERS["pythonic"](), bad, byte_tokenizer(), None, True)
    assert "answer: PLAIN" in grammar.lark
    assert accepts("pythonic", "[f(", special=False).endswith("[f")


# What openai.pydantic_function_tool makes of a model with an enum and a nested model, less its
# additionalProperties: false: `$defs` and `$ref`s, a `#` that refers to the parameters.
TREE = {"name": "tree", "parameters": {
    "$defs": {"Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"},
              "Leaf": {"properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["v"], "title": "Leaf", "type": "object"}},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}, "leaf": {"$ref": "#/$defs/Leaf"},
                   "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["unit", "leaf"], "title": "Tree", "type": "object"}}
TREE_ARGS = '{"unit": "c", "leaf": {"v": 1}, "kids": [{"unit": "f", "leaf": {"v": 2}}]}'


def _chat_spec(body: dict, reasoning: str | None = None, tok: Tokenizer | None = None):
    tok = tok or byte_tokenizer()
    tok.chat_template = tok.chat_template or "{{ messages }}"
    ctx = ProtocolContext(model_names=("m",), tokenizer=tok, max_model_len=4096, vocab_size=300,
                          reasoning_parser=reasoning)
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return parse_request("chat", body, ctx).params.structured_outputs, tok


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "tree"}}])
def test_forced_calls_resolve_their_own_refs_and_close_objects(choice):
    """Issue 54, rows 2 and 3: each tool's parameters are their own root (`#/$defs/...` and
    `#` resolve there, not in the call around them) and objects are closed to their declared
    properties, so a call ends once its keys are written."""
    body = {"tools": [{"type": "function", "function": t} for t in (TREE, TIME)],
            "tool_choice": choice}
    spec, tok = _chat_spec(body)
    grammar = spec.grammar_text()
    call = '{"name": "tree", "arguments": ' + TREE_ARGS + "}"
    assert matches(grammar, tok, call) == "stop"
    assert matches(grammar, tok, call.replace('"f"', '"k"')).endswith('{"unit": "k')
    # extra keys are refused, at the top and in the nested model
    assert matches(grammar, tok, call.replace('"c", ', '"c", "x')).endswith('"c", "x')
    assert matches(grammar, tok, call.replace('{"v": 1}', '{"v": 1, "w')).endswith('{"v": 1,')
    # a kid is a tree's arguments, not a call: no "name" in it
    assert matches(grammar, tok, call.replace('[{"unit"', '[{"name')).endswith('[{"n')
    for text in ("Just text", f"x <tool_call>\n"
                 f'{{"name": "tree", "arguments": {TREE_ARGS}}}\n</tool_call>'):  # auto alike
        assert accepts("hermes", text, special=True, tools=(TREE,)) == "accept"
    assert accepts("hermes", '<tool_call>{"name": "tree", "arguments": {"unit": "c", "z',
                   special=True, tools=(TREE,)).endswith('"c", "z')


@pytest.mark.parametrize("special", [True, "added", False])
def test_a_response_format_comes_after_the_thinking(special):
    """Issue 54, row 7: with a reasoning parser the thinking is free and the format
    constrains the answer after it (vLLM's behaviour), so the answer reaches `content`."""
    tok = byte_tokenizer(MARKUP if special else (), added=special == "added")
    fmt = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": TIME["parameters"]}}}
    spec, _ = _chat_spec(fmt, "deepseek_r1", tok)
    assert spec.json == TIME["parameters"] and spec.wrapper is not None
    grammar = spec.grammar_text()
    assert matches(grammar, tok, 'Hmm, {"zone": 1}?</think>\n\n{"zone":2}') == "stop"
    assert matches(grammar, tok, '</think>{"zone":"2').endswith('"zone":"')
    assert matches(grammar, tok, "still thinking") == "accept"  # as the parser reads it
    spec, _ = _chat_spec(fmt, "qwen3", tok)
    assert matches(spec.grammar_text(), tok, '<think>\nhm\n</think>\n{"zone":2}') == "stop"
    assert matches(spec.grammar_text(), tok, '{"zone":2}') == "stop"
    regex = {"structured_outputs": {"regex": "[ab]/c"}}
    spec, _ = _chat_spec(regex, "deepseek_r1", tok)
    assert matches(spec.grammar_text(), tok, "x</think>b/c") == "stop"
    if special is True:  # the closing tag stays in the text, where the reasoning parser
        # reads it (an added token that is not special is in it anyway)
        assert tok.backend.token_to_id("</think>") in spec.special_text_ids
    assert _chat_spec(regex, None, tok)[0].wrapper is None


def test_objects_are_closed_unless_the_schema_opens_them():
    """Closing stops where a schema says what else an object holds, and at an allOf's
    branches (each would refuse the other's keys)."""
    def tool(**params):
        return {"name": "t", "parameters": {"type": "object", **params}}

    def call(args):
        return f'<tool_call>{{"name": "t", "arguments": {args}}}</tool_call>'

    both = tool(allOf=[{"properties": {"a": {"type": "integer"}}},
                       {"properties": {"b": {"type": "integer"}}}])
    assert accepts("hermes", call('{"a": 1, "b": 2}'), special=True, tools=(both,)) == "accept"
    opened = tool(properties={"a": {"type": "integer"}}, additionalProperties=True)
    assert accepts("hermes", call('{"a": 1, "z": [1]}'), special=True, tools=(opened,)) == \
        "accept"
    free = tool(properties={"o": {"type": "object"}})  # no properties: any keys
    assert accepts("hermes", call('{"o": {"z": 1}}'), special=True, tools=(free,)) == "accept"
    shut = tool(properties={"o": {"properties": {"x": {}}}})
    assert accepts("hermes", call('{"o": {"x": 1, "z": 1}}'), special=True,
                   tools=(shut,)).endswith('"x": 1,')
