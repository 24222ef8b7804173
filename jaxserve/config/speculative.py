"""Speculative decoding as requested (SpeculativeConfig); its flags keep their own names
(--speculative_method, --num_speculative_tokens, --speculative_model, ...)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import option

SPECULATIVE_METHODS = ("ngram", "draft")
DRAFT_QUANTIZATIONS = ("none", "int8")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al.): each step proposes up to num_speculative_tokens
    tokens per decoding sequence and the target model verifies them in one chunk; the output is
    the target's own (greedy: token for token; sampled: the same distribution, and the same
    tokens for a seed). "ngram": prompt lookup, the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). "draft": a smaller model sharing the target's tokenizer (`model`; None
    or the target's own name: the target's weights, as self-speculation with
    quantization="int8") proposes greedily, one token after another."""

    method: str = option("ngram", "Speculative decoding (off unless this or "
                         "--num_speculative_tokens is given); ngram: prompt lookup; draft: a "
                         "draft model (--speculative_model).", choices=SPECULATIVE_METHODS,
                         flag="speculative_method", switch=True)
    num_speculative_tokens: int = option(
        4, f"Drafts per sequence and step, 1..{MAX_SPECULATIVE_TOKENS}.", switch=True)
    prompt_lookup_min: int = option(2, "Shortest n-gram matched (ngram).")
    prompt_lookup_max: int = option(4, "Longest n-gram matched (ngram).")
    # "draft": name or path; None: the target's own weights.
    model: str | None = option(None, "Draft model (method draft) sharing the target's tokenizer; "
                               "default: the target's own weights (self-speculation, with "
                               "--speculative_quantization=int8).", flag="speculative_model")
    quantization: str = option("none", "The draft model's weights (method draft).",
                               choices=DRAFT_QUANTIZATIONS, flag="speculative_quantization")
    # Choose the drafts per step from measured costs (0 where speculation does not pay, as in
    # a large batch on hardware whose step time grows with its tokens); False: always k.
    adaptive: bool = option(True, "Choose drafts per step from measured step costs (off: "
                            "always k).", flag="speculative_adaptive")

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..."
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive must be a bool, got {self.adaptive!r}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {DRAFT_QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.method != "draft" and (self.model is not None or self.quantization != "none"):
            raise ValueError(f"a speculative model and quantization belong to method 'draft', "
                             f"not {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {lo!r} and {hi!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig, or a dict of its fields (unknown names are errors), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got "
                             f"{type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)
