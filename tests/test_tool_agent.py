"""An agent loop on a tiny seeded Qwen3-style checkpoint (tiny_qwen3.py: special-token markup,
a hermes-style template), served in-process and driven by the openai client: tools -> a call
(logit_bias on `<tool_call>` makes the random model open one; the grammar of tool_choice "auto"
writes the rest) -> a `tool` message the template renders -> a final answer. Streamed and
non-streamed calls agree for a seed. And a fuzz of random tool schemas x sampling seeds, in
the hermes and the pythonic format: every call the server returns names an offered tool and
its arguments are valid against that tool's schema (TOOL_FUZZ_CASES=<n> for a longer run); the
same check on calls constrained by any-value properties finds invalid ones. One engine for the
module, a server per format."""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server import AsyncEngine, ServerConfig, build_app
from jaxserve.weights import load_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")
from serving import read_chat_stream, serve_app  # noqa: E402
from tiny_qwen3 import write_tiny_qwen3  # noqa: E402

MODEL = "tiny-qwen3"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                              "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
FUZZ_CASES = int(os.environ.get("TOOL_FUZZ_CASES", "8"))


@pytest.fixture(scope="module")
def engine_stack(tmp_path_factory):
    directory = write_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))
    with open(os.path.join(directory, "special_tokens.json")) as f:
        special = json.load(f)
    engine = LLMEngine(EngineConfig.from_options(num_pages=1024, page_size=16, max_num_seqs=8,
                                                 max_num_batched_tokens=1024),
                       load_model(directory))
    aengine = AsyncEngine(engine)
    try:
        yield aengine, special, engine
    finally:
        aengine.shutdown()


def _client(engine_stack, **config):
    aengine, special, engine = engine_stack
    config = ServerConfig(served_model_names=(MODEL,), reasoning_parser="qwen3", **config)
    with serve_app(build_app(aengine, config)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), \
            special, engine


@pytest.fixture(scope="module")
def served(engine_stack):
    """The template's own format: hermes, `<tool_call>` a special token."""
    yield from _client(engine_stack)


@pytest.fixture(scope="module")
def served_pythonic(engine_stack):
    """Pythonic calls, opened by the special `<|python_start|>`."""
    yield from _client(engine_stack, tool_call_parser="pythonic")


def _call(client, special, messages, tools, seed, stream=False, bias=100,
          opener="<tool_call>", **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, seed=seed, temperature=1.0,
        max_tokens=kwargs.pop("max_tokens", 160), stream=stream,
        logit_bias={str(special[opener]): bias}, **kwargs)


def _check(call, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_agent_loop(served):
    client, special, engine = served
    tools = [WEATHER, TIME]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"}]
    out = _call(client, special, messages, tools, seed=1, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check(call, tools)
    # the same seed streamed: the same call, in deltas
    content, calls, finish = read_chat_stream(_call(client, special, messages, tools, seed=1,
                                                    stream=True, parallel_tool_calls=False))
    assert (content, finish) == ("", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]

    # the call's result goes back as a `tool` message, which the template renders
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function", "function": {
                         "name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    final = _call(client, special, messages, tools, seed=2, bias=-100, max_tokens=12)
    rendered = engine.tokenizer.apply_chat_template(
        [m if m["role"] != "assistant" else {**m, "content": ""} for m in messages],
        tools=tools, add_generation_prompt=True)
    assert f'<tool_response id="{call.id}">\nSunny, 21 C.\n</tool_response>' in rendered
    assert final.usage.prompt_tokens == len(engine.tokenizer.encode(rendered,
                                                                    add_special_tokens=False))
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert "<tool_call>" not in (answer.message.content or "")


def test_parallel_calls_streamed_as_whole(served):
    """Calls until max_tokens: every complete one is valid, the streamed deltas equal the
    message, and the special markup reaches the content only as a call cut before its name
    (the parser gives an opening that holds no call back as text)."""
    client, special, _ = served
    messages = [{"role": "user", "content": "Weather and time?"}]
    out = _call(client, special, messages, [WEATHER, TIME], seed=5, max_tokens=200)
    choice = out.choices[0]
    calls, content = choice.message.tool_calls, choice.message.content or ""
    assert len(calls) >= 2 and choice.finish_reason == "length"
    assert content == "" or content.startswith("<tool_call>") and "</tool_call>" not in content
    for call in calls[:-1] if choice.finish_reason == "length" else calls:
        _check(call, [WEATHER, TIME])
    content, streamed, _ = read_chat_stream(_call(client, special, messages, [WEATHER, TIME],
                                                  seed=5, max_tokens=200, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    assert content == (choice.message.content or "")  # a call cut before its name: content


# ------------------------------------------------------------------------------- fuzz
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object with a few required and optional properties of bounded size: strings (short
    max length), integers (a range), enums, arrays of those, nested objects."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "enum", "array"] + (["object"] if depth < 1
                                                                     else []))
        if kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            schema = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
        elif kind == "enum":
            schema = {"enum": rng.sample(["a", "b c", "d\"e", "é", "x1", "yz"], rng.randint(1, 3))}
        elif kind == "array":
            schema = {"type": "array", "items": rng.choice([
                {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["p", "q"]}]),
                "maxItems": rng.randint(1, 3)}
        else:
            schema = random_schema(rng, depth + 1)
        props[f"p{i}_{kind}"] = schema
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def loosened(tool: dict) -> dict:
    """The tool with each property's schema replaced by any value (names and required kept)."""
    params = tool["function"]["parameters"]
    return {"type": "function", "function": {**tool["function"], "parameters": {
        "type": "object", "properties": {k: {} for k in params["properties"]},
        "required": params["required"]}}}


def fuzz(client, special, cases: int, seed: int = 0, opener: str = "<tool_call>",
         loosen: bool = False) -> dict:
    """`cases` requests of random tools (1-3) and sampling seeds with the call opened (a
    logit_bias on `opener`): counts of calls returned and of invalid ones (a name not offered,
    arguments not valid against the named tool's schema, or not JSON). `loosen` offers the
    server each tool with any-value properties instead, to show the check can fail."""
    rng = random.Random(seed)
    jobs = []
    for case in range(cases):
        tools = [{"type": "function", "function": {"name": f"tool_{case}_{j}",
                                                   "parameters": random_schema(rng)}}
                 for j in range(rng.randint(1, 3))]
        jobs.append((tools, rng.randrange(2**31), rng.random() < 0.5))

    def run(job):
        tools, sample_seed, parallel = job
        offered = [loosened(t) for t in tools] if loosen else tools
        out = _call(client, special, [{"role": "user", "content": "Go."}], offered, sample_seed,
                    parallel_tool_calls=parallel, max_tokens=240, opener=opener)
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "length":  # the last call may be cut short
            calls = calls[:-1]
        invalid = []
        for call in calls:
            try:
                _check(call, tools)
            except Exception as e:  # noqa: BLE001 - counted and shown
                invalid.append((call.function.name, call.function.arguments, repr(e)[:200]))
        return len(calls), invalid

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    return {"cases": cases, "calls": sum(n for n, _ in results),
            "invalid": [bad for _, found in results for bad in found]}


@pytest.mark.parametrize("fmt", ["hermes", "pythonic"])
def test_fuzz_random_schemas_every_call_is_valid(fmt, request):
    client, special, _ = request.getfixturevalue("served" if fmt == "hermes"
                                                 else "served_pythonic")
    opener = "<tool_call>" if fmt == "hermes" else "<|python_start|>"
    report = fuzz(client, special, FUZZ_CASES, opener=opener)
    print(fmt, report["cases"], "cases,", report["calls"], "calls,", len(report["invalid"]),
          "invalid")
    assert report["calls"] >= FUZZ_CASES and report["invalid"] == []


@pytest.mark.parametrize("fmt", ["hermes", "pythonic"])
def test_the_fuzz_finds_calls_that_break_their_schema(fmt, request):
    """The same check on calls whose grammar was built from any-value properties: it counts
    invalid ones (the fuzz above can fail)."""
    client, special, _ = request.getfixturevalue("served" if fmt == "hermes"
                                                 else "served_pythonic")
    opener = "<tool_call>" if fmt == "hermes" else "<|python_start|>"
    report = fuzz(client, special, 8, opener=opener, loosen=True)
    print(fmt, "loosened:", report["calls"], "calls,", len(report["invalid"]), "invalid")
    assert report["calls"] > 0 and len(report["invalid"]) > 0
