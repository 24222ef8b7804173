"""Benchmark workloads: a frozen, seeded spec -> a list of requests with exact lengths.

A workload states what docs/design.md's evaluation protocol asks to publish: the arrival process,
the prompt and output length distributions, shared-prefix groups and the stop condition (ignore_eos,
so every request generates exactly its output length). Prompts are random token ids, so prompt
lengths are exact and no tokenizer is involved.

    spec = WorkloadSpec.from_json("configs/bench_default.json")   # or WorkloadSpec(...) / from_dict
    requests = spec.generate(vocab_size=49152)                     # same seed -> same requests

Length distributions are written as strings or dicts: "128", "uniform:16:256", "normal:128:32",
"list:37,91,128" (cycled in order), or {"kind": "uniform", "low": 16, "high": 256}.
Arrivals: "inf"/all-at-once, Poisson with `request_rate` (exponential gaps, mean 1/rate), or gamma
gaps with shape `burstiness` and the same mean (burstiness 1 == Poisson; < 1 burstier, > 1 smoother).
A shared-prefix group is `prefix_group_size` consecutive requests whose prompts start with the same
`shared_prefix_len` tokens (a system prompt); `input_len` counts the tokens after that prefix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "normal", "list")
ARRIVALS = ("all", "poisson", "gamma")
TOKEN_ID_LOW = 1000  # keeps random prompts clear of special/control tokens at the low ids

__all__ = ["LengthDist", "WorkloadSpec", "BenchRequest", "LENGTH_KINDS", "ARRIVALS"]


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths."""

    kind: str = "fixed"
    value: int = 128  # fixed
    low: int = 1  # uniform, inclusive bounds; also the clip range of normal
    high: int = 1
    mean: float = 0.0  # normal (rounded, clipped to [max(1, low), high or +inf])
    std: float = 0.0
    values: tuple[int, ...] = ()  # list, cycled in request order

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        check(self.kind in LENGTH_KINDS, f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind == "fixed":
            check(self.value >= 1, f"fixed length must be >= 1, got {self.value}")
        elif self.kind == "uniform":
            check(1 <= self.low <= self.high, f"uniform needs 1 <= low <= high, got {self.low}..{self.high}")
        elif self.kind == "normal":
            check(self.mean >= 1 and self.std >= 0, f"normal needs mean >= 1 and std >= 0, got "
                                                    f"{self.mean}, {self.std}")
        else:
            check(bool(self.values) and all(v >= 1 for v in self.values),
                  f"list lengths must be non-empty and >= 1, got {self.values}")

    @classmethod
    def parse(cls, spec: "str | int | dict | LengthDist") -> "LengthDist":
        if isinstance(spec, LengthDist):
            return spec
        if isinstance(spec, int):
            return cls("fixed", value=spec)
        if isinstance(spec, dict):
            d = dict(spec)
            if "values" in d:
                d["values"] = tuple(int(v) for v in d["values"])
            return cls(**d)
        text = str(spec).strip()
        kind, _, rest = text.partition(":")
        try:
            if not rest:
                return cls("fixed", value=int(kind))
            if kind == "fixed":
                return cls("fixed", value=int(rest))
            if kind == "uniform":
                low, high = rest.split(":")
                return cls("uniform", low=int(low), high=int(high))
            if kind == "normal":
                parts = rest.split(":")
                mean, std = float(parts[0]), float(parts[1])
                high = int(parts[2]) if len(parts) > 2 else 0
                return cls("normal", mean=mean, std=std, low=1, high=high or 1)
            if kind == "list":
                return cls("list", values=tuple(int(v) for v in rest.split(",") if v))
        except (ValueError, IndexError) as e:
            raise ValueError(f"bad length spec {text!r}: {e}") from None
        raise ValueError(f"bad length spec {text!r}: use N, uniform:LO:HI, normal:MEAN:STD[:MAX] "
                         f"or list:A,B,C")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.value] * n
        if self.kind == "uniform":
            return [int(v) for v in rng.integers(self.low, self.high + 1, size=n)]
        if self.kind == "normal":
            upper = self.high if self.high > 1 else math.inf
            raw = np.rint(rng.normal(self.mean, self.std, size=n))
            return [int(min(max(v, max(1, self.low)), upper)) for v in raw]
        return [self.values[i % len(self.values)] for i in range(n)]

    @property
    def max(self) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return self.high
        if self.kind == "list":
            return max(self.values)
        return self.high if self.high > 1 else int(self.mean + 6 * self.std)

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.value)
        if self.kind == "uniform":
            return f"uniform {self.low}..{self.high}"
        if self.kind == "normal":
            return f"normal(mean {self.mean:g}, std {self.std:g})"
        return f"list {','.join(map(str, self.values))}"


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_offset: float  # seconds after the run starts
    prefix_group: int = -1  # -1: no shared prefix

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str = "custom"
    num_prompts: int = 32
    request_rate: float = math.inf  # requests/s; inf = all at once
    arrival: str = "poisson"  # with a finite rate: poisson or gamma; ignored when rate is inf
    burstiness: float = 1.0  # gamma shape
    input_len: LengthDist = LengthDist("fixed", value=64)
    output_len: LengthDist = LengthDist("fixed", value=32)
    shared_prefix_len: int = 0
    prefix_group_size: int = 1  # requests per shared prefix (k)
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    num_warmup: int = 2  # warm-up requests (same length distributions, another seed), untimed

    def __post_init__(self):
        object.__setattr__(self, "input_len", LengthDist.parse(self.input_len))
        object.__setattr__(self, "output_len", LengthDist.parse(self.output_len))
        object.__setattr__(self, "request_rate", float(self.request_rate))

        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        check(self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}")
        check(self.request_rate > 0, f"request_rate must be > 0 (inf = all at once), got "
                                     f"{self.request_rate}")
        check(self.arrival in ARRIVALS, f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        check(self.burstiness > 0, f"burstiness must be > 0, got {self.burstiness}")
        check(self.shared_prefix_len >= 0, "shared_prefix_len must be >= 0")
        check(self.prefix_group_size >= 1, "prefix_group_size must be >= 1")
        check(self.num_warmup >= 0, "num_warmup must be >= 0")
        check(self.temperature >= 0, "temperature must be >= 0")

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkloadSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"description"})
        if unknown:
            raise ValueError(f"unknown workload field(s) {unknown}; known: {sorted(known)}")
        d = {k: v for k, v in d.items() if k in known}
        if isinstance(d.get("request_rate"), str):
            d["request_rate"] = float(d["request_rate"])
        return cls(**d)

    @classmethod
    def from_json(cls, path: str) -> "WorkloadSpec":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        for key in ("input_len", "output_len"):
            d[key] = {k: v for k, v in d[key].items()
                      if k == "kind" or v != getattr(LengthDist(), k)}
            if "values" in d[key]:
                d[key]["values"] = list(d[key]["values"])
        return d

    def replace(self, **changes: Any) -> "WorkloadSpec":
        return dataclasses.replace(self, **changes)

    @property
    def all_at_once(self) -> bool:
        return math.isinf(self.request_rate) or self.arrival == "all"

    @property
    def max_total_len(self) -> int:
        """Longest prompt + output a request of this workload can have."""
        return self.shared_prefix_len + self.input_len.max + self.output_len.max

    def describe(self) -> str:
        if self.all_at_once:
            arrivals = "all at once"
        elif self.arrival == "gamma":
            arrivals = f"gamma, {self.request_rate:g} req/s, burstiness {self.burstiness:g}"
        else:
            arrivals = f"Poisson, {self.request_rate:g} req/s"
        prefix = (f", shared prefix {self.shared_prefix_len} tokens per {self.prefix_group_size} "
                  f"requests" if self.shared_prefix_len else "")
        return (f"{self.num_prompts} requests, {arrivals}; prompt {self.input_len.describe()}"
                f"{prefix}; output {self.output_len.describe()}; "
                f"{'ignore_eos' if self.ignore_eos else 'stop at EOS'}, temperature "
                f"{self.temperature:g}; seed {self.seed}; {self.num_warmup} warm-up requests")

    # ---- sampling ----------------------------------------------------------------------------
    def arrival_offsets(self, rng: np.random.Generator, n: int) -> list[float]:
        if self.all_at_once:
            return [0.0] * n
        mean_gap = 1.0 / self.request_rate
        if self.arrival == "gamma":
            gaps = rng.gamma(self.burstiness, mean_gap / self.burstiness, size=n)
        else:
            gaps = rng.exponential(mean_gap, size=n)
        gaps[0] = 0.0  # the first request starts the clock
        return [float(t) for t in np.cumsum(gaps)]

    def generate(self, vocab_size: int, *, warmup: bool = False) -> list[BenchRequest]:
        """The requests (or the warm-up requests), identical for the same spec and vocab size."""
        if vocab_size <= TOKEN_ID_LOW + 1:
            raise ValueError(f"vocab_size must be > {TOKEN_ID_LOW + 1}, got {vocab_size}")
        n = self.num_warmup if warmup else self.num_prompts
        rng = np.random.default_rng([self.seed, 1 if warmup else 0])
        inputs = self.input_len.sample(rng, n)
        outputs = self.output_len.sample(rng, n)
        offsets = [0.0] * n if warmup else self.arrival_offsets(rng, n)
        prefixes: dict[int, list[int]] = {}
        requests = []
        for i in range(n):
            group = i // self.prefix_group_size if self.shared_prefix_len else -1
            if group >= 0 and group not in prefixes:
                prefixes[group] = rng.integers(TOKEN_ID_LOW, vocab_size,
                                               size=self.shared_prefix_len).tolist()
            body = rng.integers(TOKEN_ID_LOW, vocab_size, size=inputs[i]).tolist()
            ids = tuple(int(t) for t in prefixes.get(group, []) + body)
            requests.append(BenchRequest(i, ids, outputs[i], offsets[i], group))
        return requests
