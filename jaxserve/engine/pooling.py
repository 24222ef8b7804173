"""Pooling's one owner on the engine side (LoadConfig.runner "pooling", docs/pooling.md).

A pooling request is a prompt the scheduler prefills like any other (chunked across steps when
it is longer than a step's budget) and that samples nothing: its params ask for one token,
which the pooling runner (runtime/pooling.py) reports as 0 and the scheduler appends only to
finish the sequence. Each step's rows come back pooled per chunk; the Pooler combines a
sequence's chunks (the last chunk's last token; the sum of every chunk, in float32, divided at
the end; the first chunk's first token) and, once its prompt is computed, makes the request's
result: the classifier head's logits, or the embedding, L2-normalised where the model is.
Mean and CLS pooling read every token's hidden state, so their requests take no prefix-cache
hit (SamplingParams.skip_reading_prefix_cache); last-token pooling takes them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config.load import LoadConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import SequenceStatus
from jaxserve.core.step_plan import StepPlan
from jaxserve.weights import LoadedModel
from jaxserve.weights.pooling import PoolingSpec, read_pooling_spec


@dataclasses.dataclass
class PoolingOutput:
    """What LLM.embed / classify return per prompt: the engine's result (`data`), and what the
    call made of it (embedding; class logits, probabilities and label)."""

    request_id: str
    prompt_token_ids: list[int]
    data: np.ndarray  # f32: the embedding, or the class logits
    embedding: np.ndarray | None = None
    logits: np.ndarray | None = None
    probs: np.ndarray | None = None
    label: str | None = None


@dataclasses.dataclass
class _Partial:
    """A sequence's pooled chunks so far: its tokens before `end` are in (from its first
    chunk's start: 0, or a prefix hit's end for last-token pooling)."""

    end: int
    sum: np.ndarray | None = None  # f32[H]
    count: int = 0
    first: np.ndarray | None = None
    last: np.ndarray | None = None


def pooling_spec(loaded: LoadedModel, load: LoadConfig) -> PoolingSpec:
    """The checkpoint's PoolingSpec (weights/pooling.py) with the engine's flags over it; a
    classifier pools its last token (as transformers' *ForSequenceClassification)."""
    spec = read_pooling_spec(loaded.source)
    if spec.head is not None and load.pooling_type not in ("auto", "last"):
        raise ValueError(f"pooling_type {load.pooling_type!r}: a sequence classifier pools its "
                         "last token")
    if load.pooling_type != "auto":
        spec = dataclasses.replace(spec, pooling_type=load.pooling_type)
    if load.pooling_normalize != "auto":
        spec = dataclasses.replace(spec, normalize=load.pooling_normalize == "on")
    if load.classifier_from_tokens:
        tokens = [t for t in load.classifier_from_tokens.split(",") if t]
        spec = dataclasses.replace(spec, head=token_head(loaded, tokens), labels=(tokens[-1],),
                                   pooling_type="last")
    return spec


def token_head(loaded: LoadedModel, tokens: list[str]) -> np.ndarray:
    """A one-label head f32[1, H] from the language-model head's rows: tokens [false, true]
    give their difference (the logit of "true" against "false": softmax over the two is the
    sigmoid of it), one token its own row."""
    if len(tokens) not in (1, 2):
        raise ValueError(f"classifier_from_tokens takes one or two tokens, got {tokens}")
    ids = []
    for token in tokens:
        found = loaded.tokenizer.backend.token_to_id(token)
        encoded = loaded.tokenizer.encode(token, add_special_tokens=False)
        if found is None and len(encoded) != 1:
            raise ValueError(f"classifier_from_tokens: {token!r} is not one token of this "
                             f"model's vocabulary (it encodes as {encoded})")
        ids.append(found if found is not None else encoded[0])
    params = loaded.params
    rows = (np.asarray(params["lm_head"], np.float32)[:, ids].T if "lm_head" in params
            else np.asarray(params["embed"], np.float32)[ids])
    return (rows[-1] - rows[0] if len(ids) == 2 else rows[0])[None, :]


class Pooler:
    def __init__(self, spec: PoolingSpec, hidden_size: int):
        self.spec, self.hidden_size = spec, hidden_size
        if spec.head is not None and spec.head.shape[1:] != (hidden_size,):
            raise ValueError(f"the classifier head's shape {spec.head.shape} does not take the "
                             f"model's hidden size {hidden_size}")
        self._partial: dict[str, _Partial] = {}
        self._done: dict[str, np.ndarray] = {}

    def request_params(self, params: SamplingParams | None) -> SamplingParams:
        """A pooling request's params: one greedy token (the scheduler's end of its prompt),
        no prefix hits where every token's hidden state is read; the priority kept."""
        return SamplingParams(temperature=0, max_tokens=1, seed=0, ignore_eos=True,
                              priority=params.priority if params else 0,
                              skip_reading_prefix_cache=self.spec.pooling_type != "last")

    def record(self, plan: StepPlan, pooled: dict) -> None:
        """A step's pooled rows (runtime/pooling.pooled_rows, host copies), before the
        scheduler applies the plan: chunk i is row i (a pooling plan has no decode rows)."""
        if any(c.is_decode for c in plan.chunks):
            raise ValueError("a pooling step has prefill chunks only")
        kind = self.spec.pooling_type
        for row, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != chunk.start:
                continue  # overtaken since planning (aborted, failed, preempted)
            rid = seq.request.request_id
            part = self._partial.get(rid)
            if part is None or part.end != chunk.start:  # its first chunk, or a recomputation
                part = self._partial[rid] = _Partial(end=chunk.start)
            if kind == "mean":
                part.sum = pooled["sum"][row] + (0 if part.sum is None else part.sum)
                part.count += int(pooled["count"][row])
            if chunk.start == 0:
                part.first = pooled["first"][row]
            part.end = chunk.start + chunk.num_tokens
            if part.end == seq.num_prompt_tokens:
                part.last = pooled["last"][row]
                self._done[rid] = self._result(self._partial.pop(rid))

    def _result(self, part: _Partial) -> np.ndarray:
        kind = self.spec.pooling_type
        vector = {"last": part.last, "cls": part.first,
                  "mean": None if part.sum is None else part.sum / max(part.count, 1)}[kind]
        vector = np.asarray(vector, np.float32)
        if self.spec.head is not None:
            return self.spec.head @ vector
        return normalized(vector) if self.spec.normalize else vector

    def take(self, request_id: str) -> np.ndarray | None:
        """A finished request's result (None if it made none: failed or aborted); forgotten."""
        self._partial.pop(request_id, None)
        return self._done.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self.take(request_id)


def embedding_at(vector: np.ndarray, spec: PoolingSpec,
                 dimensions: int | None = None) -> np.ndarray:
    """A pooling engine's embedding at `dimensions` (Matryoshka: truncated, then normalised
    again where the model normalises); ValueError naming `dimensions` where it cannot."""
    if dimensions is None or dimensions == vector.shape[0]:
        return vector
    check_dimensions(spec, dimensions, vector.shape[0])
    vector = vector[:dimensions]
    return normalized(vector) if spec.normalize else vector


def check_dimensions(spec: PoolingSpec, dimensions, size: int) -> None:
    """ValueError naming `dimensions` unless the model's embeddings truncate to it."""
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
    if dimensions == size:
        return
    if not spec.matryoshka:
        raise ValueError("dimensions: this model does not declare Matryoshka embeddings "
                         "(config.json's matryoshka_dimensions or is_matryoshka), so its "
                         f"embeddings are only of their full size {size}")
    allowed = spec.matryoshka_dimensions
    if (allowed and dimensions not in allowed) or dimensions > size:
        raise ValueError(f"dimensions must be one of {sorted(allowed) if allowed else size} "
                         f"(up to {size}), got {dimensions}")


def normalized(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / max(norm, 1e-12)


def sigmoid(logit: float) -> float:
    """A one-label classifier's score of a pair (sentence-transformers' CrossEncoder)."""
    return float(1.0 / (1.0 + np.exp(-logit)))


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()
