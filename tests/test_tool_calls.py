"""tool_choice "auto" (or none given) end to end through the OpenAI client, on the tiny random
model steered by structured_outputs to write what a model would: a text answer stays text, a call
in the parser's format comes back as `tool_calls` with finish_reason "tool_calls" (streamed as
OpenAI's deltas, equal to the non-streamed call), parallel_tool_calls=false keeps the first;
tools reach the prompt of a template that ignores them; reasoning is split off. Forced calls of
tools with `$defs` / `$ref` and open objects, and one cut by max_tokens. One engine for the
module, and one whose tokenizer adds Qwen's markup as tokens that are not special (a call opens
at its own `<tool_call>`; a response format comes after the thinking)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server import AsyncEngine, ServerConfig, build_app
from jaxserve.server.protocol import ProtocolContext, parse_request
from jaxserve.tokenizer import Tokenizer
from tokenizers import AddedToken

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from serving import read_chat_stream, serve_app  # noqa: E402
from tiny_model import CHAT_TEMPLATE, tiny_loaded, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n' \
       "</tool_call>"
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'


@pytest.fixture(scope="module")
def aengine():
    engine = LLMEngine(EngineConfig.from_options(num_pages=512, page_size=16, max_num_seqs=8,
                                                 max_num_batched_tokens=512),
                       tiny_loaded(max_len=2048))
    aengine = AsyncEngine(engine)
    yield aengine
    aengine.shutdown()


@pytest.fixture(scope="module")
def client(aengine):
    with serve_app(build_app(aengine, ServerConfig(served_model_names=(MODEL,)))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(client, forced: str | None = None, **kwargs):
    """A chat with tools and no tool_choice; `forced` makes the model write exactly that."""
    extra = {"structured_outputs": {"choice": [forced]}} if forced is not None else {}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        **{"tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0, **kwargs},
        extra_body=extra)


def test_tools_without_tool_choice_are_served(client):
    out = chat(client, max_tokens=8, temperature=1.0, seed=3)  # the model's own free text
    assert out.choices[0].finish_reason in ("stop", "length")
    out = chat(client, tool_choice="auto", max_tokens=4, temperature=1.0, seed=4)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_text_answer_stays_text(client):
    out = chat(client, "It is sunny in Paris.")
    message = out.choices[0].message
    assert (message.content, message.tool_calls, out.choices[0].finish_reason) == (
        "It is sunny in Paris.", None, "stop")
    assert read_chat_stream(chat(client, "It is sunny in Paris.", stream=True)) == (
        "It is sunny in Paris.", [], "stop")


def test_a_call_in_the_parsers_format_is_a_tool_call_streamed_alike(client):
    out = chat(client, "Let me check.\n" + TWO_CALLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert read_chat_stream(chat(client, "Let me check.\n" + TWO_CALLS, stream=True)) == (
        "Let me check.", calls, "tool_calls")


def test_parallel_tool_calls_false_returns_one_call(client):
    out = chat(client, TWO_CALLS, parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finish = read_chat_stream(chat(client, TWO_CALLS, parallel_tool_calls=False, stream=True))
    assert [name for name, _ in calls] == ["get_weather"] and finish == "tool_calls"


def test_tool_choice_none_reads_no_calls(client):
    out = chat(client, CALL, tool_choice="none")
    assert out.choices[0].message.content == CALL and out.choices[0].message.tool_calls is None


def test_a_call_cut_by_max_tokens_finishes_with_length(client):
    out = chat(client, CALL, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_a_call_cut_before_its_name_is_content_streamed_alike(client):
    """max_tokens after `<tool_call>` and before the call's name: no call can be read, so the
    text comes back as content (vLLM's answer for an output it cannot read as calls), with
    finish_reason "length", streamed the same."""
    tokens = chat(client, CALL, logprobs=True).choices[0].logprobs.content
    cut, text = 0, ""
    while not text.startswith("<tool_call>\n{"):
        text, cut = text + tokens[cut].token, cut + 1
    out = chat(client, CALL, max_tokens=cut)
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        text, None, "length")
    assert read_chat_stream(chat(client, CALL, max_tokens=cut, stream=True)) == (text, [], "length")


@pytest.fixture
def steer_thoughts(monkeypatch):
    """structured_outputs steers the whole output, thoughts included (with a reasoning parser
    it constrains only the answer after them): these tests read reasoning back."""
    import jaxserve.server.protocol as protocol

    monkeypatch.setattr(protocol, "after_thinking", lambda constraint, *_: constraint)


def test_batch_file_rows_with_tools_read_calls_and_reasoning(tmp_path, steer_thoughts):
    """A batch file's chat rows with tools go through the server's request and response code:
    calls and reasoning come back as they do over HTTP, read by the parsers the context names
    (`jaxserve batch --tool_call_parser --reasoning_parser`)."""
    from jaxserve.batch_file import run_batch

    engine = LLMEngine(EngineConfig.from_options(num_pages=256, page_size=16, max_num_seqs=4,
                                                 max_num_batched_tokens=512),
                       tiny_loaded(max_len=2048))
    thought = "<think>\nThe user wants the weather.\n</think>\n\n"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0,
            "structured_outputs": {"choice": [thought + "Let me check.\n" + CALL]}}
    rows = [body, {**body, "tool_choice": "none"}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST",
                                       "url": "/v1/chat/completions", "body": row}) + "\n"
                           for i, row in enumerate(rows)))
    ctx = ProtocolContext.for_engine(engine, (MODEL,), tool_call_parser="hermes",
                                     reasoning_parser="qwen3")
    assert run_batch(engine, str(inp), str(out), ctx=ctx).failed == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    choices = [r["response"]["body"]["choices"][0] for r in results]
    message = choices[0]["message"]
    assert choices[0]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris", "unit": "c"})]
    none = choices[1]["message"]  # tool_choice "none": the call stays text, reasoning is split
    assert "tool_calls" not in none and none["content"] == "Let me check.\n" + CALL


def _ctx(template: str) -> ProtocolContext:
    base = tiny_tokenizer()
    tok = Tokenizer(base.backend, bos_token_id=None, eos_token_ids=base.eos_token_ids,
                    chat_template=template)
    return ProtocolContext(model_names=(MODEL,), tokenizer=tok, max_model_len=4096,
                           vocab_size=320)


def test_tools_reach_the_prompt_when_the_template_ignores_them():
    from tiny_model import CHAT_TEMPLATE

    ctx = _ctx(CHAT_TEMPLATE)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    body = {"model": MODEL, "tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]}
    prompt = parse_request("chat", body, ctx).prompts[0]["prompt"]
    assert prompt.startswith("<system>Be brief.\n\n# Tools\n")
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt and "<tool_call>" in prompt
    # the earlier call, written as the model would have written it
    assert '<assistant><tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n' \
           "</tool_call>\n<tool>12:00" in prompt
    forced = parse_request("chat", {**body, "tool_choice": "required"}, ctx)
    assert "# Tools" not in forced.prompts[0]["prompt"]  # a forced call is constrained instead


def test_a_qwen_style_template_renders_its_own_tools():
    """A template with `tools` and <tool_call> markup (Qwen 2.5's shape): no tools message is
    added, the hermes parser is picked, and chat_template_kwargs reach the template."""
    template = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}"
                "{{ t['function']['name'] }};{% endfor %}</tools> Call with <tool_call>."
                "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>"
                "\n\n{% endif %}")
    ctx = _ctx(template)
    body = {"model": MODEL, "tools": [WEATHER], "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    parsed = parse_request("chat", body, ctx)
    assert parsed.prompts[0]["prompt"] == (
        "<|im_start|>system\n<tools>get_weather;</tools> Call with <tool_call>.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ctx.tool_parser.name == "hermes" and parsed.output_parser.tools is ctx.tool_parser
    with pytest.raises(Exception, match="chat_template_kwargs"):
        parse_request("chat", {**body, "chat_template_kwargs": {"tools": []}}, ctx)


def test_reasoning_content_whole_and_streamed(aengine, steer_thoughts):
    text = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL
    config = ServerConfig(served_model_names=(MODEL,), reasoning_parser="qwen3")
    with serve_app(build_app(aengine, config)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = chat(client, text)
        message = out.choices[0].message
        assert message.reasoning_content == "The user wants the weather."
        assert message.content is None and message.tool_calls[0].function.name == "get_weather"
        reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                            for ch in chat(client, text, stream=True))
        assert reasoning == "The user wants the weather."


# openai.pydantic_function_tool's schema of a model with an enum and a nested model, less its
# additionalProperties: false (issue 54, rows 2 and 3)
DAY = {"properties": {"offset": {"type": "integer", "minimum": 0, "maximum": 6}},
       "required": ["offset"], "title": "Day", "type": "object"}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "$defs": {"Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"}, "Day": DAY},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}, "day": {"$ref": "#/$defs/Day"}},
    "required": ["unit", "day"], "title": "Forecast", "type": "object"}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
ASK = [{"role": "user", "content": "Forecast?"}]


def test_forced_calls_follow_refs_and_close_extra_keys(client):
    """A forced call of a tool with `$defs` and `$ref`s follows its schema (was a 400), and
    ends once its declared keys are written (inlined, without refs: extra keys until
    max_tokens, then raw JSON as content)."""
    params = FORECAST["function"]["parameters"]
    inlined = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"unit": params["$defs"]["Unit"], "day": DAY},
        "required": params["required"]}}}
    for tools, choice in (([FORECAST, TIME], "required"), ([inlined], "required"),
                          ([FORECAST], {"type": "function", "function": {"name": "forecast"}})):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, tool_choice=choice, n=4, seed=7,
            temperature=1.0, max_tokens=150)
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            call = c.message.tool_calls[0].function
            if call.name == "forecast":
                args = json.loads(call.arguments)
                jsonschema.validate(args, params)
                assert set(args) <= {"unit", "day"} and set(args["day"]) == {"offset"}


def test_a_forced_call_cut_by_max_tokens_is_a_call_not_content(client):
    """Cut short, a forced call comes back as far as it was written, arguments partial, with
    finish_reason "length" (as OpenAI's), streamed alike; cut before its name, as nothing."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[NOTE], tool_choice="required", seed=3,
                  temperature=1.0, max_tokens=60)
    c = client.chat.completions.create(**kwargs).choices[0]
    call = c.message.tool_calls[0].function
    assert (c.finish_reason, c.message.content, call.name) == ("length", None, "note")
    assert call.arguments.startswith('{"text": "') and len(call.arguments) > 12
    assert read_chat_stream(client.chat.completions.create(**kwargs, stream=True)) == (
        "", [("note", call.arguments)], "length")
    c = client.chat.completions.create(**{**kwargs, "max_tokens": 5}).choices[0]
    assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("length", None, None)


QWEN_MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>")


@pytest.fixture(scope="module")
def qwen_markup():
    """The tiny model with Qwen's markup added to its tokenizer as tokens that are not special,
    as Qwen 2.5/3's and Hermes' tokenizers add them (ids 257-260, inside its vocabulary)."""
    backend = tiny_tokenizer().backend
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_MARKUP])
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[256], chat_template=CHAT_TEMPLATE)
    engine = LLMEngine(EngineConfig.from_options(num_pages=256, page_size=16, max_num_seqs=4,
                                                 max_num_batched_tokens=512),
                       dataclasses.replace(tiny_loaded(max_len=2048), tokenizer=tok))
    aengine = AsyncEngine(engine)
    yield aengine, {t: backend.token_to_id(t) for t in QWEN_MARKUP}
    aengine.shutdown()


def _markup_client(qwen_markup, **config):
    aengine, _ = qwen_markup
    app = build_app(aengine, ServerConfig(served_model_names=(MODEL,), **config))
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_a_trigger_that_is_not_special_opens_a_call(qwen_markup):
    """Issue 54, row 4: a logit_bias on the model's own `<tool_call>` opens a call whose
    arguments follow the schema (the grammar masked it: llguidance takes every added token as
    special, and the grammar spelled the trigger as text)."""
    for client in _markup_client(qwen_markup):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[FORECAST], seed=1, temperature=1.0,
            max_tokens=150, parallel_tool_calls=False,
            logit_bias={str(qwen_markup[1]["<tool_call>"]): 40})
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        call = c.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), FORECAST["function"]["parameters"])


def test_a_response_format_after_deepseek_r1_reasoning_is_content(qwen_markup):
    """Issue 54, row 7: with --reasoning_parser=deepseek_r1 the model thinks freely until
    `</think>`, then the schema constrains the answer, which is `content` (it was all in
    reasoning_content); streamed alike."""
    for client in _markup_client(qwen_markup, reasoning_parser="deepseek_r1"):
        kwargs = dict(model=MODEL, messages=ASK, seed=2, temperature=1.0, max_tokens=150,
                      response_format={"type": "json_schema", "json_schema": {
                          "name": "day", "schema": {**DAY, "additionalProperties": False}}},
                      logit_bias={str(qwen_markup[1]["</think>"]): 4})
        c = client.chat.completions.create(**kwargs).choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), DAY)
        assert c.message.reasoning_content and "</think>" not in c.message.reasoning_content
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
