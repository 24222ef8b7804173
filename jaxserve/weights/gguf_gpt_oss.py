"""gpt-oss from GGUF as llama.cpp writes it (arch `gpt-oss`, llama.cpp's LLM_ARCH_OPENAI_MOE,
written by convert_hf_to_gguf.py's GptOss class), for gguf_loader.py: its config, its names
beyond a mixture of experts', and ggml's MXFP4 blocks.

Tensors: the converter splits Hugging Face's gate_up_proj (gate at the even output rows, up at
the odd) into ffn_gate_exps and ffn_up_exps, [E, I, H] in numpy order, and writes down_proj as
ffn_down_exps [E, H, I]: each expert [out, in], read from its own bytes as every GGUF mixture's
(gguf_loader._experts). Their biases are ffn_{gate,up,down}_exps.bias [E, I] / [E, H], the
router's ffn_gate_inp.bias, the sinks attn_sinks.weight, the norm before the experts
post_attention_norm. (Its --fuse-gate-up-exps form, ffn_gate_up_exps, is refused by name.)

MXFP4 (ggml type 39): blocks of 32 values in 17 bytes, one e8m0 scale byte (2^(s - 127)) then
16 bytes of FP4 e2m1 codes, byte j holding value j in its low nibble and j + 16 in its high (the
converter reorders the checkpoint's pairs, which hold 2j and 2j + 1): gpt_oss.dequantize_mxfp4.

Config, as llama.cpp runs it: sliding and full layers alternating, layer 0 sliding (a period in
attention.sliding_window_pattern if the file has one); q/k/v and output biases; sinks; routing
by a softmax over the top-k of the router's logits (bias added), each chosen expert's output
weighted after its down projection (llama.cpp's SOFTMAX_WEIGHT gating = jaxserve's softmax
renormalised over the chosen, norm_topk_prob); the clamped SwiGLU with llama.cpp's constants
(limit 7, alpha 1.702; a file's swiglu_clamp_exp is the limit). YaRN's correction range is not
rounded to whole dimensions (truncate false, as the model was trained and its HF config says;
ggml's rope rounds it, a small difference of llama.cpp's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.weights.gpt_oss import MXFP4_BLOCK, dequantize_mxfp4

ARCH = "gpt-oss"
MXFP4 = 39  # ggml's type code
_BLOCK_BYTES = 1 + MXFP4_BLOCK // 2
_SWIGLU_LIMIT, _SWIGLU_ALPHA = 7.0, 1.702  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants

# GGUF name in a layer -> the name params_from_hf_state_dict reads (gpt_oss.LAYER_KEYS).
LAYER_NAMES = {
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_bias",
    "ffn_up_exps.bias": "mlp.experts.up_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}


def layer_name(rest: str, arch: str) -> str | None:
    """A gpt-oss layer tensor's name after `blk.{i}.` -> its HF-side name (None: not one of
    LAYER_NAMES, or another architecture); the fused gate/up experts are refused by name."""
    if arch != "gpt_oss":
        return None
    if rest.startswith("ffn_gate_up_exps."):
        raise ValueError(f"GGUF gpt-oss tensor {rest!r} (convert_hf_to_gguf.py's "
                         "--fuse-gate-up-exps) is not supported: convert without that flag")
    return LAYER_NAMES.get(rest)


def dequantize(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml MXFP4 bytes u8[n / 32 * 17] -> f32[shape] (n values, the last axis whole blocks)."""
    if shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 rows of {shape[-1]} values: not whole blocks of {MXFP4_BLOCK}")
    blocks = raw.reshape(-1, _BLOCK_BYTES)
    return dequantize_mxfp4(blocks[:, 1:], blocks[:, 0], halves=True).reshape(shape)


def with_config(config: ModelConfig, get) -> ModelConfig:
    """A gpt-oss config_from_gguf made (mixture, window, rope) -> gpt-oss's; get: the arch's
    metadata key -> value (None if absent)."""
    if get("expert_count") is None:
        raise ValueError("GGUF gpt-oss without expert_count")
    if config.sliding_window and config.layer_types is None:
        raise ValueError("GGUF gpt-oss's sliding layers must alternate (a period or a list of "
                         "booleans in attention.sliding_window_pattern)")
    limit = get("swiglu_clamp_exp")
    if isinstance(limit, list):  # per layer
        if len(set(limit)) != 1:
            raise ValueError(f"GGUF gpt-oss swiglu_clamp_exp differs between layers: {limit}")
        limit = limit[0]
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn":
        scaling = dataclasses.replace(scaling, truncate=False)
    local_theta = get("rope.freq_base_swa")
    return dataclasses.replace(
        config, attention_bias=True, attention_sinks=True, rope_scaling=scaling,
        rope_local_theta=None if local_theta is None else float(np.float32(local_theta)),
        swiglu_limit=float(limit) if limit else _SWIGLU_LIMIT, swiglu_alpha=_SWIGLU_ALPHA)
