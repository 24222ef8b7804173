"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's shape)."""

from __future__ import annotations

import dataclasses
import math
import numbers

from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.tokenizer import check_unicode

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 1e4  # beyond it every distribution is uniform to float32
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token
MAX_REPETITION_PENALTY = 10.0
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # a signed 64-bit seed (vLLM's range)


class InvalidParam(ValueError):
    """A field out of its type or range; `param` names it (the API's error carries it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _token_key(key) -> int:
    """A logit_bias key: an int, or a string of ASCII decimal digits as JSON object keys arrive
    (Python's int() would also take " 12 ", "1_0" and other scripts' digits)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    raise InvalidParam("logit_bias", f"logit_bias keys must be token ids (decimal integers), "
                                     f"got {key!r}")


def seed_words(seed: int) -> tuple[int, int]:
    """A seed as the two 32-bit words of its device key (high, low): seed mod 2**64, one-to-one
    on [SEED_MIN, SEED_MAX], and (0, seed) for 0 <= seed < 2**32 as jax.random.key(seed)."""
    seed %= 2**64
    return seed >> 32, seed & 0xFFFFFFFF


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (echo scoring)
    priority: int = 0  # lower runs first under scheduling_policy="priority"
    # Logit controls (OpenAI's and vLLM's rules), applied on device before temperature: a
    # token's logit gets + logit_bias[token]; - presence_penalty if the token is in the output
    # so far, - frequency_penalty times its count there; and, if it is in the prompt or the
    # output, is divided by repetition_penalty when positive (multiplied when negative).
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    # Compute every prompt token, taking no prefix-cache hit (pooling that reads every token's
    # hidden state: mean and CLS, engine/pooling.py); its full pages are still cached for others.
    skip_reading_prefix_cache: bool = False

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:  # JSON object keys arrive as strings
            if not isinstance(self.logit_bias, dict):
                raise InvalidParam("logit_bias", "logit_bias maps token ids to biases")
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.logit_bias = self.logit_bias or None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """InvalidParam (a ValueError naming the field) unless every field is of its type and in
        range: integers that reach int32 arrays fit them, floats are finite (NaN and infinities
        are refused)."""
        def integer(name, lo, hi=INT32_MAX, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or not lo <= value <= hi:
                raise InvalidParam(name, f"{name} must be an integer in [{lo}, {hi}], got "
                                         f"{value!r}")

        def real(name, lo, hi, lo_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or not (lo < value if lo_open else lo <= value) \
                    or value > hi:
                interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise InvalidParam(name, f"{name} must be a finite number in {interval}, got "
                                         f"{value!r}")

        integer("n", 1)
        real("temperature", 0.0, MAX_TEMPERATURE)
        real("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", 0)
        real("min_p", 0.0, 1.0)
        integer("max_tokens", 1, optional=True)
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("seed", SEED_MIN, SEED_MAX, optional=True)
        integer("priority", -INT32_MAX, INT32_MAX)
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        real("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token <= INT32_MAX or isinstance(bias, bool) \
                    or not isinstance(bias, numbers.Real) or not math.isfinite(bias) \
                    or abs(bias) > MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias maps token ids >= 0 to finite "
                                   f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                                   f"{token!r}: {bias!r}")
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParam("structured_outputs",
                               "structured_outputs must be StructuredOutputsParams")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty strings")
        for s in self.stop:
            try:
                check_unicode(s, "a stop string")
            except ValueError as e:
                raise InvalidParam("stop", str(e)) from None
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                   and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1

    @property
    def has_logit_controls(self) -> bool:
        """Whether the step must change this request's logits before sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.structured_outputs is not None

    @property
    def needs_previous_token(self) -> bool:
        """Whether a step's logit controls depend on the token sampled by the step before
        (penalties count it, a grammar advances over it): such rows are not planned ahead."""
        return self.has_penalties or self.structured_outputs is not None
