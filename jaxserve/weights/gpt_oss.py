"""gpt-oss checkpoints (GptOssForCausalLM) for the Hugging Face loader (hf_loader.py): its
config fields, its extra tensors, and its stacked experts as the per-expert tensors the loader
reads for every mixture of experts.

A layer's experts are stored stacked, gate and up interleaved on the output axis (gate's
column j at 2j, up's at 2j + 1): as float tensors gate_up_proj [E, H, 2I] and down_proj
[E, I, H] ([in, out]), or, in the released checkpoints, as MXFP4: gate_up_proj_blocks
u8[E, 2I, H/32, 16] with gate_up_proj_scales u8[E, 2I, H/32] (and down_proj's alike, [out, in]
order). MXFP4 is dequantized at load to the serving dtype (`dequantize_mxfp4`): the engine
serves the experts as float weights, never as FP4 (int8 quantization of experts is refused, as
for every mixture of experts).
"""

from __future__ import annotations

import functools

import numpy as np

# The 16 values of an FP4 (e2m1) code: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_BLOCK = 32  # values sharing one scale

# Per-expert names the loader reads (hf_loader._MOE_TENSORS), made here from the stacked ones.
MOE_TENSORS = ("mlp.router.weight", "mlp.experts.{e}.gate", "mlp.experts.{e}.up",
               "mlp.experts.{e}.down")
# Params key -> (tensor name in a layer, transposed): attention's output bias and sinks, the
# router's bias, the experts' biases (gate's and up's split from gate_up_proj_bias here).
LAYER_KEYS = {"bo": ("self_attn.o_proj.bias", False), "sinks": ("self_attn.sinks", False),
              "router_bias": ("mlp.router.bias", False),
              "experts_gate_bias": ("mlp.experts.gate_bias", False),
              "experts_up_bias": ("mlp.experts.up_bias", False),
              "experts_down_bias": ("mlp.experts.down_proj_bias", False)}


def config_fields(c: dict) -> dict:
    """config.json -> gpt-oss's ModelConfig fields beyond a mixture of experts'."""
    return dict(attention_sinks=True, swiglu_limit=float(c.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(c.get("swiglu_alpha", 1.702)))


def layer_shapes(config) -> dict:
    """The shapes of LAYER_KEYS' tensors (a ModelConfig)."""
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    return {"bo": (h,), "sinks": (config.num_heads,), "router_bias": (e,),
            "experts_gate_bias": (e, i), "experts_up_bias": (e, i), "experts_down_bias": (e, h)}


def dequantize_mxfp4(blocks, scales, dtype=np.float32, halves: bool = False) -> np.ndarray:
    """MXFP4 -> float: blocks u8[..., G, 16] hold 32 FP4 (e2m1) codes per block, two a byte, the
    low nibble first (values 2j, 2j + 1 in byte j; halves: ggml's order, values j and j + 16);
    scales u8[..., G] are e8m0 exponents, 2^(s - 127) for the block.
    Returns f[..., G * 32] in dtype (exact: every value is a small float times a power of 2)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1] * 2 != MXFP4_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: want blocks "
                         f"[..., G, {MXFP4_BLOCK // 2}] and scales [..., G]")
    values = np.empty(blocks.shape[:-1] + (MXFP4_BLOCK,), np.float32)
    low, high = (values[..., :16], values[..., 16:]) if halves else (values[..., 0::2],
                                                                      values[..., 1::2])
    low[...] = FP4_E2M1[blocks & 0x0F]
    high[...] = FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1).astype(dtype)


def expert_tensors(tensors: dict, config) -> dict:
    """The checkpoint's tensors with each layer's stacked experts (float or MXFP4) replaced by
    readers of per-expert [out, in] gate, up and down tensors (MOE_TENSORS) and its
    gate_up_proj_bias by gate_bias and up_bias [E, I]. A layer's experts are dequantized once
    per projection read (cached while its gate, up and down are read)."""

    def get(name):
        t = tensors[name]
        return np.asarray(t() if callable(t) else t)

    @functools.lru_cache(maxsize=2)
    def out_in(prefix: str, proj: str) -> np.ndarray:  # f[E, out, in]
        if f"{prefix}.{proj}_blocks" in tensors:
            return dequantize_mxfp4(get(f"{prefix}.{proj}_blocks"),
                                    get(f"{prefix}.{proj}_scales"))
        return np.swapaxes(get(f"{prefix}.{proj}"), 1, 2)

    out = {}
    stacked = ("gate_up_proj", "down_proj", "gate_up_proj_blocks", "gate_up_proj_scales",
               "down_proj_blocks", "down_proj_scales", "gate_up_proj_bias")
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in stacked:
            out[name] = t
        elif leaf == "gate_up_proj_bias":
            out[f"{prefix}.gate_bias"] = functools.partial(lambda n: get(n)[:, 0::2], name)
            out[f"{prefix}.up_bias"] = functools.partial(lambda n: get(n)[:, 1::2], name)
        elif leaf in ("gate_up_proj", "gate_up_proj_blocks", "down_proj", "down_proj_blocks"):
            proj = leaf.removesuffix("_blocks")
            for e in range(config.num_experts):
                if proj == "down_proj":
                    out[f"{prefix}.{e}.down"] = functools.partial(
                        lambda p, e: out_in(p, "down_proj")[e], prefix, e)
                    continue
                for kind, first in (("gate", 0), ("up", 1)):
                    out[f"{prefix}.{e}.{kind}"] = functools.partial(
                        lambda p, e, f: out_in(p, "gate_up_proj")[e, f::2], prefix, e, first)
    return out
