"""Expert parallelism (`enable_expert_parallel`): a mixture of experts' experts spread over the
tensor-parallel devices, attention tensor parallel. A tiny seeded Qwen3-MoE written by
transformers' save_pretrained (2 layers, hidden 64, 8 experts of 40 columns, top-2; layer 0
sparse, layer 1 dense) is served on 4 virtual CPU devices (this file run as a script in a
subprocess: the device count is fixed before JAX starts) at TP 1, TP 4 with the experts
replicated and TP 4 with them spread (also with the layers scanned): greedy tokens
equal for requests batched with chunked prefill, per-device weights hold E / tp experts, and the
compiled step issues exactly one all-reduce more than replicated experts (the sparse layer's
[T, H] output) and no other collective. In process: moe.sparse_mlp's per-device parts sum to
one device's output, and expert counts that do not divide are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

E, K, MOE_I, PAGE = 8, 2, 40, 8
OPTIONS = dict(page_size=PAGE, max_num_batched_tokens=32, max_num_seqs=4, num_pages=48,
               attention_backend="xla", dtype="float32", huge_pages=False)
RUNS = {"tp1": {}, "tp4": dict(tensor_parallel_size=4),
        "tp4-ep": dict(tensor_parallel_size=4, enable_expert_parallel=True,
                       memory_budget_bytes=2 ** 28, num_pages=None),  # planned
        "tp4-ep-scan": dict(tensor_parallel_size=4, enable_expert_parallel=True,
                            scan_layers="on")}


def _checkpoint(directory: str) -> None:
    """The tiny Qwen3-MoE, seeded, routers sharpened so that choices are clear."""
    import torch
    import transformers

    from hf_families import TINY
    from jaxserve.weights.random_init import numbered_tokenizer

    cfg = transformers.Qwen3MoeConfig(**TINY, num_experts=E, num_experts_per_tok=K,
                                      moe_intermediate_size=MOE_I, head_dim=16,
                                      mlp_only_layers=[1], norm_topk_prob=True,
                                      hidden_act="silu", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval().float()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("gate.weight"):
                w.mul_(30.0)
            if ".experts." in name:
                w.mul_(3.0)
    model.save_pretrained(directory)
    numbered_tokenizer(TINY["vocab_size"], TINY["eos_token_id"]).save(directory)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 200, n)] for n in (7, 45, 70, 12)]


def _cases(directory: str) -> dict:
    """Each run's greedy tokens, weight bytes per device, expert shard shapes and the compiled
    steps' collectives (a decode step and the largest step)."""
    from multi_device_cases import collectives
    from jaxserve.config import EngineConfig, ParallelConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import LLM
    from jaxserve.runtime import abstract
    from jaxserve.weights import load_model

    out = {}
    for name, extra in RUNS.items():
        engine = LLMEngine(EngineConfig.from_options(**{**OPTIONS, **extra}),
                           load_model(directory))
        outs = LLM.from_engine(engine).generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        runner = engine.runner
        layers = runner.params["layers"]
        sparse = layers["stacked"][0] if isinstance(layers, dict) else layers[0]
        placed = abstract.abstract_params(engine.model_config, runner.mesh, "float32",
                                          scan_layers=runner.scan_layers,
                                          expert_parallel=bool(extra.get(
                                              "enable_expert_parallel")))
        out[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "weight_bytes_per_device": runner.memory_stats()["weight_bytes_per_device"],
            "abstract_bytes_per_device": abstract.bytes_per_device(placed),
            "expert_shard": list(sparse["experts_gate_up"].sharding.shard_shape(
                sparse["experts_gate_up"].shape)),
            "hlo": collectives(engine),
            "plan_weight_bytes": engine.memory_plan and engine.memory_plan.weight_bytes}
        engine.scheduler.check_invariants()
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    directory = str(tmp_path_factory.mktemp("qwen3_moe_ep"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), directory],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_expert_parallel_tokens_equal_one_device(cases):
    """Four requests (two longer than a 32-token chunk) batched, 8 greedy tokens each."""
    want = cases["tp1"]["tokens"]
    assert len(want) == 4 and all(len(t) == 8 for t in want)
    for name in RUNS:
        assert cases[name]["tokens"] == want, name


def test_each_device_holds_its_experts_only(cases):
    """Per device: E / 4 whole experts (of hidden 64, 2 x 40 gate/up columns) where spread,
    all E where replicated; the weights shrink by the other devices' experts (less their
    expert_ids), and jaxserve compile's abstract params and the memory plan (a budget at
    tp4-ep) count what the runner placed."""
    assert cases["tp4"]["expert_shard"] == [E, 64, 2 * MOE_I]
    assert cases["tp4-ep"]["expert_shard"] == [E // 4, 64, 2 * MOE_I]
    assert cases["tp4-ep-scan"]["expert_shard"] == [1, E // 4, 64, 2 * MOE_I]  # [blocks, ...]
    expert_bytes = E * 3 * 64 * MOE_I * 4  # one sparse layer, float32
    for spread in ("tp4-ep", "tp4-ep-scan"):
        saved = expert_bytes * 3 // 4 - 4 * E // 4  # int32 expert_ids, E / 4 a device
        assert (cases["tp4"]["weight_bytes_per_device"]
                - cases[spread]["weight_bytes_per_device"]) == saved, spread
    for name in RUNS:
        assert (cases[name]["abstract_bytes_per_device"]
                == cases[name]["weight_bytes_per_device"]), name
    assert cases["tp4-ep"]["plan_weight_bytes"] == cases["tp4-ep"]["weight_bytes_per_device"]


def test_expert_parallel_collectives(cases):
    """Replicated experts: 3 all-reduces a step (two layers' attention outputs, the dense
    layer's MLP); spread experts: one more, the sparse layer's output [T, H] in float32, and
    neither all-gather nor all-to-all."""
    hidden = 64
    for name, reduces in (("tp4", 3), ("tp4-ep", 4), ("tp4-ep-scan", 4)):
        hlo = cases[name]["hlo"]
        assert hlo["all_reduce"] == reduces, (name, hlo)
        assert hlo["all_gather"] == 0 and hlo["all_to_all"] == 0, (name, hlo)
        assert hlo["all_reduce_bytes"] == reduces * hlo["tokens"] * hidden * 4, (name, hlo)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_expert_shards_sum_to_one_device(tokens, int8):
    """sparse_mlp on each device's slice of the experts (its expert_ids, the others' pairs
    weighing 0), summed over 2 and over 4 shards, equals all experts on one device: 1 token
    (2 pairs, no more than a shard's experts: each pair's expert gathered) and 13 tokens
    (grouped matmuls); float experts, and int8 ones sliced alike (quantization='int8')."""
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.model import moe
    from jaxserve.model.quantize import quantize_weight

    rng = np.random.default_rng(5)
    h, inter = 32, 32
    cfg = ModelConfig(vocab_size=8, hidden_size=h, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=E,
                      num_experts_per_tok=K, moe_intermediate_size=inter)
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    lp = {"router": rng.standard_normal((E, h)).astype(np.float32),
          "experts_gate_up": rng.standard_normal((E, h, 2 * inter)).astype(np.float32) * 0.3,
          "experts_down": rng.standard_normal((E, inter, h)).astype(np.float32) * 0.3}
    if int8:
        lp.update({k: quantize_weight(lp[k]) for k in ("experts_gate_up", "experts_down")})
    def shard(w, s: int, n: int):  # device s's n experts
        return w.take(slice(s * n, (s + 1) * n)) if int8 else w[s * n:(s + 1) * n]

    run = jax.jit(lambda x, lp: moe.sparse_mlp(cfg, x, lp, jax.nn.silu, lambda y: y))
    whole = np.asarray(run(x, lp))
    _, chosen = moe.route(x @ lp["router"].T, K, cfg.norm_topk_prob)
    for shards in (2, 4):
        n = E // shards
        parts = [np.asarray(run(x, {**lp, "expert_ids": np.arange(s * n, (s + 1) * n,
                                                                  dtype=np.int32),
                                    "experts_gate_up": shard(lp["experts_gate_up"], s, n),
                                    "experts_down": shard(lp["experts_down"], s, n)}))
                 for s in range(shards)]
        np.testing.assert_allclose(np.sum(parts, axis=0), whole, atol=2e-5, rtol=2e-5)
        # A token none of whose experts a shard holds gets exactly 0 from it (weight 0).
        for s, part in enumerate(parts):
            here = np.any(np.asarray(chosen) // n == s, axis=1)
            assert np.all(part[~here] == 0) and np.all(np.abs(part[here]).sum(axis=1) > 0)


# Only config.json: `jaxserve compile` reads no weights.
COMPILE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 256,
                  "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": 128,
                  "norm_topk_prob": True, "mlp_only_layers": [1], "vocab_size": 512,
                  "max_position_embeddings": 256, "tie_word_embeddings": False,
                  "eos_token_id": 1}


def test_jaxserve_compile_counts_experts_per_device(tmp_path):
    """`jaxserve compile --enable_expert_parallel` for v5e:2x2 at TP 4 (compile-only, every
    warm-up shape): every step compiles (megablox inside the shard_map) and the plan's weights
    per device are the replicated layout's less 3/4 of the sparse layer's bf16 experts (plus
    each device's 2 expert ids)."""
    pytest.importorskip("libtpu")
    from jaxserve.runtime import abstract, sharding
    from jaxserve.runtime.topology import tpu_topology
    from jaxserve.weights.model_config import read_model_config

    (tmp_path / "config.json").write_text(json.dumps(COMPILE_CONFIG))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli.main", "compile", "--topology=v5e:2x2",
         f"--model={tmp_path}", "--json", "--tensor_parallel_size=4", "--enable_expert_parallel",
         "--max_num_seqs=1", "--max_num_batched_tokens=8", "--max_model_len=32"],
        cwd=os.path.dirname(HERE), env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["failures"] == [] and report["fits"] and report["shapes"] > 0
    mesh = sharding.replica_mesh(sharding.make_mesh(
        4, devices=tpu_topology("v5e:2x2").devices), 0)
    replicated = abstract.bytes_per_device(abstract.abstract_params(
        read_model_config(str(tmp_path)), mesh, "bfloat16"))
    experts = E * 3 * 128 * 128 * 2
    assert replicated - report["per_device"]["weight_bytes"] == experts * 3 // 4 - 4 * E // 4


def test_experts_that_do_not_divide_are_refused():
    """8 experts over 3 devices: refused before any device is asked for; without expert
    parallelism (replicated experts) and for a dense model the count does not matter."""
    from jaxserve.config import ModelConfig
    from jaxserve.runtime import sharding

    moe_cfg = ModelConfig(vocab_size=8, hidden_size=48, intermediate_size=48, num_layers=1,
                          num_heads=12, num_kv_heads=6, head_dim=8, num_experts=E,
                          num_experts_per_tok=K, moe_intermediate_size=24)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 8 "
                                         "experts"):
        sharding.check_fits(moe_cfg, 3, expert_parallel=True)
    sharding.check_fits(moe_cfg, 3, expert_parallel=False)
    sharding.check_fits(moe_cfg, 4 // 2, expert_parallel=True)
    dense = ModelConfig(vocab_size=8, hidden_size=48, intermediate_size=48, num_layers=1,
                        num_heads=12, num_kv_heads=6, head_dim=8)
    sharding.check_fits(dense, 3, expert_parallel=True)


def test_the_flag_and_keyword():
    """--enable_expert_parallel from the generated flags, enable_expert_parallel=True as LLM's
    keyword; a non-boolean is refused."""
    from absl import flags

    from jaxserve.cli import engine_flags
    from jaxserve.config import EngineConfig, ParallelConfig

    values = flags.FlagValues()
    engine_flags.define_flags(ParallelConfig, values)
    values(["prog", "--enable_expert_parallel", "--tensor_parallel_size=2"])
    parallel = engine_flags.config_of(ParallelConfig, values)
    assert parallel.enable_expert_parallel and parallel.tensor_parallel_size == 2
    assert not EngineConfig().parallel.enable_expert_parallel
    config = EngineConfig.from_options(enable_expert_parallel=True)
    assert config.parallel.enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        EngineConfig.from_options(enable_expert_parallel="yes")


if __name__ == "__main__":  # the subprocess of the `cases` fixture: 4 virtual devices
    os.makedirs(sys.argv[1], exist_ok=True)
    if not os.path.exists(os.path.join(sys.argv[1], "config.json")):
        _checkpoint(sys.argv[1])
    print(json.dumps(_cases(sys.argv[1])))
