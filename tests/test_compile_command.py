"""`jaxserve compile`: the engine's warm-up shapes compiled for a TPU topology without a TPU and
without weights (a directory holding only config.json), its memory plan per device, a model that
cannot fit refused in one line, bad flags refused in one line; on this host's backend, the
warm-up's compiles written into --cache_dir. A tiny model and few buckets keep it fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxserve import backends
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.runtime import abstract, sharding
from jaxserve.runtime.batch import warmup_batches
from jaxserve.runtime.runner import ModelRunner
from jaxserve.weights.model_config import read_model_config
from jaxserve.weights.random_init import random_model

pytest.importorskip("libtpu")  # the test extra installs it on linux x86_64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "vocab_size": 512,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 1}
BUCKETS = ["--max_num_seqs=2", "--max_num_batched_tokens=4", "--max_model_len=64"]
# Weights alone past v5e's 16 GiB: a 4 Gi-entry bf16 embedding and head at hidden 2048.
HUGE = {**TINY, "hidden_size": 2048, "vocab_size": 2 ** 22, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1}


def _config_dir(tmp_path_factory, name: str, config: dict) -> str:
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def jaxserve(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jaxserve.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return _config_dir(tmp_path_factory, "tiny", TINY)


@pytest.fixture(scope="module")
def v5e_proc(tiny_dir) -> subprocess.CompletedProcess:
    proc = jaxserve("compile", "--topology=v5e:2x2", f"--model={tiny_dir}", "--json", *BUCKETS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def v5e_report(v5e_proc) -> dict:
    return json.loads(v5e_proc.stdout)


def test_report_fields_and_types(v5e_report):
    r = v5e_report
    assert r["topology"] == "v5e:2x2" and r["device_kind"] == "TPU v5 lite"
    assert r["hbm_bytes_per_device"] == 16 * 2 ** 30
    assert r["attention_backend"] == "pallas-tpu" and r["dtype"] == "bfloat16"
    assert r["failures"] == [] and r["fits"] is True
    assert isinstance(r["compile_seconds"], float) and r["compile_seconds"] > 0
    d = r["per_device"]
    for key in ("weight_bytes", "kv_pool_bytes", "activation_peak_bytes"):
        assert isinstance(d[key], int) and d[key] > 0, key
    # bf16 weights: embed and head 2 x V x H, per layer (qkv + o + gate/up + down) and norms
    h, v, i, layers = 128, 512, 256, 2
    per_layer = (4 + 2 * 2) * 32 * h + h * 4 * 32 + 3 * h * i + 2 * h
    assert d["weight_bytes"] == 2 * (2 * v * h + h + layers * per_layer)
    assert d["kv_pool_bytes"] == r["num_pages"] * d["page_bytes"]
    planned = (d["weight_bytes"] + d["activation_peak_bytes"] + d["runtime_bytes"]
               + d["margin_bytes"] + d["kv_pool_bytes"])
    assert planned <= d["budget_bytes"] == int(0.9 * 16 * 2 ** 30)
    assert d["budget_bytes"] - planned < d["budget_bytes"] / 1000  # the pool takes the rest
    assert d["step_peak_bytes"] <= r["hbm_bytes_per_device"]  # what XLA compiled holds
    # the plan's runtime term covers the code of every executable compiled (steps, sampling
    # calls, page copies), each counted at the largest of its kind
    assert d["generated_code_bytes"] <= d["runtime_bytes"]


def test_cost_report_and_progress(v5e_proc, v5e_report):
    """Each step shape's compiled cost beside its roofline (a scanned step's counted from
    unscanned compiles of 1 and 2 layers), and a progress line per executable on stderr."""
    cost = v5e_report["cost"]
    assert cost["chip"] == {"device_kind": "TPU v5 lite", "flops_per_s": 197e12,
                            "hbm_bytes_per_s": 819e9}
    assert cost["counted_from"].startswith("unscanned compiles")  # TPU scans by default
    steps = cost["steps"]
    assert [s["tokens"] for s in steps] == [1, 2, 3, 4]  # packed: a shape per token bucket
    for s in steps:
        assert s["pages_per_row"] == 64 // 16 and s["rows"] == min(2, s["tokens"])
        assert s["bytes_accessed"] > 0 and s["flops"] > 0 and s["unpriced_ops"] == 0
        assert s["estimated_seconds"] > 0 and s["necessary_bytes"] > 0
        assert s["roofline_seconds"] == max(s["necessary_flops"] / 197e12,
                                            s["necessary_bytes"] / 819e9)
    assert set(cost["throughput"]) == {"decode", "prefill"}
    progress = [ln for ln in v5e_proc.stderr.splitlines() if ln.strip().startswith("[")]
    costs = 2 * len(steps)  # the 1- and 2-layer compiles of each step shape
    assert len(progress) == v5e_report["shapes"] + v5e_report["sampling_calls"] + costs
    assert progress[-1].strip().startswith(f"[{len(progress)}/{len(progress)}]")


def test_missing_libtpu_names_the_pinned_install(monkeypatch):
    from jaxserve.runtime import topology

    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'jaxserve\[tpu\]'.*libtpu==0\.0\.42\.1"):
        topology.tpu_topology.__wrapped__("v5e:2x2")


def test_shapes_are_the_engines_warmup(v5e_report, tiny_dir):
    """The same count an engine with the TPU's (packed) attention would warm up, built here on
    the CPU with the Pallas kernels interpreted and the same flags."""
    model = read_model_config(tiny_dir)
    config = EngineConfig.from_options(model=tiny_dir, attention_backend="pallas", num_pages=8,
                                       max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64)
    engine = LLMEngine(config, random_model(model))
    assert engine.backend.packed
    assert v5e_report["shapes"] == engine.runner.warmup_count(engine.buckets)
    rows = {b.logits_indices.shape[0] for b, _ in
            warmup_batches(engine.buckets, engine.runner.page_size)}
    assert v5e_report["sampling_calls"] == 6 * len(rows)  # 3 modes, with and without controls


@pytest.mark.parametrize("quantization, tied, head_dim", [
    ("none", False, 32), ("int8", False, 32), ("none", True, 64), ("int8", True, 64)])
def test_abstract_params_are_the_runners(quantization, tied, head_dim):
    """The params and pool compiled against have the tree, shapes and dtypes the runner places
    (head_dim 64: the TPU kernels' flat page-major pool; 32: head-major)."""
    model = ModelConfig(**{**dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                                  eos_token_ids=(1,)),
                           "tie_word_embeddings": tied})
    runner = ModelRunner(model, random_model(model).params, num_pages=4, page_size=16,
                         dtype="bfloat16", quantization=quantization,
                         backend=backends.get("pallas-tpu-interpret"))
    placed = abstract.abstract_params(model, runner.mesh, "bfloat16", quantization)
    real = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), runner.params)
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), placed) == real
    assert abstract.bytes_per_device(placed) == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(runner.params))
    pool = abstract.abstract_pool(model, runner.mesh, 4, 16, "bfloat16", runner.backend,
                                  "bfloat16")
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), pool) == \
        jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), runner.pool)
    assert sharding.tp_size(runner.mesh) == 1


def test_a_model_that_cannot_fit_is_refused(tmp_path_factory):
    huge = _config_dir(tmp_path_factory, "huge", HUGE)
    proc = jaxserve("compile", "--topology=v5e:2x2", f"--model={huge}", *BUCKETS)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "jaxserve compile" in line]
    assert len(errors) == 1 and "weights 32.0" in errors[0]
    assert "Traceback" not in proc.stderr
    proc = jaxserve("compile", "--topology=v5e:2x2", f"--model={huge}", "--json", *BUCKETS)
    report = json.loads(proc.stdout)
    assert report["fits"] is False and report["shapes"] == 0


@pytest.mark.parametrize("flag, message", [
    ("--topology=v9z:2x2", "unknown TPU topology 'v9z:2x2'"),
    ("--tensor_parallel_size=3", "must divide the model's 4 query heads"),
    ("--data_parallel_size=8", "needs 8 devices; v5e:2x2 has 4"),
])
def test_bad_flags_one_line(tiny_dir, flag, message):
    args = ["compile", f"--model={tiny_dir}", *BUCKETS]
    args += [flag] if flag.startswith("--topology") else ["--topology=v5e:2x2", flag]
    proc = jaxserve(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("jaxserve compile")]) == 1


def test_host_mode_fills_the_cache(tmp_path, default_model_path):
    cache = tmp_path / "xla"
    proc = jaxserve("compile", f"--cache_dir={cache}", f"--model={default_model_path}", "--json",
                    *BUCKETS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["topology"] is None and report["cache_dir"] == str(cache)
    assert report["shapes"] > 0 and report["cache_files"] == len(os.listdir(cache)) > 0
