"""gpt-oss from GGUF as llama.cpp's converter writes it (arch gpt-oss): test_gpt_oss.py's tiny
seeded checkpoint (3 layers: window 8, full, window 8; YaRN with truncate false; sinks; biases;
4 experts, top 2, clamped SwiGLU) written with gguf.GGUFWriter under llama.cpp's names (gate_up
split into ffn_gate_exps and ffn_up_exps, experts [E, out, in]), once in float32 and once with
the experts in ggml's MXFP4 (gguf-py's quantizer; transformers then runs the dequantized
experts). The config equals the HF directory's, each expert is read from its own bytes, and the
logits (within 1e-4) and the engine's greedy tokens are transformers'. ggml's MXFP4 layout (a
scale byte, then values j and j + 16 in byte j) against hand values and gguf-py's decoder."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
if not hasattr(gguf.GGMLQuantizationType, "MXFP4"):
    pytest.skip("this gguf package has no MXFP4", allow_module_level=True)

from test_gguf_families import (_close, _greedy_matches_transformers, _last_logits_match,  # noqa: E402,E501
                                _writer)
from test_gpt_oss import WINDOW, _hf_model  # noqa: E402
from jaxserve.weights import config_from_hf  # noqa: E402
from jaxserve.weights.gguf_gpt_oss import dequantize  # noqa: E402
from jaxserve.weights.gguf_loader import config_from_gguf, gguf_hf_state_dict, read_gguf  # noqa: E402,E501
from jaxserve.weights.gpt_oss import FP4_E2M1  # noqa: E402
from jaxserve.weights.hf_loader import params_from_hf_state_dict  # noqa: E402

MXFP4 = gguf.GGMLQuantizationType.MXFP4
_NAMES = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias",
          "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
_NAMES.update({f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}" for kind in ("weight", "bias")
               for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))})
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _tensors(model) -> dict:
    """GGUF name -> f32 array, as convert_hf_to_gguf.py's GptOss class maps and splits them."""
    out = {}
    for name, t in model.state_dict().items():
        arr = t.detach().numpy().astype(np.float32)
        if name in _GLOBAL:
            out[_GLOBAL[name]] = arr
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}"
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], gate rows even
            arr = arr.swapaxes(1, 2)
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = (
                arr[:, 0::2], arr[:, 1::2])
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = (
                arr[:, 0::2], arr[:, 1::2])
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            out[f"{blk}.ffn_down_exps.weight"] = arr.swapaxes(1, 2)
        else:
            out[f"{blk}.{_NAMES[rest]}"] = arr
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _write(path, model, mxfp4: bool):
    """The GGUF file; with mxfp4, the experts quantized and `model`'s set to their decoding."""
    hf = model.config
    w = _writer(path, "gpt-oss", hf, hf.rope_parameters["rope_theta"])
    w.add_expert_count(hf.num_local_experts)
    w.add_expert_used_count(hf.num_experts_per_tok)
    w.add_expert_feed_forward_length(hf.intermediate_size)
    w.add_sliding_window(hf.sliding_window)
    rope = hf.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    decoded = {}
    for name, arr in _tensors(model).items():
        if mxfp4 and name.endswith("_exps.weight"):
            raw = gguf.quants.quantize(arr, MXFP4)
            decoded[name] = gguf.quants.dequantize(raw, MXFP4)
            w.add_tensor(name, raw, raw_dtype=MXFP4)
        else:
            w.add_tensor(name, arr)
    _close(w)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if f"blk.{i}.ffn_gate_exps.weight" not in decoded:
                continue
            gate_up = np.empty_like(layer.mlp.experts.gate_up_proj.numpy().swapaxes(1, 2))
            gate_up[:, 0::2] = decoded[f"blk.{i}.ffn_gate_exps.weight"]
            gate_up[:, 1::2] = decoded[f"blk.{i}.ffn_up_exps.weight"]
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(gate_up.swapaxes(1, 2)))
            layer.mlp.experts.down_proj.copy_(
                torch.from_numpy(decoded[f"blk.{i}.ffn_down_exps.weight"].swapaxes(1, 2)))


@pytest.fixture(scope="module", params=["f32", "mxfp4"])
def written(request, tmp_path_factory):
    """(transformers model on the file's weights, its GGUF read back)."""
    model = _hf_model()
    path = tmp_path_factory.mktemp("gguf_gpt_oss") / "m.gguf"
    _write(path, model, request.param == "mxfp4")
    return model, read_gguf(str(path))


def test_mxfp4_layout_hand_values():
    """Byte j holds value j (low nibble) and j + 16 (high); the scale byte 2^(s - 127)."""
    codes = (np.arange(32) * 5) % 16
    block = np.concatenate([[128], codes[:16] | (codes[16:] << 4)]).astype(np.uint8)
    np.testing.assert_array_equal(dequantize(block, (32,)), FP4_E2M1[codes] * 2)
    raw = np.random.default_rng(0).integers(0, 256, (6, 17), dtype=np.uint8)
    raw[:, 0] = np.random.default_rng(1).integers(100, 140, 6)  # normal-range scales
    np.testing.assert_array_equal(dequantize(raw.reshape(-1), (2, 96)),
                                  gguf.quants.dequantize(raw.reshape(2, 51), MXFP4))


def test_gguf_gpt_oss_matches_transformers(written):
    model, g = written
    hf = model.config
    assert g.tensors["blk.0.ffn_gate_exps.weight"].shape == (4, 32, 64)
    cfg = config_from_gguf(g.metadata, n_vocab_tensor=hf.vocab_size)
    want = config_from_hf(hf.to_dict())
    for field in ("architecture", "attention_sinks", "attention_bias", "sliding_window",
                  "layer_types", "rope_scaling", "rope_theta", "head_dim", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "swiglu_limit", "swiglu_alpha", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    params = params_from_hf_state_dict(cfg, gguf_hf_state_dict(g, cfg, lazy=True))
    _last_logits_match(model, cfg, params)
    _greedy_matches_transformers(model, cfg, params)


def test_fused_gate_up_experts_are_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), arch="gpt-oss")
    for key, value in (("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 32),
                       ("attention.head_count", 1), ("expert_count", 2),
                       ("expert_used_count", 1)):
        w.add_uint32(f"gpt-oss.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((2, 64, 64), np.float32))
    _close(w)
    g = read_gguf(str(tmp_path / "f.gguf"))
    cfg = config_from_gguf(g.metadata, n_vocab_tensor=8)
    with pytest.raises(ValueError, match="fuse-gate-up-exps"):
        gguf_hf_state_dict(g, cfg)


def test_gguf_gpt_oss_optional_keys():
    """A sliding_window_pattern period (every 3rd layer full), swiglu_clamp_exp (per layer) and
    rope.freq_base_swa are read; without an expert count gpt-oss is refused."""
    meta = {"general.architecture": "gpt-oss", "gpt-oss.embedding_length": 64,
            "gpt-oss.block_count": 4, "gpt-oss.feed_forward_length": 32,
            "gpt-oss.attention.head_count": 4, "gpt-oss.attention.sliding_window": 8,
            "gpt-oss.attention.sliding_window_pattern": 3, "gpt-oss.rope.freq_base_swa": 1e4,
            "gpt-oss.swiglu_clamp_exp": [5.0] * 4}
    with pytest.raises(ValueError, match="without expert_count"):
        config_from_gguf(meta, n_vocab_tensor=8)
    meta.update({"gpt-oss.expert_count": 4, "gpt-oss.expert_used_count": 2})
    cfg = config_from_gguf(meta, n_vocab_tensor=8)
    assert [cfg.layer_window(i) for i in range(4)] == [8, 8, None, 8]
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rope_local_theta) == (5.0, 1.702, 1e4)
