"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special ids and chat template.

Built from GGUF metadata (byte-level BPE, `tokenizer.ggml.model == "gpt2"`) or from a Hugging
Face directory (tokenizer.json + tokenizer_config.json / chat_template.jinja). Also the
incremental detokenizer used for streaming.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import numbers
import os
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# Pre-tokenizer split regexes, by GGUF `tokenizer.ggml.pre` (as in llama.cpp and transformers).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (gpt-oss, Llama 4): a word is an upper-case run then lower-case letters, or the other
# way round (camel case splits), contractions kept with it; numbers in threes. Tekken's
# (Mistral) is the same without the contractions and with single digits.
_WORD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cased_words(contraction: str, digits: str) -> str:
    upper, lower = _WORD
    return (rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{contraction}"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{contraction}|{digits}{_REST}")


_SPLITS = {
    **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe",
                                  "dbrx", "pixtral")},
    **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{k: _cased_words(_CONTRACTION, r"\p{N}{1,3}") for k in ("gpt-4o", "llama4")},
    "tekken": _cased_words("", r"\p{N}"),
}
_GPT2_NAMES = ("gpt2", "default", "smollm")
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pre_tokenizer(pre: str | None):
    if pre == "smollm":
        # SmolLM's own tokenizer.json: single digits, then GPT-2 byte-level splitting
        # (llama.cpp: "\p{N}" followed by the GPT-2 regex).
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _SPLITS.get(pre or "")
    if split is None:  # "gpt2", "default" and unknown names: GPT-2's regex
        if pre not in (None, *_GPT2_NAMES):
            logging.warning("GGUF pre-tokenizer %r is not known here: text is split as GPT-2 "
                            "splits it, which can give other tokens than the model's own "
                            "tokenizer", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def check_unicode(text: str, what: str) -> None:
    """ValueError if `text` cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at index {e.start}") from None


class ChatTemplateError(ValueError):
    """A chat template that refuses, or cannot render, a conversation; `param` names the field
    of a request it comes from."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


class Tokenizer:
    """Encode/decode text and render the model's chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Iterable[int], chat_template: str | None,
                 add_bos_token: bool = False):
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE "
                             f"'gpt2' is)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        pre = meta.get("tokenizer.ggml.pre")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            if not set(t) <= alphabet:
                t = "".join(spelling[b] for b in t.encode("utf-8", errors="surrogateescape"))
            vocab.setdefault(t, i)
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                         ignore_merges=pre in _IGNORE_MERGES)
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id",
                                          "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
        eos = meta.get("tokenizer.ggml.eos_token_id")
        single, special = "$A", []
        if add_bos:
            single = f"{tokens[bos]} {single}"
            special.append((tokens[bos], int(bos)))
        if add_eos and eos is not None:
            single = f"{single} {tokens[eos]}"
            special.append((tokens[eos], int(eos)))
        if special:
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=f"{single} {single.replace('$A', '$B:1')}",
                special_tokens=list(dict.fromkeys(special)))
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=eos_ids, chat_template=meta.get("tokenizer.chat_template"),
                   add_bos_token=add_bos)

    @classmethod
    def from_hf_dir(cls, directory: str) -> "Tokenizer":
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = tokenizers.Tokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()

        def tid(name):
            content = _token_content(cfg.get(name))
            return None if content is None else backend.token_to_id(content)

        bos, eos = tid("bos_token"), tid("eos_token")
        eos_ids = list(cfg.get("jaxserve_eos_token_ids", []))
        if eos is not None:
            eos_ids.insert(0, eos)
        add_bos = bool(cfg.get("add_bos_token", False)) and bos is not None
        if add_bos:
            probe = backend.encode("a", add_special_tokens=True).ids
            if not probe or probe[0] != bos:
                bos_tok = _token_content(cfg["bos_token"])
                backend.post_processor = processors.TemplateProcessing(
                    single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B:1",
                    special_tokens=[(bos_tok, bos)])
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template,
                   add_bos_token=add_bos)

    def save(self, directory: str) -> None:
        """Write tokenizer.json and tokenizer_config.json (readable by `from_hf_dir`)."""
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        cfg = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
            "jaxserve_eos_token_ids": list(self._eos_token_ids),
        }
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1, ensure_ascii=False)

    def with_eos_token_ids(self, eos_token_ids: Iterable[int]) -> "Tokenizer":
        new = Tokenizer(self.backend, bos_token_id=self._bos_token_id,
                        eos_token_ids=eos_token_ids, chat_template=self.chat_template,
                        add_bos_token=self.add_bos_token)
        return new

    # --- properties ---------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_token_id is None else self.backend.id_to_token(self._bos_token_id)

    @property
    def eos_token(self) -> str | None:
        if not self._eos_token_ids:
            return None
        return self.backend.id_to_token(self._eos_token_ids[0])

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text, "the text")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # --- chat template ------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            *, continue_final_message: bool = False,
                            chat_template: str | None = None, **variables: Any) -> str:
        """Render the model's own chat template, or `chat_template` (sandboxed jinja2, as
        transformers does); `variables` are the template's other variables (tools, ...).
        continue_final_message: the text ends with the last message's content, as the model
        would go on writing it (no end of turn after it, no generation prompt). Any failure of
        the template is a ChatTemplateError."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise ChatTemplateError("a chat template is Jinja text (a string)", "chat_template")
        source = chat_template or self.chat_template
        if not source:
            raise ChatTemplateError("this model has no chat template (tokenizer.chat_template in "
                                    "the GGUF / chat_template in tokenizer_config.json); send a "
                                    "plain prompt instead")
        template = _compile_template(source)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   **variables, "add_generation_prompt": add_generation_prompt}
        if not continue_final_message:
            return _render(template, {**context, "messages": messages})
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message continues the last message: no "
                                    "generation prompt may follow it", "continue_final_message")
        final = messages[-1] if messages else {}
        if not isinstance(final.get("content"), str):
            raise ChatTemplateError("continue_final_message needs a last message with text "
                                    "content", "continue_final_message")
        # The template writes a mark where the final content goes; the text is cut there and
        # ends with the content as given, whatever the template would write after it.
        marked = [*messages[:-1], {**final, "content": _FINAL_MARK}]
        text = _render(template, {**context, "messages": marked})
        if _FINAL_MARK not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not write "
                                    "the last message's content, so it cannot be continued",
                                    "continue_final_message")
        return text[:text.rindex(_FINAL_MARK)] + final["content"]


_FINAL_MARK = "<|jaxserve-final-message|>"
# Jinja's own names and the globals templates call: chat_template_kwargs may not replace them.
_TEMPLATE_GLOBALS = ("raise_exception", "strftime_now")


def reserved_template_names() -> frozenset[str]:
    """Names a chat template's variables may not take (its environment's globals, `self`)."""
    import jinja2.defaults

    return frozenset({"self", *jinja2.defaults.DEFAULT_NAMESPACE, *_TEMPLATE_GLOBALS})


def _render(template, context: dict) -> str:
    try:
        return template.render(context)  # a dict, so no variable meets render()'s own arguments
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - the template is code run on the request's data
        raise ChatTemplateError(f"the chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=8)  # the model's template and a few given per call
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols], undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals.update(zip(_TEMPLATE_GLOBALS, (raise_exception, strftime_now)))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e} (line {e.lineno})",
                                "chat_template") from None


class IncrementalDetokenizer:
    """Streams text for generated ids through tokenizers' DecodeStream: `add(id)` returns the
    newly stable text (nothing while the ids end inside a UTF-8 sequence, all of it once the
    sequence completes). The concatenation of deltas (plus `flush()`) equals
    `tokenizer.decode(generated_ids, skip_special_tokens)`.

    The last few prompt ids prefill the stream as left context, so decoders that treat the start
    of a sequence specially (e.g. stripping a leading space) behave as in the middle of a text.

    `keep_ids`: special tokens written out although special tokens are skipped (a tool call's
    markup, which its parser must see); the text is then the decode of the ids between them,
    joined by their contents.
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, keep_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._keep = frozenset(int(i) for i in keep_ids) if skip_special_tokens else frozenset()
        self._stream = decoders.DecodeStream(
            ids=[int(i) for i in list(prompt_ids)[-self._CONTEXT:]],
            skip_special_tokens=skip_special_tokens)
        self._segment: list[int] = []  # ids since the last kept special token
        self._segment_text = ""  # their text emitted so far
        self.text = ""  # all text emitted so far

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        delta = self._stream.step(self.tokenizer.backend, token_id) or ""
        if token_id in self._keep:
            delta += self.tokenizer.id_to_token(token_id)
            self._segment, self._segment_text = [], ""
        else:
            self._segment.append(token_id)
            self._segment_text += delta
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release whatever is held back (an incomplete sequence at the end of generation, as
        the replacement character): one decode of the ids since the last kept token, once per
        sequence."""
        full = self.tokenizer.decode(self._segment, skip_special_tokens=self.skip_special_tokens)
        seen = self._segment_text
        delta = full[len(seen):] if full.startswith(seen) else ""
        self.text += delta
        return delta


def tokenize_prompt(tokenizer: Tokenizer, prompt, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt as users give it (text, a list of token ids, or a dict with "prompt" or
    "prompt_token_ids") -> (its text if any, its token ids); ids are checked against the
    vocabulary."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integer token ids")
            ids = [int(t) for t in ids]
            if any(t < 0 or t >= vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be in [0, {vocab_size})")
            return prompt.get("prompt"), ids
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return tokenize_prompt(tokenizer, {"prompt_token_ids": prompt}, vocab_size)
    raise TypeError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                    f"'prompt_token_ids'; got {type(prompt).__name__}")
