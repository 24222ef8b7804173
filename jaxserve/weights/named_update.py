"""Named tensors of an update (`LLMEngine.update_weights`) -> the loaders' layout, by the loader's
own conversion (hf_loader.params_from_hf_state_dict: names, transposes, shape checks, expert
stacking, dtype), unit by unit: a unit is one decoder layer, or the leaves outside the layers
(embedding, final norm, untied head). A layer's weights are fused for the step (q/k/v, gate/up),
so a partial update gives whole units; one that names part of a unit is refused with the names
it lacks. Arrays may be numpy, JAX or torch."""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator, Mapping

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.weights.hf_loader import (_BIAS_KEYS, _LAYER_KEYS, _QK_NORM_KEYS,
                                        params_from_hf_state_dict)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class _Absent(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def host_array(x) -> np.ndarray:
    """numpy, JAX or torch (bfloat16 widened to float32, exactly) -> numpy."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class _Named(Mapping):
    """The update's tensors as the conversion reads a checkpoint: every name "is there"; one
    the update lacks reads as _Absent inside a layer, or as zeros outside them (the conversion
    reads those at once; an update without them never uses the zeros)."""

    def __init__(self, given: dict, config: ModelConfig):
        self.given, v, h = given, config.vocab_size, config.hidden_size
        self.top_shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                           "lm_head.weight": (v, h)}

    def __contains__(self, name) -> bool:
        return True

    def __getitem__(self, name: str):
        if name in self.given:
            return lambda: host_array(self.given[name])
        if _LAYER.match(name) or name not in self.top_shapes:
            def absent():
                raise _Absent(name)
            return absent
        return lambda: np.broadcast_to(np.float32(0), self.top_shapes[name])

    def __iter__(self):
        return iter(self.given)

    def __len__(self) -> int:
        return len(self.given)


@dataclasses.dataclass
class NamedUpdate:
    """The units an update gives, in the loaders' layout (numpy in the loaders' dtype)."""

    layers: dict[int, dict]  # layer index -> that layer's weights (llama.layer_of's dict)
    top: dict | None  # the leaves outside the layers, None when not given
    num_layers: int

    @property
    def full(self) -> bool:
        return self.top is not None and len(self.layers) == self.num_layers


def convert_named(config: ModelConfig, named: Iterable[tuple[str, object]] | Mapping,
                  dtype=np.float32) -> NamedUpdate:
    """Convert (name, array) pairs in the checkpoint's names and layout. Raises ValueError for a
    name the model does not use (the loader's check), a wrong shape, or a unit given in part."""
    given = dict(named.items() if isinstance(named, Mapping) else named)
    if not given:
        raise ValueError("update_weights got no tensors")
    if config.architecture == "gpt_oss":  # its experts' tensors are regrouped first
        raise ValueError("gpt-oss weights are not updated by name yet: give the engine's own "
                         "layout (params_like)")
    params = params_from_hf_state_dict(config, _Named(given, config), dtype, lazy=True)
    touched = sorted({int(m.group(1)) for m in map(_LAYER.match, given) if m})
    layers, missing = {}, []
    for i in touched:
        layer = {}
        for key, stack in params["layers"].items():
            try:
                value = stack[i]
            except _Absent as e:
                missing.append(e.name)
                continue
            if value is not None:  # a mixture's dense MLP at a sparse layer reads None
                layer[key] = np.asarray(value)
        layers[i] = layer
    top_names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        top_names.append("lm_head.weight")
    top = None
    if any(n in given for n in top_names):
        missing += [n for n in top_names if n not in given]
        top = {k: v for k, v in params.items() if k != "layers"}
    if missing:
        raise ValueError(
            "a partial weight update gives whole units (a decoder layer, or the embedding, final "
            "norm and untied head together), as the step fuses them; missing: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return NamedUpdate(layers, top, config.num_layers)


def hf_named(config: ModelConfig, params: dict) -> Iterator[tuple[str, np.ndarray]]:
    """The loaders' layout -> (name, array) in a Hugging Face checkpoint's names and layout
    (views, no copies), the inverse of the conversion for dense Llama-family models: what a
    trainer that holds the loaders' layout gives update_weights."""
    if config.num_experts or config.sandwich_norms or config.architecture == "gpt_oss":
        raise ValueError("hf_named covers dense Llama-family layers only")
    keys = dict(_LAYER_KEYS)
    for present, extra in ((config.attention_bias, _BIAS_KEYS), (config.qk_norm, _QK_NORM_KEYS)):
        keys.update({k: (v, False) for k, v in extra.items()} if present else {})
    yield "model.embed_tokens.weight", np.asarray(params["embed"])
    yield "model.norm.weight", np.asarray(params["final_norm"])
    if "lm_head" in params:
        yield "lm_head.weight", np.asarray(params["lm_head"]).T
    for key, (suffix, transposed) in keys.items():
        stacked = params["layers"][key]
        for i in range(config.num_layers):
            w = np.asarray(stacked[i])
            yield f"model.layers.{i}.{suffix}", w.T if transposed else w
