"""Chat templates of the families served render as transformers renders them: Gemma's turns
(roles must alternate; no system role), Gemma 3's (a system message folded into the first user
turn) and Mistral's [INST] format (eos after each answer), written here in the families' formats
and saved in a tiny tokenizer directory; jaxserve's Tokenizer.from_hf_dir and transformers'
AutoTokenizer read the same files. Text and token ids are compared, a conversation the template
refuses raises in both, and continue_final_message ends the text where transformers does. Chat
bodies (the server's and batch lines') with bad tool calls or template fields are 400s naming the
field."""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")

from jaxserve.server.protocol import APIError, ProtocolContext, parse_request  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402
from test_weights import write_hf_tokenizer  # noqa: E402
from tiny_model import CHAT_TEMPLATE, tiny_tokenizer  # noqa: E402

GEMMA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
    "{{ m['content'] + eos_token }}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
TEMPLATES = {"gemma": GEMMA, "gemma3": GEMMA3, "mistral": MISTRAL}

CONVERSATIONS = [
    [{"role": "user", "content": "  What is the capital of France? "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "the weather?"}],
]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "the end"}]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tokenizers(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    write_hf_tokenizer(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        # eos as a plain string: transformers reads the {"content": ...} form only with the
        # rest of an AddedToken's fields
        json.dump({**config, "eos_token": "</s>", "chat_template": TEMPLATES[request.param]}, f)
    return (request.param, Tokenizer.from_hf_dir(directory),
            transformers.AutoTokenizer.from_pretrained(directory))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_templates_render_as_transformers(tokenizers, add_generation_prompt):
    family, ours, theirs = tokenizers
    conversations = CONVERSATIONS + ([WITH_SYSTEM] if family == "gemma3" else [])
    for messages in conversations:
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
        assert text == expected
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(expected, add_special_tokens=False)


def test_refused_conversations_raise_in_both(tokenizers):
    family, ours, theirs = tokenizers
    if family == "gemma3":
        pytest.skip("Gemma 3's template takes a system message")
    with pytest.raises(Exception, match="supported"):
        theirs.apply_chat_template(WITH_SYSTEM, tokenize=False)
    with pytest.raises(ValueError, match="supported"):
        ours.apply_chat_template(WITH_SYSTEM)


def test_continue_final_message_renders_as_transformers(tokenizers):
    """The last message is continued: no end of turn after it (it was written, the flag
    ignored), no generation prompt."""
    family, ours, theirs = tokenizers
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "The answer is"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=False,
                                    continue_final_message=True)
    assert text == theirs.apply_chat_template(messages, tokenize=False,
                                              continue_final_message=True)
    assert text.endswith("Hi<end_of_turn>\n<start_of_turn>model\nThe answer is"
                         if family.startswith("gemma") else "[/INST]The answer is")


# ------------------------------------------------------------------------- request bodies
USER = {"role": "user", "content": "hi"}


def _ctx(template: str = CHAT_TEMPLATE):
    base = tiny_tokenizer()
    tokenizer = Tokenizer(base.backend, bos_token_id=None, eos_token_ids=base.eos_token_ids,
                          chat_template=template)
    return ProtocolContext(model_names=("tiny",), tokenizer=tokenizer, max_model_len=256,
                           vocab_size=320)


def _refused(body: dict, ctx=None) -> dict:
    with pytest.raises(APIError) as caught:
        parse_request("chat", body, ctx or _ctx())
    assert caught.value.status == 400
    return caught.value.body()["error"]


@pytest.mark.parametrize("call,param,needle", [
    ({"id": "c1", "type": "function"}, ".function", "required"),  # was a KeyError: a 500
    ({"function": {"arguments": "{}"}}, ".function.name", "required"),  # KeyError
    ({"function": "get_time"}, ".function", "must be an object"),  # Python's own message
    ({"function": {"name": "f", "arguments": 3}}, ".function.arguments", "JSON text"),
])
def test_bad_tool_calls_are_refused_naming_the_field(call, param, needle):
    calls = {"role": "assistant", "content": None, "tool_calls": [call]}
    error = _refused({"messages": [USER, calls, {"role": "tool", "content": "1"}]})
    assert error["param"] == "messages[1].tool_calls[0]" + param and needle in error["message"]


def test_template_fields_are_checked_and_continue_final_message_works():
    ctx = _ctx()
    error = _refused({"messages": [USER], "chat_template_kwargs": {"self": 1}})  # a TypeError
    assert error["param"] == "chat_template_kwargs" and "'self'" in error["message"]
    error = _refused({"messages": [USER], "chat_template": "{{ messages }}"})  # was ignored
    assert (error["param"], error["code"]) == ("chat_template", "unsupported_parameter")
    prefill = [USER, {"role": "assistant", "content": "The answer is"}]
    error = _refused({"messages": prefill, "continue_final_message": True})
    assert error["param"] == "continue_final_message" and "add_generation_prompt" in \
        error["message"]
    body = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    assert parse_request("chat", body, ctx).prompts[0]["prompt"] == \
        "<user>hi\n<assistant>The answer is"  # was "...is\n": an ended turn
    error = _refused({"messages": [USER]}, _ctx("{{ messages[0].content.nope() }}"))
    assert error["param"] == "messages" and "UndefinedError" in error["message"]  # was a 500
