"""Structured outputs: what a request constrains its output to (StructuredOutputsParams), the
grammars compiled from it (GrammarCompiler, cached per distinct spec, thread-safe), and each
sequence's matcher (an llguidance LLMatcher: the grammar's state after the sequence's output
tokens), which fills the token bitmask the device applies before sampling. Host-only, no JAX.

A sequence's matcher is made on first use from its request's compiled grammar and replays the
sequence's output tokens, so forks (n > 1) each get their own and a preempted sequence keeps its
tokens and its matcher. EOS is allowed exactly where the grammar may end (llguidance puts the
EOS token in the mask only in an accepting state).

Speculative decoding: a constrained row's drafts are validated against its matcher (prompt
lookup's are cut at the first the grammar refuses when proposed; a draft model's are known only
when the step is built), and a verification samples each position under the mask of the state
after the drafts before it (`fill_masks`); the matcher advances only over accepted tokens, so a
rejection needs no rollback beyond the one each mask fill does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy as llnp

# Threads llguidance fills a step's masks with: half the cores (XLA's threads need the rest).
MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
MAX_CACHED_GRAMMARS = 256
# JSON without optional whitespace: the compact form, and no run of spaces a sampler can wander
# into before max_tokens.
_JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (dict or JSON text), a regular expression (Rust regex
    syntax), a list of choices (the output is one of them verbatim), a Lark grammar
    (llguidance's dialect), or json_object=True (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def key(self) -> str:
        """The spec as canonical text: equal specs compile once."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) this spec constrains to."""
        m = llguidance.LLMatcher
        if self.json is not None:
            return m.grammar_from_json_schema(json.dumps(self.json), defaults=_JSON_DEFAULTS)
        if self.json_object:
            return m.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's escapes
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return m.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles specs into matchers for one tokenizer; each distinct spec compiles once (LRU).
    Thread-safe, so a server compiles (and validates) a request's grammar in a worker thread
    before the engine's step loop sees the request, which then finds it cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # distinct specs compiled (cache misses)

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec's grammar in its start state (a prototype: sequences take deep copies);
        ValueError naming the problem when the schema, regex or grammar is invalid."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = spec.grammar_text()
        except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions
            raise ValueError(f"invalid structured output spec: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"invalid structured output spec: {matcher.get_error().strip()}")
        with self._lock:
            self._cache[key] = matcher
            self.compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher


def matcher_of(seq) -> llguidance.LLMatcher | None:
    """The sequence's matcher (None without structured output), made on first use: a copy of
    its request's compiled grammar advanced over the sequence's output tokens."""
    proto = seq.request.grammar
    if proto is None:
        return None
    if seq.matcher is None:
        matcher = proto.deep_copy()
        if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):
            raise ValueError(f"output tokens do not match the grammar: {matcher.get_error()}")
        seq.matcher = matcher
    return seq.matcher


def advance(seq, token: int) -> bool:
    """Feed a sampled token to the sequence's matcher; True when the grammar is complete (no
    token may follow). ValueError if the token breaks the grammar (the mask forbids that)."""
    matcher = matcher_of(seq)
    if not matcher.consume_token(token):
        raise ValueError(f"token {token} breaks the grammar: {matcher.get_error()}")
    return matcher.is_stopped()


_executor: Any = None


def fill_masks(rows: list[tuple[int, Any, list[int]]], mask) -> None:
    """Fill mask (i32[R, ceil(V/32)], C-contiguous) with each (row, sequence, drafts)'s
    next-token bitmasks, in MASK_THREADS threads: row `row` for the sequence's state now and,
    for a verification's drafts, row + i for its state after drafts[:i] (i = 1 .. len(drafts);
    the matcher is rolled back afterwards). Rows past a draft the grammar refuses stay all
    ones: the target's token at that draft cannot equal it, so the rows after are discarded."""
    global _executor
    if not rows:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
    matchers = [(matcher_of(seq), row, drafts) for row, seq, drafts in rows]
    for matcher, _, _ in matchers:
        if matcher.is_error():
            raise ValueError(f"structured output failed: {matcher.get_error()}")
    plain = [(m, row) for m, row, drafts in matchers if not drafts]
    drafted = [entry for entry in matchers if entry[2]]
    if plain:
        llnp.fill_next_token_bitmask_par(_executor, plain, mask)
    if drafted:  # (llguidance refuses an empty draft list here)
        llnp.fill_next_token_bitmask_par_with_draft_tokens(_executor, drafted, mask)
    for matcher, row, drafts in drafted:
        valid = valid_drafts(matcher, drafts)
        mask[row + valid + 1:row + len(drafts) + 1] = -1


def valid_drafts(matcher, drafts: list[int]) -> int:
    """How many of the drafts, from the first, the grammar accepts in its state now."""
    return matcher.validate_tokens(drafts) if drafts else 0


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
