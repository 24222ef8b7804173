"""Hugging Face checkpoints: config.json -> ModelConfig, *.safetensors -> params layout.

Safetensors files are read with a small header parser over a memory map (F32/F16/BF16 and
the integer types), so BF16 checkpoints load without torch and nothing is copied twice.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.weights import gpt_oss
from jaxserve.weights.layer_stack import LayerStack
from jaxserve.weights.pooling import causal_lm_name

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # model_type names that differ from ours
_GEMMAS = ("gemma", "gemma2", "gemma3")
# Hugging Face activation names -> ModelConfig.mlp_activation ("gelu" in a Gemma config is a
# legacy name of the tanh approximation, as transformers reads it).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Every layer windowed unless layer_types says otherwise (Mistral); Gemma 2 alternates
# sliding and full layers; Gemma 3 has one full layer in sliding_window_pattern.
_DEFAULT_USE_WINDOW = ("mistral", "mixtral", "gemma2", "gemma3", "gpt_oss")
_EVERY_LAYER_WINDOWED = ("mistral", "mixtral", "qwen3_moe")  # a window applies to all layers
# Mixtures of experts: HF names of a sparse layer's router and of expert e's gate, up and down.
_MOE_TENSORS = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "gpt_oss": gpt_oss.MOE_TENSORS,  # made from its stacked (maybe MXFP4) experts
}


def _architecture(c: dict) -> str:
    archs = [causal_lm_name(a) for a in c.get("architectures") or []]
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = _MODEL_TYPES.get(c.get("model_type"), c.get("model_type"))
    if model_type in _ARCHITECTURES.values():
        return model_type
    raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                     f"{sorted(_ARCHITECTURES)}")


def _layer_types(c: dict, arch: str, num_layers: int) -> tuple[int | None, tuple | None]:
    """(sliding window, per-layer types or None) from config.json."""
    window = c.get("sliding_window")
    if not window or not c.get("use_sliding_window", arch in _DEFAULT_USE_WINDOW):
        return None, None
    types = c.get("layer_types")
    if types is None and arch == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(num_layers)]
    elif types is None and arch == "gemma3":
        pattern = int(c.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(num_layers)]
    elif types is None and arch not in _EVERY_LAYER_WINDOWED:  # Qwen2's: from max_window_layers
        first = int(c.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(num_layers)]
    return int(window), None if types is None else tuple(types)


def _rope_parameters(c: dict) -> tuple[dict, dict | None]:
    """(the full-attention layers' rope parameters, the sliding layers' where config.json gives
    them per layer type, as transformers 5 writes Gemma 3's)."""
    rope_params = c.get("rope_parameters") or {}
    if "full_attention" in rope_params:
        return rope_params["full_attention"] or {}, rope_params.get("sliding_attention") or {}
    return rope_params, None


def decoder_fields(c: dict, architecture: str) -> dict:
    """config.json's fields every Llama-shaped decoder has -> ModelConfig's: sizes, rope base,
    norm epsilon, context length, tied head, BOS and EOS ids (a KeyError names a missing one).
    The one reading of them, for the built-in architectures (config_from_hf) and
    register_model's (custom.read_config)."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    eos, bos = c.get("eos_token_id"), c.get("bos_token_id")
    return dict(
        vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        rope_theta=float(c.get("rope_theta") or _rope_parameters(c)[0].get("rope_theta",
                                                                           10000.0)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])
                            if e is not None),
        architecture=architecture)


def config_from_hf(config_json: dict) -> ModelConfig:
    """A Hugging Face config.json (as a dict) of a supported architecture -> ModelConfig."""
    c = config_json
    arch = _architecture(c)
    fields = decoder_fields({"tie_word_embeddings": arch in _GEMMAS, **c}, arch)  # Gemma: tied
    num_layers, max_pos = fields["num_layers"], fields["max_position_embeddings"]
    rope_params, local_rope = _rope_parameters(c)
    rope_scaling = _rope_scaling(c.get("rope_scaling") or rope_params, max_pos)
    local_theta = None
    if arch == "gemma3":
        local_rope = local_rope or {}
        if _rope_scaling(local_rope, max_pos) is not None:
            raise ValueError("rope scaling of sliding layers is not supported (Gemma 3 scales "
                             "its full-attention layers only)")
        local_theta = float(local_rope.get("rope_theta", c.get("rope_local_base_freq", 1e4)))
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal decoder)")
    act_name = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    if arch in _GEMMAS and act_name == "gelu":
        act_name = "gelu_pytorch_tanh"
    if act_name not in _ACTIVATIONS:
        raise ValueError(f"activation {act_name!r} is not supported (supported: "
                         f"{sorted(_ACTIVATIONS)})")
    window, layer_types = _layer_types(c, arch, num_layers)
    bias = True if arch == "qwen2" else bool(c.get("attention_bias", False))
    gemma = arch in _GEMMAS
    later_gemma = arch in ("gemma2", "gemma3")

    def optional(name):
        return None if c.get(name) is None else float(c[name])

    return ModelConfig(
        **fields,
        attention_bias=bias,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        rope_scaling=rope_scaling,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        mlp_activation=_ACTIVATIONS[act_name],
        embed_scale=gemma,
        norm_weight_offset=1.0 if gemma else 0.0,
        sandwich_norms=later_gemma,
        query_pre_attn_scalar=optional("query_pre_attn_scalar") if later_gemma else None,
        attn_logit_softcapping=optional("attn_logit_softcapping"),
        final_logit_softcapping=optional("final_logit_softcapping"),
        **_experts(c, arch),
        **(gpt_oss.config_fields(c) if arch == "gpt_oss" else {}),
    )


def _experts(c: dict, arch: str) -> dict:
    """config.json's mixture-of-experts fields -> ModelConfig's (none for a dense model).
    Mixtral's experts have intermediate_size columns, and it always renormalises the chosen
    experts' weights; Qwen3-MoE says both, and which layers are dense."""
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if arch not in _MOE_TENSORS or not experts:
        return {}
    qwen = arch == "qwen3_moe"
    return dict(num_experts=experts, num_experts_per_tok=int(c["num_experts_per_tok"]),
                moe_intermediate_size=int(c["moe_intermediate_size" if qwen
                                            else "intermediate_size"]),
                norm_topk_prob=bool(c.get("norm_topk_prob", False)) if qwen else True,
                decoder_sparse_step=int(c.get("decoder_sparse_step") or 1) if qwen else 1,
                mlp_only_layers=tuple(int(i) for i in c.get("mlp_only_layers") or ()))


def _rope_scaling(scaling: dict, max_position_embeddings: int) -> RopeScaling | None:
    """The older `rope_scaling` or transformers 5's `rope_parameters` -> RopeScaling (None for
    plain rope); an unknown type or key is refused by name."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "freq_factors":  # GGUF's, not a Hugging Face rope_type
        raise ValueError("rope scaling 'freq_factors' is not supported in config.json")
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type", "freq_factors"}
    ignored = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = sorted(set(scaling) - fields - ignored)
    if unknown:
        raise ValueError(f"rope scaling {rope_type!r}: unsupported key(s) {unknown}")
    values = {k: v for k, v in scaling.items() if k in fields and v is not None}
    if rope_type in ("llama3", "yarn"):
        values.setdefault("original_max_position_embeddings", max_position_embeddings)
    return RopeScaling(rope_type=rope_type, **values)


_LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Gemma 2/3's four norms a layer: input, after attention, before and after the MLP.
_SANDWICH_NORM_KEYS = {"post_attn_norm": "post_attention_layernorm.weight",
                       "mlp_norm": "pre_feedforward_layernorm.weight",
                       "post_mlp_norm": "post_feedforward_layernorm.weight"}
_BIAS_KEYS = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
              "bv": "self_attn.v_proj.bias"}
_QK_NORM_KEYS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EXPERT_KEYS = ("router", "experts_gate", "experts_up", "experts_down")  # _MOE_TENSORS' order
_MLP_KEYS = ("w_gate", "w_up", "w_down") + _EXPERT_KEYS


def _held(array: np.ndarray) -> np.ndarray:
    return array


def params_from_hf_state_dict(config: ModelConfig, tensors: dict, dtype=np.float32,
                              lazy: bool = False) -> dict:
    """Hugging Face tensor names (Llama, Mistral, Mixtral, Qwen, Qwen3-MoE, Gemma) -> the
    jaxserve params layout (numpy in `dtype`, matrices (in, out), layers stacked on axis 0; a
    sparse layer's experts stacked [E, in, out] from their one tensor each). A tensor may be
    given as a zero-argument reader; lazy: the stacked layer weights are LayerStacks that read
    (and transpose, check and convert) each layer when it is asked for."""
    used: set[str] = set()

    def require(name: str) -> None:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} in checkpoint")
        used.add(name)

    def take(name: str) -> np.ndarray:
        require(name)
        t = tensors[name]
        return np.asarray(t() if callable(t) else t)

    if config.architecture == "gpt_oss":
        tensors = gpt_oss.expert_tensors(tensors, config)
    # A bare decoder's names (AutoModel's) are the causal LM's without "model.".
    if headless := "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors = {f"model.{k}": v for k, v in tensors.items()}
    L = config.num_layers
    H, D = config.hidden_size, config.head_dim
    expected = {
        "attn_norm": (H,), "wq": (H, config.num_heads * D), "wk": (H, config.num_kv_heads * D),
        "wv": (H, config.num_kv_heads * D), "wo": (config.num_heads * D, H), "mlp_norm": (H,),
        "w_gate": (H, config.intermediate_size), "w_up": (H, config.intermediate_size),
        "w_down": (config.intermediate_size, H),
        "bq": (config.num_heads * D,), "bk": (config.num_kv_heads * D,),
        "bv": (config.num_kv_heads * D,), "q_norm": (D,), "k_norm": (D,),
        "post_attn_norm": (H,), "post_mlp_norm": (H,),
    }
    keys = dict(_LAYER_KEYS)
    if config.attention_bias:
        keys.update({k: (v, False) for k, v in _BIAS_KEYS.items()})
    if config.qk_norm:
        keys.update({k: (v, False) for k, v in _QK_NORM_KEYS.items()})
    if config.sandwich_norms:
        keys.update({k: (v, False) for k, v in _SANDWICH_NORM_KEYS.items()})
    E, moe_i = config.num_experts, config.moe_intermediate_size
    if E:  # a sparse layer's router [H, E] and experts stacked [E, in, out]
        keys.update({k: (v, True) for k, v in zip(_EXPERT_KEYS, _MOE_TENSORS[config.architecture])})
        expected.update(router=(H, E), experts_gate=(E, H, moe_i), experts_up=(E, H, moe_i),
                        experts_down=(E, moe_i, H))
    if config.architecture == "gpt_oss":
        keys.update(gpt_oss.LAYER_KEYS)
        expected.update(gpt_oss.layer_shapes(config))

    def names(key: str, suffix: str, i: int) -> list[str]:
        """The tensors layer i's `key` is made of (none: the layer lacks it)."""
        if (key in _EXPERT_KEYS) != config.layer_is_sparse(i) and key in _MLP_KEYS:
            return []
        if key in _EXPERT_KEYS[1:]:
            return [f"model.layers.{i}.{suffix.format(e=e)}" for e in range(E)]
        return [f"model.layers.{i}.{suffix}"]

    def read(name: str, shape: tuple, transpose: bool) -> np.ndarray:
        w = take(name)
        w = w.T if transpose else w
        if w.shape != shape:
            raise ValueError(f"{name}: shape {w.shape} (after transpose: {transpose}) != "
                             f"expected {shape}")
        return w

    def layer(names: list[str], key: str, transpose: bool) -> np.ndarray:
        if key not in _EXPERT_KEYS[1:]:
            # np.array copies: inputs may be read-only memory maps of the checkpoint file.
            return np.array(read(names[0], expected[key], transpose), dtype=dtype, order="C")
        out = np.empty(expected[key], dtype)
        for e, name in enumerate(names):
            out[e] = read(name, expected[key][1:], transpose)
        return out

    layers = {}
    for key, (suffix, transpose) in keys.items():
        per_layer = [names(key, suffix, i) for i in range(L)]
        for name in (n for ns in per_layer for n in ns):
            require(name)
        reads = [functools.partial(layer, ns, key, transpose) if ns else None for ns in per_layer]
        if lazy:
            layers[key] = LayerStack(reads, (L, *expected[key]), dtype)
        elif all(per_layer):
            layers[key] = np.empty((L, *expected[key]), dtype)
            for i, read_layer in enumerate(reads):
                layers[key][i] = read_layer()
        elif any(per_layer):  # some layers only (dense and sparse layers): each read now
            layers[key] = LayerStack([None if r is None else functools.partial(_held, r())
                                      for r in reads], (L, *expected[key]), dtype)
    embed = take("model.embed_tokens.weight")
    if embed.shape != (config.vocab_size, H):
        raise ValueError(f"embed_tokens shape {embed.shape} != {(config.vocab_size, H)}")
    params = {"embed": np.array(embed, dtype=dtype), "layers": layers,
              "final_norm": np.array(take("model.norm.weight"), dtype=dtype)}
    used.add("score.weight")  # a sequence classifier's head: weights/pooling.py reads it
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some checkpoints store the tied copy anyway
    elif "lm_head.weight" not in tensors and (headless or "score.weight" in tensors):
        pass  # a classifier or bare decoder has no language-model head (runner "pooling")
    else:
        lm = take("lm_head.weight")
        if lm.shape != (config.vocab_size, H):
            raise ValueError(f"lm_head shape {lm.shape} != {(config.vocab_size, H)}")
        params["lm_head"] = np.array(lm.T, dtype=dtype, order="C")
    unused = sorted(k for k in tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"checkpoint has tensors this model layout does not use (unsupported "
                         f"variant?): {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return params


# --- safetensors -------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str, digest=None, float_dtype=np.float32) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file, memory-mapped; float types become `float_dtype`
    (None: kept as stored; a bf16 tensor read as bf16 is a view of the file, never an f32 copy). If `digest` (a hashlib
    object) is given, the file's header and raw data bytes are fed to it."""
    from jaxserve.weights import ModelFileError

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        (n,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8:8 + n].tobytes())
    except (struct.error, ValueError) as e:  # cut short in the header, or not safetensors
        raise ModelFileError(f"{path}: truncated or corrupt safetensors header: {e}") from None
    base = 8 + n
    if digest is not None:
        digest.update(raw[8:])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        if base + end > len(raw):
            raise ModelFileError(f"{path} is truncated: tensor {name} ends at byte "
                                 f"{base + end} but the file has {len(raw)} bytes")
        buf = raw[base + start:base + end]
        dt = meta["dtype"]
        if dt == "BF16":
            arr = buf.view(ml_dtypes.bfloat16)
        elif dt in _ST_DTYPES:
            arr = buf.view(_ST_DTYPES[dt])
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        arr = arr.reshape(meta["shape"])
        if float_dtype is not None and arr.dtype.kind in "fV" and arr.dtype != float_dtype:
            arr = arr.astype(float_dtype)
        out[name] = arr
    return out


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(directory, fn) for fn in sorted(set(weight_map.values()))]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def is_hf_dir(directory: str) -> bool:
    return (os.path.isfile(os.path.join(directory, "config.json"))
            and bool(safetensors_files(directory)))


def with_stop_tokens(config: ModelConfig, directory: str, tokenizer):
    """(config, tokenizer) with the stop tokens of config.json, generation_config.json and the
    tokenizer's eos merged in that order, and the tokenizer's BOS where the config has none."""
    eos = list(config.eos_token_ids)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            g = json.load(f).get("eos_token_id")
        eos += [int(e) for e in (g if isinstance(g, list) else [g]) if e is not None]
    eos = tuple(dict.fromkeys(eos + list(tokenizer.eos_token_ids)))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    return (dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos),
            tokenizer.with_eos_token_ids(eos))


def load_hf_dir(directory: str, dtype=np.float32, lazy: bool = False):
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import LoadedModel

    from jaxserve.weights.model_config import hf_config

    directory = os.path.abspath(directory)
    config, tokenizer = with_stop_tokens(hf_config(directory), directory,
                                         Tokenizer.from_hf_dir(directory))
    h = hashlib.sha256()
    h.update(json.dumps(config.fingerprint_fields(), sort_keys=True, default=str).encode())
    tensors: dict[str, np.ndarray] = {}
    for fn in safetensors_files(directory):
        h.update(b"safetensors\0")
        # lazy: memory-mapped as stored, each layer converted when read
        tensors.update(read_safetensors(fn, digest=h, float_dtype=None if lazy else dtype))
    params = params_from_hf_state_dict(config, tensors, dtype, lazy)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=h.hexdigest(), source=directory)
