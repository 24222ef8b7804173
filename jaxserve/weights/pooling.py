"""What a checkpoint says of pooling (the pooling runner's model side, engine/pooling.py):
sentence-transformers' modules (`modules.json`: a Pooling module's `config.json` names last
token, mean or CLS pooling; a Normalize module L2-normalises), Matryoshka dimensions
(config.json's `matryoshka_dimensions` or `is_matryoshka`), and a sequence classifier's head
(`*ForSequenceClassification`: the `score` tensor [num_labels, H], its `id2label`).
A checkpoint without them (GGUF, a plain causal LM) pools its last token and normalises, as
decoder embedding models do."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling modes -> our pooling type: its config's "pooling_mode"
# (sentence-transformers 6), or one true flag "pooling_mode_<mode>" (earlier versions).
_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls",
             "cls": "cls"}


def causal_lm_name(architecture: str) -> str:
    """The causal LM of a sequence classifier (its decoder and a score head, read here) or of
    a bare decoder (*Model, as sentence-transformers saves one): hf_loader loads it as that."""
    if architecture.endswith("Model") and "For" not in architecture:
        return architecture[:-len("Model")] + "ForCausalLM"
    return architecture.replace("ForSequenceClassification", "ForCausalLM")


def pooling_only(directory: str | None) -> str | None:
    """The architecture of a checkpoint without a language-model head (a sequence classifier,
    a bare decoder), which only the pooling runner serves; None for any other."""
    from jaxserve.weights.hf_loader import _ARCHITECTURES

    path = os.path.join(directory or "", "config.json")
    if directory is None or not os.path.isfile(path):
        return None
    archs = _json(path).get("architectures") or []
    return next((a for a in archs if a not in _ARCHITECTURES
                 and causal_lm_name(a) in _ARCHITECTURES), None)


@dataclasses.dataclass(frozen=True)
class PoolingSpec:
    """How a pooling engine turns a sequence's hidden states into its output."""

    pooling_type: str = "last"  # POOLING_TYPES
    normalize: bool = True  # L2-normalise embeddings
    # Matryoshka: the embedding may be truncated to these sizes (() with matryoshka: any size).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    head: np.ndarray | None = dataclasses.field(default=None, repr=False)  # f32[labels, H]
    labels: tuple[str, ...] = ()  # the head's class names, by index

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, "
                             f"got {self.pooling_type!r}")

    @property
    def task(self) -> str:
        """"classify" for a model with a classification head, else "embed"."""
        return "classify" if self.head is not None else "embed"


def _json(path: str) -> dict:
    from jaxserve.weights import ModelFileError

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not JSON: {e}") from None
    if not isinstance(value, dict | list):
        raise ModelFileError(f"{path} is not a JSON object or list")
    return value


def _sentence_transformers(directory: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from modules.json and its Pooling module's config; Nones
    where the directory has no modules.json."""
    from jaxserve.weights import ModelFileError

    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None, None
    modules = _json(path)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
             if isinstance(m, dict)}
    pooling_type = None
    if "Pooling" in kinds:
        config = _json(os.path.join(directory, kinds["Pooling"].get("path", ""), "config.json"))
        modes = ([config["pooling_mode"]] if isinstance(config.get("pooling_mode"), str) else
                 [k[len("pooling_mode_"):] for k, v in config.items()
                  if k.startswith("pooling_mode_") and v is True])
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            raise ModelFileError(f"{path}: pooling mode {modes} is not supported (one of "
                                 f"{sorted(_ST_MODES)})")
        pooling_type = _ST_MODES[modes[0]]
    return pooling_type, "Normalize" in kinds


def read_pooling_spec(directory: str | None) -> PoolingSpec:
    """The PoolingSpec of a Hugging Face directory (anything else: the defaults)."""
    if directory is None or not os.path.isdir(directory):
        return PoolingSpec()
    pooling_type, normalize = _sentence_transformers(directory)
    config_path = os.path.join(directory, "config.json")
    config = _json(config_path) if os.path.isfile(config_path) else {}
    dims = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    head, labels = None, ()
    score = _score_head(directory)
    if score is not None:
        head = score
        id2label = config.get("id2label") or {}
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                       for i in range(head.shape[0]))
    return PoolingSpec(pooling_type=pooling_type or "last",
                       normalize=True if normalize is None else normalize,
                       matryoshka=bool(dims) or bool(config.get("is_matryoshka")),
                       matryoshka_dimensions=dims, head=head, labels=labels)


def _score_head(directory: str) -> np.ndarray | None:
    """A sequence classifier's `score.weight` [num_labels, H] (float32) from the directory's
    safetensors, or None."""
    from jaxserve.weights.hf_loader import is_hf_dir, read_safetensors, safetensors_files

    if not is_hf_dir(directory):
        return None
    for path in safetensors_files(directory):
        tensors = read_safetensors(path, float_dtype=None)
        if "score.weight" in tensors:
            return np.array(tensors["score.weight"], np.float32)
    return None
