"""Structured outputs and tool calls through the OpenAI client, on the tiny random model:
sampled outputs (temperature 0.8-1.0, several seeds, n = 4) are valid for every request across
a varied schema set, regexes and choice lists; forks, preemption and max_tokens mid-structure
behave; tool calls come back in OpenAI's shape, streamed too; bad specs, grammars the matcher
cannot serve (a limit hit at the first token, no output matches) and fields other servers take
(guided_json, ...) are 400s naming the problem; a matcher that fails mid-generation fails its
request alone."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.engine import LLMEngine
from jaxserve.server import AsyncEngine, ServerConfig, build_app

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from serving import serve_app  # noqa: E402
from tiny_model import tiny_loaded  # noqa: E402

MODEL = "tiny"
with open("configs/structured_schemas.json") as f:
    SCHEMAS = json.load(f)
REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]",
           r"#[0-9a-f]{6}", r"(yes|no)( because [a-z ]{1,20})?"]
CHOICES = [["red", "green", "blue"], ["A long answer", "B", "C) maybe"]]


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig.from_options(num_pages=256, page_size=8, max_num_seqs=16,
                                                 max_num_batched_tokens=128),
                       tiny_loaded(max_len=512))
    return engine


@pytest.fixture(scope="module")
def client(engine):
    aengine = AsyncEngine(engine)
    with serve_app(build_app(aengine, ServerConfig(served_model_names=(MODEL,)))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    aengine.shutdown()


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "answer"}], **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_are_always_valid(client, name):
    schema = SCHEMAS[name]
    for seed, temperature in ((1, 1.0), (2, 0.8), (3, 0.9)):
        out = chat(client, n=4, seed=seed, temperature=temperature, max_tokens=400,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": name, "schema": schema,
                                                    "strict": True}})
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_regexes_choices_and_json_object_are_always_valid(client):
    for seed in (1, 2):
        for regex in REGEXES:
            out = client.completions.create(model=MODEL, prompt="x", n=4, seed=seed,
                                            temperature=1.0, max_tokens=100,
                                            extra_body={"structured_outputs": {"regex": regex}})
            for c in out.choices:
                assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
        for options in CHOICES:
            out = chat(client, n=4, seed=seed, temperature=1.0, max_tokens=50,
                       extra_body={"structured_outputs": {"choice": options}})
            assert all(c.message.content in options for c in out.choices)
        out = chat(client, n=4, seed=seed, temperature=0.8, max_tokens=300,
                   response_format={"type": "json_object"})
        for c in out.choices:
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.message.content), dict)


def test_max_tokens_mid_structure_is_length(client):
    out = chat(client, max_tokens=3, temperature=0,
               response_format={"type": "json_schema",
                                "json_schema": {"name": "s", "schema": SCHEMAS["nested"]}})
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].message.content) <= 3 * 4 and \
        out.choices[0].message.content.startswith("{")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                  "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_required_named_and_streamed(client):
    tools = [WEATHER, TIME]
    out = chat(client, tools=tools, tool_choice="required", n=4, seed=5, temperature=1.0,
               max_tokens=200)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    named = {"type": "function", "function": {"name": "get_time"}}
    out = chat(client, tools=tools, tool_choice=named, seed=6, temperature=1.0, max_tokens=200)
    assert out.choices[0].message.tool_calls[0].function.name == "get_time"
    stream = chat(client, tools=tools, tool_choice=named, seed=6, temperature=1.0,
                  max_tokens=200, stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls[0].function.arguments == out.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("body, says", [
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    (dict(extra_body={"guided_regex": "a+"}), "guided_regex"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "unclosed character class"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: foo"}}), "unknown name"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "exactly one"),
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": 5}}}), "type"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not in 'tools'"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),
    (dict(presence_penalty=3), "presence_penalty"),
])
def test_bad_structured_requests_are_400(client, body, says):
    with pytest.raises(openai.BadRequestError, match=re.escape(says)):
        chat(client, max_tokens=5, **body)


def test_forks_and_preemption_keep_outputs_valid():
    """n = 4 forks each follow their own matcher, and a pool too small for all of them (one fits)
    preempts and recomputes them (the matcher keeps the output tokens' state): every output
    still matches, and equals the same seeded request run alone in a roomy pool."""
    regex = r"\[([0-9]{1,3}, ){3,6}[0-9]{1,3}\]"
    params = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    prompt = {"prompt_token_ids": list(range(30, 50))}
    outs = {}
    for pages in (21, 200):  # 20 usable: one sequence fits, four do not
        engine = LLMEngine(EngineConfig.from_options(num_pages=pages, page_size=4,
                                                     max_num_seqs=4), tiny_loaded())
        engine.add_request(prompt, params, request_id="r")
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[pages] = [c.text for c in o.outputs]
        if pages == 21:
            assert engine.stats()["preemptions"] > 0
    assert outs[21] == outs[200]
    assert all(re.fullmatch(regex, t) for t in outs[21]), outs[21]


def test_batch_file_takes_the_same_fields(tmp_path):
    from jaxserve.batch_file import run_batch
    from jaxserve.server.protocol import ProtocolContext

    engine = LLMEngine(EngineConfig.from_options(num_pages=128, page_size=8, max_num_seqs=4),
                       tiny_loaded(max_len=512))
    chat_ = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 1,
             "max_tokens": 200}
    bodies = [
        {**chat_, "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "f", "schema": SCHEMAS["flat"]}}},
        {**chat_, "tools": [WEATHER], "tool_choice": "required"},
        {**chat_, "structured_outputs": {"regex": "[a-"}},
        {**chat_, "guided_json": {"type": "object"}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": str(i), "url": "/v1/chat/completions",
                                       "body": b}) + "\n" for i, b in enumerate(bodies)))
    run_batch(engine, str(inp), str(out),
              ctx=ProtocolContext.for_engine(engine, model_names=(MODEL,)))
    results = [json.loads(line) for line in out.read_text().splitlines()]
    first, second = (r["response"]["body"]["choices"][0] for r in results[:2])
    jsonschema.validate(json.loads(first["message"]["content"]), SCHEMAS["flat"])
    call = second["message"]["tool_calls"][0]["function"]
    assert second["finish_reason"] == "tool_calls" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    assert [r["response"]["status_code"] for r in results[2:]] == [400, 400]
    assert "unclosed character class" in results[2]["response"]["body"]["error"]["message"]


def test_masks_follow_a_verifications_drafts_and_roll_back():
    """fill_masks for a verification: row + i holds the mask of the grammar's state after
    drafts[:i]; rows past a draft the grammar refuses allow everything (they are discarded),
    and the matcher is where it was."""
    import numpy as np

    from jaxserve.core.structured_output import (GrammarCompiler, bitmask_words, fill_masks,
                                                 valid_drafts)

    loaded = tiny_loaded()
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    grammars = GrammarCompiler(tok.backend.to_str(), vocab, list(tok.eos_token_ids))
    proto = grammars.compile(StructuredOutputsParams(regex=r"(abc|xyz)( (abc|xyz)){3}"))
    good = tok.encode("abc xyz", add_special_tokens=False)
    bad = tok.encode("q", add_special_tokens=False)[0]
    drafts = good[:2] + [bad] + good[2:]

    def seq_at(matcher):  # what fill_masks reads of a sequence
        return SimpleNamespace(request=SimpleNamespace(grammar=proto), matcher=matcher)

    seq = seq_at(proto.deep_copy())
    words = bitmask_words(vocab)
    got = np.zeros((len(drafts) + 2, words), np.int32)
    fill_masks([(1, seq, drafts)], got)
    assert valid_drafts(seq.matcher, drafts) == 2
    want = np.full_like(got, -1)
    state = proto.deep_copy()
    for i in range(3):  # the states before drafts 0, 1 and 2 (the refused one)
        fill_masks([(1 + i, seq_at(state), [])], want)
        if i < 2:
            state.consume_token(drafts[i])
    np.testing.assert_array_equal(got[1:], want[1:])
    assert seq.matcher.validate_tokens(good) == len(good)  # rolled back to the start


def test_speculation_drafts_constrained_rows_and_keeps_their_outputs():
    """With speculation on (prompt lookup, and the target as its own draft model), constrained
    rows are drafted too: each verified position samples under the mask of the grammar's state
    after the drafts before it, and the matcher advances only over accepted tokens. A greedy
    and a seeded sampled constrained row, and a plain row beside them, give the outputs of an
    engine without speculation, token for token, and stay valid; an engine serving only
    constrained rows drafts for them and accepts drafts (prompt lookup's cut to what the
    grammar allows; the draft model's first draft among the tokens the grammar allows)."""
    prompt = {"prompt_token_ids": [7, 8, 9, 10] * 8}
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    schema = StructuredOutputsParams(json=SCHEMAS["enums"])
    regex = StructuredOutputsParams(regex=r"(abc|xyz)( (abc|xyz)){12}")
    constrained = {"json": SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                          structured_outputs=schema),
                   "json-greedy": SamplingParams(temperature=0, max_tokens=60,
                                                 structured_outputs=schema),
                   "regex": SamplingParams(temperature=0.8, seed=5, max_tokens=60,
                                           structured_outputs=regex)}
    specs = {"off": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 4, "adaptive": False},
             "draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}}
    outs = {}
    for name, spec in specs.items():
        for only_constrained in (False, True) if spec else (False,):
            engine = LLMEngine(EngineConfig.from_options(
                num_pages=128, page_size=8, max_num_seqs=4, speculative_config=spec),
                tiny_loaded())
            if not only_constrained:
                engine.add_request(prompt, plain, request_id="plain")
            for request_id, params in constrained.items():
                engine.add_request(prompt, params, request_id=request_id)
            while engine.has_unfinished():
                outs.update(((name, o.request_id), o.outputs[0])
                            for o in engine.step() if o.finished)
            if only_constrained:
                stats = engine.stats()
                assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    for name in specs:
        for request_id in ("plain", *constrained):
            assert outs[(name, request_id)].token_ids == outs[("off", request_id)].token_ids
        for request_id in ("json", "json-greedy"):
            jsonschema.validate(json.loads(outs[(name, request_id)].text), SCHEMAS["enums"])
        assert re.fullmatch(r"(abc|xyz)( (abc|xyz)){12}", outs[(name, "regex")].text)


def test_chat_template_renders_tools_and_tool_results():
    """Tools reach the template as `tools` (OpenAI's shape), and assistant tool calls and tool
    results pass through the messages, for templates that render them."""
    from jaxserve.server.protocol import ProtocolContext, parse_request
    from jaxserve.tokenizer import Tokenizer
    from tiny_model import tiny_tokenizer

    template = ("{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}<{{ m['role'] }}>"
                "{% for c in m.get('tool_calls') or [] %}(call {{ c['function']['name'] }})"
                "{% endfor %}{{ m['content'] }}{% if m.get('tool_call_id') %}"
                "#{{ m['tool_call_id'] }}{% endif %}|{% endfor %}<assistant>")
    base = tiny_tokenizer()
    tok = Tokenizer(base.backend, bos_token_id=None, eos_token_ids=base.eos_token_ids,
                    chat_template=template)
    ctx = ProtocolContext(model_names=(MODEL,), tokenizer=tok, max_model_len=512,
                          vocab_size=320)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    body = {"model": MODEL, "tools": [WEATHER, TIME], "tool_choice": "required",
            "messages": [{"role": "user", "content": "time?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]}
    parsed = parse_request("chat", body, ctx)
    assert parsed.prompts[0]["prompt"] == (
        "[tool get_weather][tool get_time]<user>time?|<assistant>(call get_time)|"
        "<tool>12:00#call_1|<assistant>")
    assert parsed.tool_call and parsed.params.structured_outputs is not None


# Grammar admission: what the hostile-input round found (rows 3-5). Each is refused before it is
# queued, with a message naming why: a matcher limit (GrammarLimits) hit at the first token, a
# grammar too big to build, or a grammar that matches no output.
_WORDS = [f"w{i:04d}x" for i in range(20000)]
_BIG_SCHEMA = {"type": "object", "properties": {  # about 1 MB of JSON, 9000 properties
    f"p{i}": {"type": "string", "description": "d" * 90} for i in range(9000)}}
UNSERVABLE = {
    "nested-repeats": (dict(regex="((a{100}){100}){200}"), "initial_lexer_fuel"),
    "choice-2001": (dict(choice=_WORDS[:2001]), "max_items_in_row=2000"),
    "lark-20k-alternatives": (dict(grammar="start: " + " | ".join(json.dumps(w) for w in _WORDS)),
                              "max_items_in_row=2000"),
    "schema-9000-properties": (dict(json=_BIG_SCHEMA), "initial_lexer_fuel=50000"),
    "endless-recursion": (dict(grammar='start: x\nx: "a" x'), "step_max_items"),
    "empty-class": (dict(regex=r"[^\s\S]"), "matches no output"),
    "self-ref-schema": (dict(json={"$ref": "#"}), "matches no output"),
    "ref-cycle": (dict(json={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                             "$ref": "#/$defs/a"}), "matches no output"),
}


@pytest.mark.parametrize("name", sorted(UNSERVABLE))
def test_grammars_the_matcher_cannot_serve_are_refused_at_admission(engine, client, name):
    """A 400 naming why through the server, a ValueError through the offline API; nothing
    queued. (Before admission checked them: a 500 at the first token, or a 200 with an output
    that does not match.)"""
    fields, says = UNSERVABLE[name]
    with pytest.raises(openai.BadRequestError, match=re.escape(says)) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": fields})
    assert e.value.param == "structured_outputs"  # the field it came from
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.add_request("x", SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(**fields)))
    assert not engine.has_unfinished()


def test_a_burst_of_unservable_grammars_is_refused_and_a_neighbour_runs(client):
    """16 concurrent requests with row 3's regex are 400s (admitted once: the refusal is
    cached), and a request beside them completes."""
    from concurrent.futures import ThreadPoolExecutor

    def hostile(_):
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={
                "structured_outputs": {"regex": "((a{100}){100}){200}"}})
        except openai.BadRequestError as e:
            return e.status_code
        return 200

    with ThreadPoolExecutor(17) as pool:
        codes = pool.map(hostile, range(16))
        neighbour = pool.submit(client.completions.create, model=MODEL, prompt="hello",
                                max_tokens=16, temperature=0)
        assert list(codes) == [400] * 16
        assert neighbour.result().choices[0].finish_reason == "length"


def test_a_matcher_that_fails_mid_generation_fails_its_request_alone():
    """A grammar admitted (its first token is within the limits) whose matcher hits the row
    limit at its third token, x after three one-byte terminals being a 2001-way choice: its
    request fails alone with the limit named, counted in num_failed_total; a greedy neighbour's
    tokens are those it gets alone, and no page is held afterwards."""
    engine = LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=4,
                                                 max_num_batched_tokens=64), tiny_loaded())
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    lark = ("start: /[ab]/ /[cd]/ /[ef]/ x\nx: "
            + " | ".join(json.dumps(w) for w in _WORDS[:2001]))
    late = SamplingParams(temperature=0, max_tokens=16,
                          structured_outputs=StructuredOutputsParams(grammar=lark))

    def run(*requests):
        for request_id, params in requests:
            engine.add_request({"prompt_token_ids": list(range(40, 60))}, params,
                               request_id=request_id)
        finals = {}
        for _ in range(100):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            if not engine.has_unfinished():
                return finals
        raise AssertionError("the engine did not finish")

    alone = run(("neighbour", greedy))["neighbour"].outputs[0].token_ids
    failed_before = engine.stats()["num_failed_total"]
    finals = run(("late", late), ("neighbour", greedy))
    stats = engine.stats()
    assert stats["num_failed_total"] == failed_before + 1
    assert "max_items_in_row=2000" in finals["late"].error
    assert len(finals["late"].outputs[0].token_ids) == 3
    assert finals["neighbour"].error is None
    assert finals["neighbour"].outputs[0].token_ids == alone
    assert stats["referenced_pages"] == 0 and stats["running"] == stats["waiting"] == 0
    engine.scheduler.check_invariants()
