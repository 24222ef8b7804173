"""Tokenizer: parity with transformers' tokenizer built from the same GGUF, chat template,
incremental detokenization."""

from __future__ import annotations

import pytest

from jaxserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow  # every test uses the default model's tokenizer or GGUF

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've DONE it, haven't we?",
    "camelCaseWords XMLHttpRequest iPhone's HTTPServer/path\r\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "    leading spaces, trailing   \n\n\n\t\ttabs and  runs     of   spaces   ",
    "Numbers: 0 7 42 1234567 3.14159 -2e10 1,000,000 2024-06-01",
    "Emoji 😀👍🏽🇫🇷 and ZWJ 👨‍👩‍👧‍👦 family",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé àccents, ß, Ω≈ç√∫, Привет мир, مرحبا",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special in middle<|endoftext|>after <file_sep> x",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tok(default_loaded) -> Tokenizer:
    return default_loaded.tokenizer


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(tok, hf_smollm2_tokenizer, add_special):
    for text in TEXTS:
        ours = tok.encode(text, add_special_tokens=add_special)
        ref = hf_smollm2_tokenizer.encode(text, add_special_tokens=add_special)
        assert ours == ref, text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf_smollm2_tokenizer, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(
            ids, skip_special_tokens=skip), text
        if not skip:
            assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level is lossless


def test_special_ids_and_vocab(tok, hf_smollm2_tokenizer):
    assert tok.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.eos_token == hf_smollm2_tokenizer.eos_token == "<|im_end|>"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert not tok.add_bos_token  # SmolLM2's GGUF says add_bos_token = false
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Write code:\n  x = 1"}],
]


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_smollm2_tokenizer, gen):
    for messages in CONVERSATIONS:
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        ref = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=gen)
        assert ours == ref
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_chat_template_missing_and_raise_exception(tok):
    bare = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,),
                       chat_template="{% if messages[0]['role'] != 'user' %}"
                                     "{{ raise_exception('first must be user') }}{% endif %}"
                                     "{{ bos_token }}{{ messages[0]['content'] | tojson }}")
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>"é"'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def _stream(tok, prompt_ids, ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_matches_full_decode(tok, skip):
    prompt = tok.encode(tok.apply_chat_template(CONVERSATIONS[0]))
    for text in TEXTS + ["".join(TEXTS)]:
        ids = tok.encode(text)
        deltas = _stream(tok, prompt, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), text
        assert not any("\ufffd" in d for d in deltas), (text, deltas)
        assert deltas[-1] == ""  # nothing held back at the end of complete text


def test_incremental_detokenizer_holds_incomplete_utf8(tok):
    ids = tok.encode("a😀")
    # The emoji's 4 UTF-8 bytes span several byte-level tokens; nothing is emitted for it
    # until its last byte arrives.
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "😀"
    # An incomplete sequence left at the end is released by flush() (as the replacement char).
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert detok.flush() == tok.decode(ids[:-1])[1:]


def test_tokenizer_json_round_trip(tok, tmp_path):
    tok.save(str(tmp_path))
    again = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert again.chat_template == tok.chat_template
    assert (again.bos_token_id, again.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "gpt-4o", "tekken"])
def test_other_pre_tokenizers_match_transformers(default_model_path, pre):
    """The same vocabulary with other `tokenizer.ggml.pre` values: split regexes as in
    transformers' GGUF conversion (ids may differ from a real llama3/qwen2 vocabulary's; the
    point is the pre-tokenizer)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from jaxserve.weights.gguf_loader import read_gguf

    meta = dict(read_gguf(default_model_path).metadata)
    meta["tokenizer.ggml.pre"] = pre
    ours = Tokenizer.from_gguf_metadata(meta)
    ref, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre,
        "tokens": meta["tokenizer.ggml.tokens"], "merges": meta["tokenizer.ggml.merges"],
        "token_type": meta["tokenizer.ggml.token_type"]})
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == \
            ref.encode(text, add_special_tokens=False).ids, (pre, text)


def test_add_bos_from_metadata(default_model_path):
    from jaxserve.weights.gguf_loader import read_gguf

    meta = dict(read_gguf(default_model_path).metadata)
    meta["tokenizer.ggml.add_bos_token"] = True
    t = Tokenizer.from_gguf_metadata(meta)
    assert t.add_bos_token
    assert t.encode("hi") == [1] + t.encode("hi", add_special_tokens=False)
