"""Hypothesis strategies for the hostile bodies of issue 54, used by the server's fuzz
(tests/test_server_robustness.py).

  MANY_PROMPTS   row 1: one completion body of many prompts (the client may go away at once)
  FORCED_REFS    row 2: forced tool calls whose parameters use $defs / $ref, as
                 openai.pydantic_function_tool writes them
  BAD_TOOL_CALLS row 5: assistant messages whose tool_calls entries lack `function`, its
                 `name`, or hold a string
  HEAVY          row 6: many tools, huge tool descriptions, a huge prompt
"""

from __future__ import annotations

from hypothesis import strategies as st

MODEL = "tiny"
USER = {"role": "user", "content": "hi"}

MANY_PROMPTS = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "prompt": st.builds(lambda n, text: [text] * n,
                        st.sampled_from([1, 2, 64, 256, 257, 2048, 60_000]),
                        st.sampled_from(["a", "the cat sat", ""])),
    "max_tokens": st.integers(1, 3)}, optional={"stream": st.booleans(),
                                                "n": st.integers(1, 2)})

# Parameters as pydantic writes them: an enum or a nested model lifted into $defs.
UNIT = {"enum": ["c", "f"], "title": "Unit", "type": "string"}
REF_SCHEMAS = st.sampled_from([
    {"$defs": {"Unit": UNIT}, "properties": {"unit": {"$ref": "#/$defs/Unit"}},
     "required": ["unit"], "type": "object", "additionalProperties": False},
    {"$defs": {"Point": {"properties": {"x": {"type": "integer"}}, "required": ["x"],
                         "type": "object"}},
     "properties": {"at": {"$ref": "#/$defs/Point"}, "unit": {"$ref": "#/$defs/Unit"}},
     "required": ["at"], "type": "object", "definitions": {"Unit": UNIT}},
    {"properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "type": "object"},
    {"$ref": "#/$defs/Missing", "$defs": {}},
    {"properties": {"unit": {"$ref": "#/$defs/Unit"}}, "type": "object"},
])
FORCED_REFS = st.builds(
    lambda schema, choice, stream: {
        "model": MODEL, "messages": [USER], "max_tokens": 64, "temperature": 0,
        "stream": stream, "tool_choice": choice,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
    REF_SCHEMAS, st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]),
    st.booleans())

CALL_FUNCTIONS = st.one_of(
    st.just({"name": "f", "arguments": "{}"}), st.just({"arguments": "{}"}),
    st.just({"name": "f"}), st.just({"name": "", "arguments": "{}"}),
    st.just({"name": "f", "arguments": "not json"}), st.just({"name": 5}),
    st.text(max_size=8), st.none(), st.integers(), st.lists(st.just("f"), max_size=2))
TOOL_CALL_ENTRIES = st.one_of(
    st.fixed_dictionaries({"id": st.just("c1"), "type": st.just("function")},
                          optional={"function": CALL_FUNCTIONS}),
    st.text(max_size=4), st.none(), st.integers())
BAD_TOOL_CALLS = st.builds(
    lambda calls, content, then_tool, stream: {
        "model": MODEL, "max_tokens": 2, "stream": stream, "messages": [
            USER, {"role": "assistant", "content": content, "tool_calls": calls},
            *([{"role": "tool", "tool_call_id": "c1", "content": "22"}] if then_tool else [])]},
    st.one_of(st.lists(TOOL_CALL_ENTRIES, min_size=1, max_size=3), st.text(max_size=4),
              st.dictionaries(st.just("function"), CALL_FUNCTIONS, max_size=1)),
    st.one_of(st.just(""), st.none(), st.just("ok")), st.booleans(), st.booleans())

ENUM_TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f", "k"]}}}}}
HEAVY = st.one_of(
    st.builds(lambda n: {"model": MODEL, "messages": [USER], "max_tokens": 1,
                         "tools": [ENUM_TOOL] * n},
              st.sampled_from([1, 128, 129, 2000])),
    st.builds(lambda n, size: {"model": MODEL, "messages": [USER], "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": f"t{i}", "description": "x" * size}}
        for i in range(n)]}, st.sampled_from([1, 3]),
        st.sampled_from([10, 300_000, 1_200_000])),
    st.builds(lambda chars, chat: {"model": MODEL, "max_tokens": 1, **(
        {"messages": [{"role": "user", "content": "w" * chars}]} if chat
        else {"prompt": "w" * chars})},
        st.sampled_from([10, 8192, 8193, 3_900_000]), st.booleans()))

