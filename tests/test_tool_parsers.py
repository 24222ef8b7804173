"""Tool-call and reasoning parsers on text written the way the models write it: each format's
calls and content read from a whole text, and the same text streamed in small pieces (1 to 7
characters) gives deltas that reassemble to the same calls and content. Host-only, no model."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.server.chat_output import ChatOutputParser, ChatOutputStream
from jaxserve.server.reasoning import reasoning_parser
from jaxserve.server.tool_parsers import PARSERS, tool_parser
from jaxserve.server.tool_prompt import tools_message

PARIS = '{"city": "Paris", "unit": "c"}'
TRICKY = '{"q": "a } \\" { ]", "n": [1, {"x": null}], "ok": true}'

# (format, model text, expected content, expected [(name, arguments as JSON)])
CASES = [
    # Qwen 2.5 / 3 and Hermes 2 Pro
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
     None, [("get_weather", PARIS)]),
    ("hermes", f'I\'ll check both.\n\n<tool_call>\n{{"name": "get_weather", "arguments": '
               f'{PARIS}}}\n</tool_call>\n<tool_call>\n{{"name": "search", "arguments": '
               f'{TRICKY}}}\n</tool_call>', "I'll check both.",
     [("get_weather", PARIS), ("search", TRICKY)]),
    ("hermes", '<tool_call>\n{"arguments": {"zone": 1}, "name": "get_time"}\n</tool_call>',
     None, [("get_time", '{"zone": 1}')]),
    ("hermes", "Use the <tools> tag, or <tool_call>oops</tool_call> in text.",
     "Use the <tools> tag, or <tool_call>oops</tool_call> in text.", []),
    ("hermes", "The weather in Paris is mild.\n", "The weather in Paris is mild.\n", []),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    # Llama 3.1-3.3 JSON
    ("llama3_json", f'{{"name": "get_weather", "parameters": {PARIS}}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}; '
                    '{"name": "get_time", "parameters": {"zone": 1}}', None,
     [("get_weather", PARIS), ("get_time", '{"zone": 1}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # Mistral, v0.3 tokenizers and v11+
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, '
                '{"name": "get_time", "arguments": {"zone": 1}}]', None,
     [("get_weather", PARIS), ("get_time", '{"zone": 1}')]),
    ("mistral", f"Checking.[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]search[ARGS]{TRICKY}",
     "Checking.", [("get_weather", PARIS), ("search", TRICKY)]),
    ("mistral", "No [TOOL_CALLS] needed, it is sunny.", "No [TOOL_CALLS] needed, it is sunny.",
     []),
    # pythonic (Llama 3.2 / 4)
    ("pythonic", "[get_weather(city='Paris', unit=\"c\"), get_time(zone=1)]", None,
     [("get_weather", PARIS), ("get_time", '{"zone": 1}')]),
    ("pythonic", '<|python_start|>[search(query="a, b (c)", filters={"year": 2024, "tags": '
                 '["x", "y"]}, exact=True, limit=None)]<|python_end|>', None,
     [("search", '{"query": "a, b (c)", "filters": {"year": 2024, "tags": ["x", "y"]}, '
                 '"exact": true, "limit": null}')]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
]


def reassemble(parser: ChatOutputParser, text: str, seed: int) -> dict:
    """Stream `text` in random pieces of 1-7 characters; the deltas put back together."""
    rng, stream, cut = random.Random(seed), ChatOutputStream(parser), 0
    out = {"reasoning": "", "content": "", "calls": []}
    while cut < len(text):
        cut = min(len(text), cut + rng.randint(1, 7))
        delta = stream.delta(text[:cut], final=cut == len(text))
        out["reasoning"] += delta.get("reasoning_content", "")
        out["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(out["calls"]) and call["id"].startswith("call_")
                out["calls"].append([call["function"]["name"], ""])
            out["calls"][call["index"]][1] += call["function"]["arguments"]
    return out


@pytest.mark.parametrize("fmt, text, content, calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parsers_read_calls_whole_and_streamed(fmt, text, content, calls):
    parser = ChatOutputParser(tools=PARSERS[fmt]())
    message = parser.message(text)
    assert message["content"] == content
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls", [])]
    assert got == calls
    for args in (a for _, a in got):
        assert isinstance(json.loads(args), dict)
    for seed in range(6):
        streamed = reassemble(parser, text, seed)
        assert streamed["content"] == (content or "")
        assert [tuple(c) for c in streamed["calls"]] == calls


def test_a_call_cut_short_keeps_what_was_written():
    """max_tokens mid-call: the call and its arguments so far (finish_reason stays 'length')."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    message = ChatOutputParser(tools=PARSERS["hermes"]()).message(text)
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Let me see. <tool_call>\n{"na', 'Let me see. <tool_call>\n{"na', []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "g',
     '<tool_call>\n{"name": "g', ["a"]),
    ("mistral", '[TOOL_CALLS][{"name": "get_', '[TOOL_CALLS][{"name": "get_', []),
    ("mistral", "ok [TOOL_CALLS]get_wea", "ok [TOOL_CALLS]get_wea", []),
    ("llama3_json", '<|python_tag|>{"name', '<|python_tag|>{"name', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"na', '{"na', ["a"]),
    ("pythonic", "[get_wea", "[get_wea", []),
    ("pythonic", '<|python_start|>[get(city="Pa', '<|python_start|>[get(city="Pa', []),
    ("pythonic", '[f(a=1), get(city="Pa', 'get(city="Pa', ["f"]),
])
def test_a_call_cut_before_it_can_be_read_is_content(fmt, text, content, calls):
    """max_tokens after a trigger, before the call can be read (its name, or for pythonic its
    closing parenthesis): the text from the trigger on comes back as content, as vLLM returns
    an output it cannot read as calls, and the stream's deltas reassemble to the same (the text
    held back while it might become a call goes out with the last chunk)."""
    parser = ChatOutputParser(tools=PARSERS[fmt]())
    message = parser.message(text)
    assert message["content"] == content
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == calls
    for seed in range(4):
        streamed = reassemble(parser, text, seed)
        assert streamed["content"] == content and [c[0] for c in streamed["calls"]] == calls


def test_parallel_tool_calls_false_returns_the_first():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    parser = ChatOutputParser(tools=PARSERS["hermes"](), parallel_tool_calls=False)
    assert [c["function"]["name"] for c in parser.message(text)["tool_calls"]] == ["a"]
    assert [c[0] for c in reassemble(parser, text, 0)["calls"]] == ["a"]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nThe user wants Paris.\n</think>\n\nParis.", "The user wants Paris.",
     "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("deepseek_r1", "Paris is the capital.\n</think>\n\nParis.", "Paris is the capital.",
     "Paris."),
    ("deepseek_r1", "<think>Still thinking", "Still thinking", ""),
])
def test_reasoning_is_split_whole_and_streamed(name, text, reasoning, content):
    parser = ChatOutputParser(reasoning=reasoning_parser(name))
    message = parser.message(text)
    assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    for seed in range(4):
        streamed = reassemble(parser, text, seed)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning or "", content)


def test_reasoning_then_a_call():
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            f'"arguments": {PARIS}}}\n</tool_call>')
    parser = ChatOutputParser(tools=PARSERS["hermes"](), reasoning=reasoning_parser("qwen3"))
    message = parser.message(text)
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == PARIS
    assert reassemble(parser, text, 1)["calls"] == [["get_weather", PARIS]]


@pytest.mark.parametrize("template, name", [
    ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>{{ messages }}", "llama3_json"),
    ("<|im_start|>{{ messages }}", "hermes"),  # SmolLM2's: no tool markup, the default
])
def test_auto_picks_the_format_the_template_shows(template, name):
    assert tool_parser("auto", template).name == name
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser("nope", template)


def test_default_tools_message_lists_tools_and_the_format():
    tools = [{"name": "get_weather", "parameters": {"type": "object"}}]
    for name, cls in PARSERS.items():
        text = tools_message(tools, cls())
        assert '"name": "get_weather"' in text and cls().instructions() in text, name
    calls = [{"id": "c", "type": "function",
              "function": {"name": "get_weather", "arguments": PARIS}}]
    for name, cls in PARSERS.items():  # a parser reads back what it writes for history
        written = cls().format_calls(calls)
        (call,) = ChatOutputParser(tools=cls()).message(written)["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == json.loads(PARIS), name
