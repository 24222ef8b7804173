"""GGUF files: metadata, tensors (dequantised to float32), config and tokenizer.

The header is gguf_file.py's (read_gguf, re-exported here); type codes, block sizes and
dequantisation come from the `gguf` package (`gguf.quants.dequantize`), so every type it knows is supported (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_*, K-quants, ...).

llama.cpp's converter permutes the rows of the llama Q and K projections so that rotary embedding
can be applied to interleaved pairs; `_unpermute` undoes that, so the weights returned here follow
Hugging Face's rotate_half (non-interleaved halves) convention exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.weights import ModelFileError, gguf_gpt_oss
from jaxserve.weights.gguf_file import GGUF_MAGIC, GGUFFile, GGUFTensorInfo, read_gguf  # noqa: F401

# Architectures whose converter permutes Q/K rows (LlamaModel and its subclasses in
# llama.cpp's convert_hf_to_gguf.py). Qwen2 and Qwen3 are not permuted.
_PERMUTED_ARCHS = ("llama", "mistral", "mixtral")
_SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma", "gemma2",
                    "gemma3", gguf_gpt_oss.ARCH)
_GEMMAS = ("gemma", "gemma2", "gemma3")
_QK_NORM_ARCHS = ("qwen3", "qwen3moe", "gemma3")
# Mixtures of experts as llama.cpp writes them: Mixtral is arch llama with an expert count,
# every layer sparse, the chosen experts' weights renormalised (as in llama.cpp's graphs).
_MOE_ARCHS = {"llama": "mixtral", "qwen3moe": "qwen3_moe", gguf_gpt_oss.ARCH: "gpt_oss"}
# A sparse layer's router, and its experts' gate, up and down stacked on the slowest axis.
_MOE_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                "ffn_down_exps.weight")
_SANDWICH_ARCHS = ("gemma2", "gemma3")  # post-attention, pre- and post-FFN norms
_SWA_PERIODS = {"gemma2": 2, "gemma3": 6, gguf_gpt_oss.ARCH: 2}  # llama.cpp's: n-th layer full


def _dequantize(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """Raw uint8 bytes of one tensor -> float32 array of info.shape."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    if qtype == gguf.GGMLQuantizationType.F32:
        out = raw.view(np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif qtype == gguf.GGMLQuantizationType.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif qtype == gguf_gpt_oss.MXFP4:
        out = gguf_gpt_oss.dequantize(raw, info.shape)
    else:
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        out = dequantize(raw.reshape(rows, -1), qtype)
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(weights, n_head, n_head_kv)` on rows of a [out, in]
    projection (or an [out] bias): per head, rows were reordered from HF's two halves
    [x_0..x_{D/2-1} | y_0..y_{D/2-1}] to interleaved pairs (x_0, y_0, x_1, y_1, ...)."""
    d = w.shape[0] // n_head
    return (w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.9999997e-06 -> 1e-05)."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").rstrip(")"))


def config_from_gguf(meta: dict[str, Any], n_vocab_tensor: int | None = None,
                     has_output: bool = True) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{list(_SUPPORTED_ARCHS)})")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    experts = int(get("expert_count") or 0)
    if experts and arch not in _MOE_ARCHS:
        raise ValueError(f"GGUF mixtures of experts of arch {arch!r} are not supported "
                         f"(supported: {list(_MOE_ARCHS)})")
    moe = dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
               moe_intermediate_size=int(get("expert_feed_forward_length")
                                         or get("feed_forward_length")),
               norm_topk_prob=True) if experts else {}
    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer head counts
        if len(set(n_kv)) != 1:
            raise ValueError("GGUF with per-layer KV head counts is not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"partial rotary (rope.dimension_count={rope_dim} != head_dim "
                         f"{head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else get("vocab_size", n_vocab_tensor)
    if n_vocab_tensor is not None:
        vocab = n_vocab_tensor  # the embedding's rows are authoritative (padding rows included)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    gemma = arch in _GEMMAS
    num_layers = int(get("block_count"))
    window, layer_types = _gguf_windows(arch, get("attention.sliding_window"),
                                        get("attention.sliding_window_pattern"), num_layers)
    scale = get("attention.scale")  # the score scale, where it is not head_dim ** -0.5

    def optional(key):
        value = get(key)
        return None if value is None else _f32(value)

    config = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=n_head,
        num_kv_heads=int(n_kv),
        head_dim=head_dim,
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        qk_norm=arch in _QK_NORM_ARCHS,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        architecture=_MOE_ARCHS[arch] if experts else arch,
        **moe,
        rope_scaling=_gguf_rope_scaling(get),
        sliding_window=window,
        layer_types=layer_types,
        # llama.cpp's Gemma 3 local layers: rope.freq_base_swa, else its fixed 10000.
        rope_local_theta=_f32(get("rope.freq_base_swa", 1e4)) if arch == "gemma3" else None,
        mlp_activation="gelu_tanh" if gemma else "silu",
        embed_scale=gemma,
        # The converter stores Gemma's norm weights with the 1 already added: offset 0 here.
        sandwich_norms=arch in _SANDWICH_ARCHS,
        query_pre_attn_scalar=None if scale is None else 1.0 / _f32(scale) ** 2,
        attn_logit_softcapping=optional("attn_logit_softcapping"),
        final_logit_softcapping=optional("final_logit_softcapping"),
    )
    return gguf_gpt_oss.with_config(config, get) if arch == gguf_gpt_oss.ARCH else config


def _gguf_rope_scaling(get) -> RopeScaling | None:
    """llama.cpp's rope.scaling.* keys -> RopeScaling: linear and yarn (llama3's scaling comes
    as a rope_freqs tensor instead: refused where it is met)."""
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor", 1.0)
    original_context = get("rope.scaling.original_context_length")
    if kind in (None, "none") or float(factor) == 1.0:
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=_f32(factor))
    if kind == "yarn" and original_context:
        return RopeScaling("yarn", factor=_f32(factor),
                           original_max_position_embeddings=int(original_context),
                           beta_fast=_f32(get("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=_f32(get("rope.scaling.yarn_beta_slow", 1.0)))
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, and yarn "
                     "with rope.scaling.original_context_length)")


def _gguf_windows(arch: str, window, pattern, num_layers: int):
    """(sliding window, layer types) as llama.cpp lays them out: a list of booleans in
    `pattern` (true = sliding) names each layer; else Gemma 2 alternates (layer 0 sliding),
    Gemma 3 and gpt-oss have one full layer in `pattern` (6 and 2 unless the file says), and
    the others (a Mistral-style llama, Qwen) window every layer. No window, or 0: none."""
    if not window:
        return None, None
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF attention.sliding_window_pattern names {len(pattern)} "
                             f"layers, the model has {num_layers}")
        sliding = [bool(x) for x in pattern]
    elif arch in _SWA_PERIODS:
        period = 2 if arch == "gemma2" else int(pattern or _SWA_PERIODS[arch])
        sliding = [(i + 1) % period != 0 for i in range(num_layers)]
    elif pattern is not None:
        raise ValueError(f"GGUF {arch} attention.sliding_window_pattern {pattern!r} is not "
                         "supported (supported: a list of booleans, one per layer)")
    else:
        return int(window), None  # every layer windowed
    return int(window), tuple("sliding_attention" if x else "full_attention" for x in sliding)


_GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # q/k norms (Qwen3, Gemma 3); Gemma 2/3's four norms (gpt-oss: post_attention_norm's, too)
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest == "ffn_norm.weight" and arch in _SANDWICH_ARCHS:  # the norm before the FFN
            return f"model.layers.{idx}.pre_feedforward_layernorm.weight"
        name = _GGUF_TO_HF.get(rest) or gguf_gpt_oss.layer_name(rest, arch)
        if name:
            return f"model.layers.{idx}.{name}"
    return None


def gguf_hf_state_dict(g: GGUFFile, config: ModelConfig, dtype=np.float32,
                       lazy: bool = False) -> dict:
    """Every tensor, dequantised (through float32, one tensor at a time) to `dtype`, under its
    Hugging Face name, Q/K un-permuted; lazy: a reader of each (dequantised when called)."""
    raw = np.memmap(g.path, dtype=np.uint8, mode="r")
    permuted = config.architecture in _PERMUTED_ARCHS

    def read(info: GGUFTensorInfo, hf: str) -> np.ndarray:
        w = _dequantize(raw[info.offset:info.offset + info.nbytes], info)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            w = _unpermute(w, config.num_heads if ".q_proj." in hf else config.num_kv_heads)
        return w.astype(dtype, copy=False)

    out = {}
    for name, info in g.tensors.items():
        if name.split(".", 2)[-1] in _MOE_TENSORS:
            for part, hf in _experts(info, config):
                out[hf] = functools.partial(read, part, hf) if lazy else read(part, hf)
            continue
        hf = hf_name(name, config.architecture)
        if name == "rope_freqs.weight":  # read by load_gguf (rope_freq_factors)
            continue
        if hf is None:
            raise ValueError(f"unexpected tensor {name!r} in GGUF {g.path}")
        out[hf] = functools.partial(read, info, hf) if lazy else read(info, hf)
    return out


def _experts(info: GGUFTensorInfo, config: ModelConfig):
    """A sparse layer's router as (info, its HF name), or its stacked experts split into one
    (info, HF name) per expert: expert e's bytes are the e-th of E equal runs (the expert axis is
    ggml's slowest), so each is read alone."""
    from jaxserve.weights.hf_loader import _MOE_TENSORS as HF_NAMES

    _, idx, rest = info.name.split(".", 2)
    hf = f"model.layers.{idx}." + HF_NAMES[config.architecture][_MOE_TENSORS.index(rest)]
    if rest == _MOE_TENSORS[0]:
        return [(info, hf)]
    E = config.num_experts
    if info.shape[0] != E:
        raise ValueError(f"GGUF tensor {info.name} stacks {info.shape[0]} experts, not {E}")
    size = info.nbytes // E
    return [(dataclasses.replace(info, shape=info.shape[1:], offset=info.offset + e * size,
                                 nbytes=size), hf.format(e=e)) for e in range(E)]


def with_rope_freq_factors(g: GGUFFile, config: ModelConfig) -> ModelConfig:
    """A rope_freqs tensor (llama.cpp's form of a scaling such as llama3's: one divisor per
    rotated pair) -> config.rope_scaling of type freq_factors."""
    info = g.tensors.get("rope_freqs.weight")
    if info is None:
        return config
    if config.rope_scaling is not None:
        raise ValueError("GGUF has both rope_freqs and rope.scaling.type: not supported")
    raw = np.memmap(g.path, dtype=np.uint8, mode="r")
    factors = _dequantize(raw[info.offset:info.offset + info.nbytes], info).reshape(-1)
    return dataclasses.replace(config, rope_scaling=RopeScaling(
        "freq_factors", factor=1.0, freq_factors=tuple(float(x) for x in factors)))


def gguf_fingerprint(g: GGUFFile, config: ModelConfig) -> str:
    """sha256 over the config and the raw tensor-data bytes exactly as stored in the file
    (quantised blocks, not dequantised arrays): ~0.1 s for 100 MB."""
    h = hashlib.sha256()
    h.update(json.dumps(config.fingerprint_fields(), sort_keys=True, default=str).encode())
    h.update(b"gguf-tensor-data\0")
    with open(g.path, "rb") as f:
        f.seek(g.data_offset)
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def gguf_model_config(g: GGUFFile) -> ModelConfig:
    """The file's ModelConfig; ModelFileError naming the file when its metadata lacks a key or
    holds one of the wrong type."""
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFileError(f"{g.path}: GGUF has no token_embd.weight")
    try:
        config = config_from_gguf(g.metadata, n_vocab_tensor=emb.shape[0],
                                  has_output="output.weight" in g.tensors)
        return with_rope_freq_factors(g, config)
    except (KeyError, TypeError, ValueError) as e:  # int(None): a required key is missing
        raise ModelFileError(f"{g.path}: GGUF metadata is not a supported model's: "
                             f"{type(e).__name__}: {e}") from None


def load_gguf(path: str, dtype=np.float32, lazy: bool = False):
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import LoadedModel
    from jaxserve.weights.hf_loader import params_from_hf_state_dict

    path = os.path.abspath(path)
    g = read_gguf(path)
    config = gguf_model_config(g)
    params = params_from_hf_state_dict(config, gguf_hf_state_dict(g, config, dtype, lazy), dtype,
                                       lazy)
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=gguf_fingerprint(g, config), source=path)
