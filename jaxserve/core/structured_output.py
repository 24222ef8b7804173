"""Structured outputs: what a request constrains its output to (StructuredOutputsParams), the
grammars compiled from it (GrammarCompiler, cached per distinct spec, thread-safe), and each
sequence's matcher (an llguidance LLMatcher: the grammar's state after the sequence's output
tokens), which fills the token bitmask the device applies before sampling. Host-only, no JAX.

Admission: a grammar is admitted only if the matcher can serve it. GrammarCompiler.compile
compiles it under GrammarLimits (llguidance's parser limits), computes its first mask, refuses
a grammar that matches no output, and feeds a few of the allowed first tokens to copies of the
matcher; any error there is a ValueError naming the reason (the limit hit, with its value), so
a server answers 400 before the request reaches the engine. After admission the same limits
bound each step's mask and token, and a matcher that errs mid-generation (a limit hit on a
later token) is left in its error state by `advance`: the engine fails that request alone
(`grammar_error`).

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
import hashlib
import json
import os
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

# Threads llguidance fills a step's masks with: half the cores (XLA's threads need the rest).
MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
MAX_CACHED_GRAMMARS = 256
# JSON without optional whitespace: the compact form, and no run of spaces a sampler can wander
# into before max_tokens.
_JSON_DEFAULTS = {"whitespace_flexible": False}
# Allowed first tokens fed to copies of a new grammar's matcher at admission (spread over the
# mask): a row or lexer limit a grammar hits at its first token shows there.
PROBE_TOKENS = 4
NO_OUTPUT = ("structured output matches no output: no token can begin it and the empty output "
             "does not match it")


@dataclasses.dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits, which bound what one grammar costs: its compile and first
    mask at admission, and each later mask and token (the engine loop's share). A grammar that
    hits one is refused at admission, or fails its request alone mid-generation. The row limit
    is llguidance's default; the lexer fuel is a twentieth (initial) and a quarter (per step)
    of its defaults and the items per step two fifths, still over 5x what real schemas, regexes
    and choice lists use, so that one mask or token costs a few milliseconds at most per
    constrained row (llguidance: ~14k lexer fuel, ~20k items per ms)."""

    # Earley items in a row: a choice's items, a rule's alternatives, ~4 per property of a
    # JSON schema's object.
    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 50_000  # building the lexer, and the regex expressions it makes
    step_lexer_fuel: int = 50_000  # lexer work for one mask or token
    step_max_items: int = 20_000  # Earley items for one mask or token (forced tokens included)

    def parser_limits(self) -> llguidance.LLParserLimits:
        # Terse errors: no parser state or grammar dump in an error a client reads.
        return llguidance.LLParserLimits(**dataclasses.asdict(self), verbose_errors=False)

    def explain(self, error: str) -> str:
        """llguidance's error, with the limit it hit named (and its value)."""
        reason = error_text(error)
        for text, names in (("items; max is", ("max_items_in_row",)),
                            ("Too many items", ("step_max_items",)),
                            ("initial lexer configuration", ("initial_lexer_fuel",)),
                            ("too many expressions", ("initial_lexer_fuel", "step_lexer_fuel"))):
            if text in reason:
                named = ", ".join(f"{name}={getattr(self, name)}" for name in names)
                return f"{reason} (matcher limit {named})"
        return reason


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (dict or JSON text), a regular expression (Rust regex
    syntax), a list of choices (the output is one of them verbatim), a Lark grammar
    (llguidance's dialect), or json_object=True (any JSON object). `special_text_ids`: special
    tokens the grammar names that the output's text keeps (a tool call's markup, which the
    server's parser reads); other special tokens are skipped as always. `wrapper`: a Lark
    grammar the whole output matches instead, in which `@answer` is the spec's own grammar (the
    server's think block before a response format)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    special_text_ids: tuple[int, ...] = ()
    wrapper: str | None = None

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
        for name in ("regex", "grammar", "wrapper"):
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
        if not isinstance(self.special_text_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.special_text_ids):
            raise ValueError("structured_outputs.special_text_ids must be a list of token ids")
        self.special_text_ids = tuple(self.special_text_ids)

    @property
    def key(self) -> str:
        """The spec as canonical text: equal specs compile once."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) this spec constrains to."""
        grammars = self._grammars()
        if self.wrapper is not None:
            grammars[0]["name"] = "answer"  # what the wrapper's `@answer` names
            grammars = [{"lark_grammar": self.wrapper}, *grammars]
        return json.dumps({"grammars": grammars})

    def _grammars(self) -> list[dict]:
        m = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            text = m.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
        elif self.regex is not None:
            text = m.grammar_from_regex(self.regex)
        elif self.choice is not None:  # Lark string literals take JSON's escapes
            return [{"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in self.choice)}]
        else:
            return [{"lark_grammar": self.grammar}]
        return json.loads(text)["grammars"]


def error_text(error: str) -> str:
    """An llguidance error without the parser state dump (or its marker) that may follow it."""
    lines = []
    for line in error.strip().splitlines():
        if line.startswith(("<state>", "<non-verbose/>")):
            break
        lines.append(line)
    return "\n".join(lines).strip() or "unknown error"


class GrammarCompiler:
    """Admits specs as matchers for one tokenizer; each distinct spec is admitted (or refused)
    once (LRU). Thread-safe, so a server admits a request's grammar in a worker thread before
    the engine's step loop sees the request, which then finds it cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = GrammarLimits()):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = limits
        # spec key -> its matcher, or the reason it was refused
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # distinct specs compiled (cache misses)

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec's grammar in its start state, first mask computed (a prototype: sequences
        take deep copies); ValueError naming the problem when the schema, regex or grammar is
        invalid, matches no output, or hits a matcher limit (`admit`)."""
        key = hashlib.sha256(spec.key.encode()).hexdigest()  # a spec may be megabytes
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:
            try:
                entry = self.admit(spec)
            except ValueError as e:
                entry = str(e)
            with self._lock:
                self._cache[key] = entry
                self.compiled += 1
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry

    def admit(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """Compile under the limits, compute the first mask, refuse a grammar that matches no
        output, and feed up to PROBE_TOKENS allowed first tokens to copies (each with its next
        mask): the matcher, or ValueError naming why it cannot serve the spec."""
        try:
            grammar = spec.grammar_text()
        except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions
            raise ValueError(f"invalid structured output spec: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=self.limits.parser_limits())
        if matcher.is_error():
            raise ValueError("invalid structured output spec: "
                             + self.limits.explain(matcher.get_error()))
        mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        if matcher.is_error():
            reason = self.limits.explain(matcher.get_error())
            if reason == "NoExtensionBias":  # no byte extends the empty output, nor may it end
                raise ValueError(NO_OUTPUT)
            raise ValueError(f"structured output refused at its first token: {reason}")
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[:self.vocab_size])
        starts = [int(t) for t in allowed if int(t) not in self.eos_token_ids]
        if not starts and not matcher.is_accepting():
            raise ValueError(NO_OUTPUT)
        for i in sorted({(len(starts) - 1) * k // (PROBE_TOKENS - 1)
                         for k in range(PROBE_TOKENS)} if starts else ()):
            probe = matcher.deep_copy()
            if probe.consume_token(starts[i]):
                probe.compute_bitmask()
            if probe.is_error():
                raise ValueError("structured output refused at its first token: "
                                 + self.limits.explain(probe.get_error()))
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
            raise ValueError("output tokens do not match the grammar: "
                             + error_text(matcher.get_error()))
        seq.matcher = matcher
    return seq.matcher


def advance(seq, token: int) -> bool:
    """Feed a sampled token to the sequence's matcher; True when the grammar is complete (no
    token may follow). A token the matcher cannot take (a limit hit while it lexes or parses
    it; a token the grammar refuses, which the mask forbids) leaves the matcher in its error
    state, not complete: the engine fails the request alone (`grammar_error`)."""
    matcher = matcher_of(seq)
    return matcher.consume_token(token) and matcher.is_stopped()


def grammar_error(seq, limits: GrammarLimits) -> str | None:
    """Why the sequence's matcher failed (the limit named), or None if it has not."""
    matcher = seq.matcher
    if matcher is None or not matcher.is_error():
        return None
    return f"structured output failed: {limits.explain(matcher.get_error())}"


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
    plain = [(m, row) for m, row, drafts in matchers if not drafts]
    drafted = [entry for entry in matchers if entry[2]]
    if plain:
        llnp.fill_next_token_bitmask_par(_executor, plain, mask)
    if drafted:  # (llguidance refuses an empty draft list here)
        llnp.fill_next_token_bitmask_par_with_draft_tokens(_executor, drafted, mask)
    for matcher, _, _ in matchers:  # in error before or while filling: never sample its mask
        if matcher.is_error():
            raise ValueError(f"structured output failed: {error_text(matcher.get_error())}")
    for matcher, row, drafts in drafted:
        valid = valid_drafts(matcher, drafts)
        mask[row + valid + 1:row + len(drafts) + 1] = -1


def valid_drafts(matcher, drafts: list[int]) -> int:
    """How many of the drafts, from the first, the grammar accepts in its state now."""
    return matcher.validate_tokens(drafts) if drafts else 0


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
