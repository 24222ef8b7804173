"""PEFT LoRA adapters read for serving: a directory of adapter_config.json and
adapter_model.safetensors -> LoRAWeights, per layer and projection A f[R, in] and B f[R, out]
(B^T, scaled by lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), padded with zeros to
the engine's max_lora_rank. The projections are PEFT's q, k, v, o, gate, up and down; an
untargeted one is zeros. What is not served is refused by name when read: DoRA, embedding or
head adapters, modules_to_save, rank or alpha patterns, LoRA biases, a rank above
max_lora_rank, and an adapter of another base (layer count, projection shapes)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import numpy as np

from jaxserve.config import ModelConfig

# PEFT's module names of the Llama family's projections, in our fused weights' order:
# w_qkv = q | k | v, wo = o, w_gate_up = gate | up, w_down = down.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served over this model; the message names why."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-targetable projection of one layer."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, i = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """One adapter in the serving layout: layers[l][module] = (A f32[R, in], B f32[R, out]),
    R = max_lora_rank, scale folded into B; every module present (zeros where untargeted)."""

    rank: int
    scale: float
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]
    fingerprint: str  # blake2b of the config and tensors as stored: its prefix-cache key


def _refuse(path: str, why: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {why}")


def _check_config(path: str, config: dict, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = {"use_dora": "DoRA (use_dora) is not supported",
               "modules_to_save": "modules_to_save (fully trained modules) is not supported",
               "rank_pattern": "rank_pattern (per-module ranks) is not supported",
               "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
               "lora_bias": "LoRA biases (lora_bias) are not supported",
               "layer_replication": "layer_replication is not supported",
               "target_parameters": "target_parameters is not supported"}
    for name, why in refused.items():
        if config.get(name):
            raise _refuse(path, why)
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias {config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules") or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    for name in ("embed_tokens", "lm_head"):
        if any(name in t for t in targets):
            raise _refuse(path, f"an adapter on {name} (target_modules) is not supported: "
                          f"only {', '.join(LORA_MODULES)}")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise _refuse(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _refuse(path, f"rank r={r} exceeds max_lora_rank={max_rank}")


def read_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoRAWeights:
    """The PEFT adapter directory `path` for the base `cfg`, padded to max_rank (see the
    module docstring); LoRAAdapterError naming what it cannot serve. The tensors are read by
    the checkpoint loader's safetensors reader (bfloat16 included)."""
    from jaxserve.weights.hf_loader import read_safetensors

    config_file = os.path.join(path, "adapter_config.json")
    tensors_file = os.path.join(path, "adapter_model.safetensors")
    for f in (config_file, tensors_file):
        if not os.path.isfile(f):
            raise _refuse(path, f"{os.path.basename(f)} not found (a PEFT adapter directory "
                          "holds adapter_config.json and adapter_model.safetensors)")
    with open(config_file, "rb") as f:
        config_bytes = f.read()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise _refuse(path, f"adapter_config.json is not JSON: {e}") from None
    _check_config(path, config, max_rank)
    if cfg.num_experts:
        raise _refuse(path, "adapters over a mixture of experts are not supported")
    r = config["r"]
    alpha = config.get("lora_alpha", 8)
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    shapes = module_shapes(cfg)
    layers = [{m: (np.zeros((max_rank, i), np.float32), np.zeros((max_rank, o), np.float32))
               for m, (i, o) in shapes.items()} for _ in range(cfg.num_layers)]
    h = hashlib.blake2b(config_bytes, digest_size=16)
    for key, value in read_safetensors(tensors_file, digest=h).items():
        match = _KEY.search(key)
        if match is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A or B of "
                          f"{', '.join(LORA_MODULES)} (embedding, head, DoRA magnitude and "
                          "modules_to_save tensors are not supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise _refuse(path, f"tensor {key!r}: module {module} is not one of "
                          f"{', '.join(LORA_MODULES)}")
        if layer >= cfg.num_layers:
            raise _refuse(path, f"tensor {key!r}: layer {layer} of a base model with "
                          f"{cfg.num_layers} layers (an adapter of another base)")
        fan_in, fan_out = shapes[module]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if value.shape != want:
            raise _refuse(path, f"tensor {key!r} has shape {tuple(value.shape)}, expected "
                          f"{want} for this base model (an adapter of another base?)")
        a, b = layers[layer][module]
        value = np.asarray(value, np.float32)
        if which == "A":
            a[:r] = value
        else:
            b[:r] = value.T * scale
    return LoRAWeights(rank=r, scale=scale, layers=layers, fingerprint=h.hexdigest())
