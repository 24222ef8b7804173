"""XLA's TPU cost model on the engine's compiled step against its roofline (engine/roofline.py),
on this CPU host (libtpu's compile-only topologies): each step's bytes accessed within
[0.95, 1.15] x the bytes it must move (weights once, every row's KV pages at the bucket's full
context once, the new KV, activations and logits). The lower bound catches a kernel whose cost
is missing (XLA would count none of its pages); the upper, traffic the step should not make.

Small configurations with the layer widths of a real model (hidden 2048, 2 layers), head dims
64 and 128, bf16 and int8 KV, a decode step (8 rows) and a prefill chunk (64 tokens in 8 rows)
at 2048 tokens of context, for v5e and v6e, each compiled once, unscanned, with memory-space
assignment off (jaxserve compile's cost report; engine/roofline.py says why). A scanned step,
costed from its first one and two layers, is checked against the unscanned step once."""

from __future__ import annotations

import json

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import aot

pytest.importorskip("libtpu")

PAGES = 4096  # 4096 x 16 slots x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 256 MiB a layer
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
         "num_hidden_layers": 2, "intermediate_size": 8192, "vocab_size": 32768,
         "max_position_embeddings": 2048, "tie_word_embeddings": False, "eos_token_id": 1}
HEADS = {64: (32, 8), 128: (16, 8)}  # head dim -> (query heads, KV heads)
DECODE, PREFILL = 8, 64  # tokens: 8 rows of one token; 64 tokens in 8 rows
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    dirs = {}
    for head_dim, (heads, kv_heads) in HEADS.items():
        path = tmp_path_factory.mktemp(f"d{head_dim}")
        (path / "config.json").write_text(json.dumps(
            {**MODEL, "head_dim": head_dim, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads}))
        dirs[head_dim] = str(path)
    return dirs


def _report(model_dir, head_dim, kv, topology, scan="off", tokens=(DECODE, PREFILL)):
    config = EngineConfig.from_options(
        model=model_dir[head_dim], kv_cache_dtype=kv, max_num_seqs=8,
        max_num_batched_tokens=PREFILL, max_model_len=2048, scan_layers=scan)
    return aot.cost_report(config, topology, PAGES, tokens=tokens)


def test_a_scanned_step_is_costed_whole(tmp_path):
    """XLA counts a scanned loop's body once; the report's 1- and 2-layer extrapolation gives
    the unscanned step's cost of 4 layers."""
    (tmp_path / "config.json").write_text(json.dumps(
        {**MODEL, "num_hidden_layers": 4, "head_dim": 128, "num_attention_heads": 16,
         "num_key_value_heads": 8}))
    dirs = {128: str(tmp_path)}
    scanned, unscanned = (_report(dirs, 128, "auto", "v6e:2x2", scan, (DECODE,))
                          for scan in ("on", "off"))
    assert scanned["counted_from"].startswith("unscanned compiles of 1 and 2")
    (a,), (b,) = scanned["steps"], unscanned["steps"]
    assert a["necessary_bytes"] == b["necessary_bytes"]
    assert abs(a["bytes_accessed"] / b["bytes_accessed"] - 1) < 0.02, (a, b)
    assert abs(a["flops"] / b["flops"] - 1) < 0.02


CASES = [(g, d, kv) for g in ("v5e", "v6e") for d in (64, 128) for kv in ("auto", "int8")]


@pytest.mark.parametrize("generation,head_dim,kv", CASES)
def test_step_bytes_are_the_necessary_bytes(model_dir, generation, head_dim, kv):
    report = _report(model_dir, head_dim, kv, f"{generation}:2x2")
    steps = {s["tokens"]: s for s in report["steps"]}
    assert set(steps) == {DECODE, PREFILL} and all(s["rows"] == 8 for s in steps.values())
    ratios = {t: s["bytes_ratio"] for t, s in steps.items()}
    print(generation, head_dim, kv, ratios, {t: s["seconds_ratio"] for t, s in steps.items()})
    for tokens, step in steps.items():
        assert step["unpriced_ops"] == 0 and step["estimated_seconds"] > 0
        assert 0.95 <= ratios[tokens] <= 1.15, (tokens, step)


def test_a_gemma2_shaped_step_compiles_for_v5e(tmp_path):
    """Gemma 2's attention (8 heads, 4 KV heads of dim 256, a 4096 window every other layer,
    soft caps), where JAX's kernel failed in Mosaic ("The last dim size is not 128 in original
    base memref"): the step compiles on our kernels and reads its necessary bytes."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 1024,
         "intermediate_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 32000,
         "max_position_embeddings": 8192, "sliding_window": 4096,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
         "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
         "tie_word_embeddings": True, "eos_token_id": 1}))
    config = EngineConfig.from_options(model=str(tmp_path), max_model_len=8192, max_num_seqs=8,
                                       max_num_batched_tokens=PREFILL)
    (step,) = aot.cost_report(config, "v5e:2x2", 2048, tokens=(DECODE,))["steps"]
    assert step["pages_per_row"] == 512 and step["unpriced_ops"] == 0
    assert 0.95 <= step["bytes_ratio"] <= 1.15, step
