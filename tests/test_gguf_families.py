"""Gemma, Gemma 2 and Gemma 3 from GGUF as llama.cpp's converter writes them (tensor names,
norm weights with the 1 added, attention.sliding_window, soft-capping keys, rope.freq_base_swa,
rope.scaling.*, attention.scale for a query_pre_attn_scalar other than the head dim): the tiny
seeded checkpoints of tests/hf_families.py written with gguf.GGUFWriter (f32) and read back give
transformers' logits within 1e-4 through pages of 8 and a chunk crossing the window. Likewise a
Llama with llama3 rope scaling stored as llama.cpp stores it, a rope_freqs tensor; Qwen3 (arch
qwen3: per-head q/k norms, key_length head dim, no biases) and a Mistral-style llama with
attention.sliding_window (every layer windowed, the context length kept), both also generating
transformers' greedy tokens through the engine."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from hf_families import TINY, WINDOW, StepLogits, family_model, seeded_model  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.kv_groups import groups_of  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.core.sequence import Request, Sequence  # noqa: E402
from jaxserve.core.step_plan import ScheduledChunk, StepPlan  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights import LoadedModel, config_from_hf  # noqa: E402
from jaxserve.weights.gguf_loader import config_from_gguf, gguf_hf_state_dict, read_gguf  # noqa: E402,E501
from jaxserve.weights.hf_loader import params_from_hf_state_dict  # noqa: E402

_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str, arch: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    if arch not in ("gemma2", "gemma3") and module == "post_attention_layernorm":  # pre-FFN
        return f"blk.{idx}.ffn_norm.weight"
    return f"blk.{idx}.{_NAMES[module]}.weight"


def _writer(path, arch: str, hf, rope_theta: float):
    """A GGUF writer with the hyperparameters every family writes, from a transformers config."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(hf.max_position_embeddings)
    w.add_embedding_length(hf.hidden_size)
    w.add_block_count(hf.num_hidden_layers)
    w.add_feed_forward_length(hf.intermediate_size)
    w.add_head_count(hf.num_attention_heads)
    w.add_head_count_kv(hf.num_key_value_heads)
    w.add_key_length(hf.head_dim)
    w.add_value_length(hf.head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(hf.rms_norm_eps)
    return w


def _close(w):
    """Write and close a GGUFWriter's file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _interleaved(w: np.ndarray, heads: int, d: int) -> np.ndarray:
    """A q/k projection's rows in llama.cpp's order for interleaved rotary."""
    return w.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _write(path, family: str):
    model, cfg, _ = family_model(family)
    hf = model.config
    w = _writer(path, family, hf, cfg.rope_theta)
    if family != "gemma":
        w.add_sliding_window(hf.sliding_window)
        w.add_float32(f"{family}.attention.scale", hf.query_pre_attn_scalar ** -0.5)
    if family == "gemma2":
        w.add_attn_logit_softcapping(hf.attn_logit_softcapping)
        w.add_final_logit_softcapping(hf.final_logit_softcapping)
    if family == "gemma3":  # two layers: pattern 2 makes layer 0 sliding, layer 1 full
        w.add_sliding_window_pattern([True, False])
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        arr = t.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight"):  # as llama.cpp's converter stores Gemma norms
            arr = arr + 1.0
        w.add_tensor(_gguf_name(name, family), arr)
    _close(w)
    return model, cfg


def _last_logits_match(model, cfg, params):
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, cfg.vocab_size, 40)]
    seq = Sequence(0, Request("r", prompt, SamplingParams(temperature=0)), list(prompt), 40)
    seq.page_ids = list(range(1, 8))  # and a table of its own pages per other layer group
    seq.group_page_ids = [list(range(1 + 7 * g, 8 + 7 * g))
                          for g in range(1, groups_of(cfg).num_groups)]
    runner = StepLogits(cfg, params, 8, "xla")
    runner.step(StepPlan([ScheduledChunk(seq, 0, 8, [])]))
    ours = runner.step(StepPlan([ScheduledChunk(seq, 8, 32, [seq])]))[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(tmp_path, family):
    model, hf_cfg = _write(tmp_path / "m.gguf", family)
    g = read_gguf(str(tmp_path / "m.gguf"))
    cfg = config_from_gguf(g.metadata, n_vocab_tensor=hf_cfg.vocab_size, has_output=False)
    for field in ("sliding_window", "layer_types", "rope_local_theta", "rope_scaling",
                  "attn_logit_softcapping", "final_logit_softcapping", "embed_scale",
                  "sandwich_norms", "qk_norm", "mlp_activation", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert cfg.norm_weight_offset == 0.0  # stored with the 1 added
    assert abs(cfg.attention_scale - hf_cfg.attention_scale) < 1e-7
    _last_logits_match(model, cfg, params_from_hf_state_dict(cfg, gguf_hf_state_dict(g, cfg)))


def test_llama3_rope_freqs_gguf_matches_transformers(tmp_path):
    """llama.cpp writes llama3's scaling as per-pair divisors (rope_freqs.weight) and Q/K rows
    permuted for its interleaved rotary; both are undone on load."""
    import transformers

    from jaxserve.weights.gguf_loader import with_rope_freq_factors

    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 1e4}
    hf = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  rope_parameters=scaling)
    model = transformers.LlamaForCausalLM(hf).eval().float()
    with torch.no_grad():  # scores of a few units: the rotary frequencies matter
        for name, t in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                t.mul_(8.0)
    d = hf.hidden_size // hf.num_attention_heads
    plain = 1.0 / 1e4 ** (np.arange(0, d, 2) / d)
    divisors = plain / model.model.rotary_emb.inv_freq.double().numpy()
    # every band of llama3 is present: kept, blended and divided by the factor
    assert divisors.min() < 1 + 1e-6 and divisors.max() > 8 - 1e-5
    assert ((divisors > 1.01) & (divisors < 7.99)).any()
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch="llama")
    for key, value in (("context_length", 256), ("embedding_length", 64), ("block_count", 2),
                       ("feed_forward_length", 96), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(hf.rms_norm_eps)
    w.add_tensor("rope_freqs.weight", divisors.astype(np.float32))
    for name, t in model.state_dict().items():
        arr = t.detach().numpy().astype(np.float32)
        heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
        if heads:  # llama.cpp's row order for interleaved rotary
            arr = _interleaved(arr, heads, d)
        w.add_tensor(_gguf_name(name, "llama"), arr)
    _close(w)
    g = read_gguf(str(tmp_path / "m.gguf"))
    cfg = with_rope_freq_factors(g, config_from_gguf(g.metadata, n_vocab_tensor=211))
    assert cfg.rope_scaling.rope_type == "freq_factors"
    _last_logits_match(model, cfg, params_from_hf_state_dict(cfg, gguf_hf_state_dict(g, cfg)))


def test_unsupported_gguf_rope_scaling_is_refused():
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64,
            "gemma3.attention.head_count": 4, "gemma3.block_count": 2,
            "gemma3.feed_forward_length": 96, "gemma3.rope.scaling.type": "longrope",
            "gemma3.rope.scaling.factor": 4.0}
    with pytest.raises(ValueError, match="longrope"):
        config_from_gguf(meta, n_vocab_tensor=100)


def _write_plain(path, arch: str, model, permute: bool, window=None):
    """A Llama-layout transformers model as llama.cpp's converter writes it for `arch` (Q/K rows
    permuted for interleaved rotary where `permute`), with attention.sliding_window if given."""
    hf = model.config
    w = _writer(path, arch, hf, config_from_hf(hf.to_dict()).rope_theta)
    if window is not None:
        w.add_sliding_window(window)
    d = hf.head_dim
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and hf.tie_word_embeddings:
            continue
        arr = t.detach().numpy().astype(np.float32)
        heads = {"q_proj": hf.num_attention_heads,
                 "k_proj": hf.num_key_value_heads}.get(name.split(".")[-2])
        if permute and heads:
            arr = _interleaved(arr, heads, d)
        w.add_tensor(_gguf_name(name, arch), arr)
    _close(w)
    g = read_gguf(str(path))
    cfg = config_from_gguf(g.metadata, n_vocab_tensor=hf.vocab_size,
                           has_output="output.weight" in g.tensors)
    return cfg, params_from_hf_state_dict(cfg, gguf_hf_state_dict(g, cfg))


def _greedy_matches_transformers(model, cfg, params, max_tokens=16):
    """The engine (pages of 8, chunks of 32) generates transformers' greedy tokens."""
    from jaxserve.weights.random_init import numbered_tokenizer

    loaded = LoadedModel(config=cfg, params=params,
                         tokenizer=numbered_tokenizer(cfg.vocab_size, TINY["eos_token_id"]),
                         fingerprint="tiny-gguf", source="test")
    config = EngineConfig.from_options(page_size=8, max_num_batched_tokens=32, max_num_seqs=4,
                                       attention_backend="xla")
    llm = LLM.from_engine(LLMEngine(config, loaded))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, cfg.vocab_size, 20)]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert list(out.outputs[0].token_ids) == ids[len(prompt):]


def test_qwen3_gguf_matches_transformers(tmp_path):
    """llama.cpp's qwen3: q/k norm tensors per head, the head dim from key_length (24, not
    hidden / heads = 16), no q/k/v biases, Q/K rows not permuted; the config equals the
    Hugging Face directory's."""
    import transformers

    hf_cfg = transformers.Qwen3Config(**TINY, head_dim=24, rope_theta=1e6,
                                      tie_word_embeddings=True)
    model = seeded_model(transformers.Qwen3ForCausalLM, hf_cfg)
    cfg, params = _write_plain(tmp_path / "m.gguf", "qwen3", model, permute=False)
    hf = config_from_hf(hf_cfg.to_dict())
    for field in ("head_dim", "qk_norm", "attention_bias", "tie_word_embeddings", "rope_theta",
                  "rms_norm_eps", "sliding_window", "layer_types", "mlp_activation",
                  "norm_weight_offset", "max_position_embeddings"):
        assert getattr(cfg, field) == getattr(hf, field), field
    assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 24
    _last_logits_match(model, cfg, params)
    _greedy_matches_transformers(model, cfg, params)


def test_mistral_style_llama_gguf_sliding_window(tmp_path):
    """A Mistral checkpoint as llama.cpp writes it (arch llama, Q/K permuted) with
    llama.sliding_window 12: every layer windowed, the context length (512) stays the model's
    length; logits through a chunk crossing the window, and greedy tokens past it."""
    model, hf_cfg, _ = family_model("mistral")
    cfg, params = _write_plain(tmp_path / "m.gguf", "llama", model, permute=True,
                               window=WINDOW)
    assert cfg.sliding_window == WINDOW == hf_cfg.sliding_window
    assert cfg.layer_types is None and hf_cfg.layer_types is None
    assert cfg.max_position_embeddings == hf_cfg.max_position_embeddings == 512
    _last_logits_match(model, cfg, params)
    _greedy_matches_transformers(model, cfg, params)


def test_gguf_sliding_window_pattern():
    """A per-layer boolean pattern names each layer; a window of 0 is none; a pattern of the
    wrong length or an integer pattern outside Gemma 3 is refused by name."""
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64,
            "qwen3.attention.head_count": 4, "qwen3.block_count": 2,
            "qwen3.feed_forward_length": 96, "qwen3.attention.sliding_window": 12}
    cfg = config_from_gguf({**meta, "qwen3.attention.sliding_window_pattern": [False, True]},
                           n_vocab_tensor=100)
    assert cfg.sliding_window == 12
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    assert config_from_gguf({**meta, "qwen3.attention.sliding_window": 0},
                            n_vocab_tensor=100).sliding_window is None
    with pytest.raises(ValueError, match="names 3 layers"):
        config_from_gguf({**meta, "qwen3.attention.sliding_window_pattern": [True] * 3},
                         n_vocab_tensor=100)
    with pytest.raises(ValueError, match="sliding_window_pattern 4"):
        config_from_gguf({**meta, "qwen3.attention.sliding_window_pattern": 4},
                         n_vocab_tensor=100)


def _moe_model(arch: str):
    """A tiny seeded mixture of experts (4 experts, 2 a token, every layer sparse, as llama.cpp's
    graphs have them) with clear routing choices."""
    import transformers

    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "llama":  # Mixtral
        hf_cfg = transformers.MixtralConfig(**{**TINY, "intermediate_size": 48}, **moe,
                                            num_local_experts=4, head_dim=16)
        cls = transformers.MixtralForCausalLM
    else:
        hf_cfg = transformers.Qwen3MoeConfig(**TINY, **moe, num_experts=4, head_dim=16,
                                             moe_intermediate_size=40, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    return seeded_model(cls, hf_cfg, {"mlp.gate.weight": 30.0, ".experts.": 3.0})


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_gguf_mixtures_of_experts_match_transformers(tmp_path, arch):
    """Mixtral (arch llama with an expert count, Q/K permuted) and Qwen3-MoE (arch qwen3moe,
    expert_feed_forward_length) as llama.cpp writes them: the router as ffn_gate_inp and each
    layer's experts stacked in one tensor per projection (ffn_{gate,up,down}_exps). The config
    names the family and its experts, each expert is read from its own bytes, and the logits and
    greedy tokens are transformers'."""
    model = _moe_model(arch)
    hf = model.config
    w = _writer(tmp_path / "m.gguf", arch, hf, config_from_hf(hf.to_dict()).rope_theta)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(hf.moe_intermediate_size)
    d = hf.head_dim
    for name, t in model.state_dict().items():
        arr = t.detach().numpy().astype(np.float32)
        prefix, _, rest = name.rpartition(".mlp.")
        if rest == "gate.weight":
            w.add_tensor(f"blk.{prefix.split('.')[-1]}.ffn_gate_inp.weight", arr)
        elif rest == "experts.gate_up_proj":  # [E, 2 ff, H]: gate rows, then up rows
            blk, ff = f"blk.{prefix.split('.')[-1]}", arr.shape[1] // 2
            w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(arr[:, :ff]))
            w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(arr[:, ff:]))
        elif rest == "experts.down_proj":
            w.add_tensor(f"blk.{prefix.split('.')[-1]}.ffn_down_exps.weight", arr)
        else:
            heads = {"q_proj": hf.num_attention_heads,
                     "k_proj": hf.num_key_value_heads}.get(name.split(".")[-2])
            if arch == "llama" and heads:
                arr = _interleaved(arr, heads, d)
            w.add_tensor(_gguf_name(name, arch), arr)
    _close(w)
    g = read_gguf(str(tmp_path / "m.gguf"))
    cfg = config_from_gguf(g.metadata, n_vocab_tensor=hf.vocab_size)
    assert cfg.architecture == {"llama": "mixtral", "qwen3moe": "qwen3_moe"}[arch]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    assert cfg.moe_intermediate_size == (48 if arch == "llama" else 40)
    assert all(cfg.layer_is_sparse(i) for i in range(cfg.num_layers))
    # each expert's reader reads its own bytes (the engine's lazy load)
    params = params_from_hf_state_dict(cfg, gguf_hf_state_dict(g, cfg, lazy=True))
    _last_logits_match(model, cfg, params)
    _greedy_matches_transformers(model, cfg, params)


def test_gguf_experts_of_an_unknown_arch_are_refused_by_name():
    meta = {"general.architecture": "qwen2", "qwen2.expert_count": 8, "qwen2.block_count": 2,
            "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4}
    with pytest.raises(ValueError, match="GGUF mixtures of experts of arch 'qwen2'"):
        config_from_gguf(meta)
