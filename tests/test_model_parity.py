"""The model through the paged pool matches Hugging Face transformers (the reference) on tiny
random Llama and Qwen2 configs: prefill logits and several decode steps, f32, within 1e-4, for
the XLA attention path and the C++ CPU kernel; and a numpy forward over the default model's
params reproduces transformers' logits (the params layout's semantics)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import StepLogits  # noqa: E402
from skips import need_backend  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.core.sequence import Request, Sequence  # noqa: E402
from jaxserve.core.step_plan import ScheduledChunk, StepPlan  # noqa: E402
from jaxserve.weights import config_from_hf, params_from_hf_state_dict  # noqa: E402

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


# Rope scalings with a short pretrained context (64), so that their frequency bands all fall
# inside the tiny head dim (16) and the test's positions.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind.startswith("llama"):
        scaling = ROPE_SCALINGS.get(kind.partition("-")[2])
        extra = {"rope_scaling": {**scaling, "rope_theta": 10000.0}} if scaling else {}
        hf_cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                          **extra)
        model = transformers.LlamaForCausalLM(hf_cfg)
    elif kind == "qwen3":  # per-head q/k RMSNorm, an explicit head dim
        hf_cfg = transformers.Qwen3Config(**TINY, head_dim=24, rope_theta=1e6,
                                          tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(hf_cfg)
        for name, w in model.named_parameters():  # norm weights are ones at init: vary them
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                torch.nn.init.normal_(w, 1.0, 0.3)
    else:
        hf_cfg = transformers.Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    model = model.eval().float()
    cfg = config_from_hf(hf_cfg.to_dict())
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, cfg, params_from_hf_state_dict(cfg, tensors)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("page_size,chunks", [(8, [24]), (5, [24]), (8, [11, 13]), (16, [7, 10, 7])])
def test_prefill_and_decode_logits_match_transformers(kind, page_size, chunks, backend):
    _check_logits(kind, page_size, chunks, backend)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_qwen3_matches_transformers(backend):
    _check_logits("qwen3", 8, [11, 13], backend)


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scalings_match_transformers(scaling):
    """Llama 3's, linear and YaRN rope scaling, past the 64-token pretrained context."""
    _check_logits(f"llama-{scaling}", 8, [40, 32], "xla")
    assert config_from_hf(_tiny(f"llama-{scaling}")[0].config.to_dict()).rope_scaling.rope_type \
        == scaling


def test_dynamic_and_unknown_rope_scalings_are_refused_by_name():
    for scaling, message in (({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
                             ({"rope_type": "su", "factor": 2.0}, "'su'"),
                             ({"rope_type": "linear", "factor": 2.0, "spin": 1}, "spin")):
        config = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": scaling}
        with pytest.raises(ValueError, match=message):
            config_from_hf(config)


def _check_logits(kind, page_size, chunks, backend):
    need_backend(backend)
    model, cfg, params = _tiny(kind)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, sum(chunks))]
    request = Request("r", prompt, SamplingParams(temperature=0))
    seq = Sequence(0, request, list(prompt), len(prompt))
    seq.page_ids = [int(p) for p in rng.permutation(np.arange(1, 64))[:20]]  # non-contiguous
    runner = StepLogits(cfg, params, page_size, backend)
    start = 0
    for n in chunks:  # chunked prefill: later chunks attend to earlier pages
        last = start + n == len(prompt)
        ours = runner.step(StepPlan([ScheduledChunk(seq, start, n, [seq] if last else [])]))
        start += n
    decode_tokens = [int(t) for t in rng.integers(0, cfg.vocab_size, 5)]
    all_logits = [ours[0]]
    for tok in decode_tokens:
        seq.token_ids.append(tok)
        all_logits.append(runner.step(StepPlan([ScheduledChunk(seq, seq.num_tokens - 1, 1, [seq])]))[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt + decode_tokens])).logits[0].numpy()
    expected = ref[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(all_logits), expected, atol=1e-4, rtol=1e-4)


def _numpy_forward(params: dict, c: ModelConfig, ids: list[int]) -> np.ndarray:
    """Plain numpy reference of the layout's semantics (HF rotate_half rotary, GQA, SwiGLU)."""
    T, D = len(ids), c.head_dim
    x = params["embed"][ids].astype(np.float64)
    inv = 1.0 / (c.rope_theta ** (np.arange(0, D, 2) / D))
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(v):  # [T, heads, D]
        rot = np.concatenate([-v[..., D // 2:], v[..., :D // 2]], -1)
        return v * cos[:, None] + rot * sin[:, None]

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    lay = params["layers"]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(c.num_layers):
        h = norm(x, lay["attn_norm"][i])
        q, k, v = h @ lay["wq"][i], h @ lay["wk"][i], h @ lay["wv"][i]
        if c.attention_bias:
            q, k, v = q + lay["bq"][i], k + lay["bk"][i], v + lay["bv"][i]
        q = rope(q.reshape(T, c.num_heads, D))
        k = rope(k.reshape(T, c.num_kv_heads, D))
        v = v.reshape(T, c.num_kv_heads, D)
        rep = c.num_heads // c.num_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ lay["wo"][i]
        h = norm(x, lay["mlp_norm"][i])
        g = h @ lay["w_gate"][i]
        x = x + (g / (1 + np.exp(-g)) * (h @ lay["w_up"][i])) @ lay["w_down"][i]
    x = norm(x, params["final_norm"])
    head = params["embed"].T if c.tie_word_embeddings else params["lm_head"]
    return x @ head


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_loaded, hf_smollm2):
    """The layout's semantics: a numpy forward over our params reproduces transformers' logits."""
    import torch

    tok = default_loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))[-24:]
    ours = _numpy_forward(default_loaded.params, default_loaded.config, ids)
    with torch.no_grad():
        ref = hf_smollm2.model(torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
