"""Orbax checkpoints of mixtures of experts: tiny seeded Mixtral (every layer sparse), Qwen3-MoE
(layer 0 sparse, layer 1 dense: weights only some layers have) and gpt-oss (router and expert
biases, attention sinks) written by transformers' save_pretrained, loaded lazily, saved with
save_orbax. Loaded back eagerly they are the Hugging Face load's params (None at the same
layers); loaded lazily the runner restores them into the devices' shardings as place_params
places the HF load's (the same leaves, values and shardings), on one device and on two with
expert parallelism (own process); the Qwen3-MoE's engine greedy tokens from the orbax
checkpoint, eager and lazy, at TP 1 and at TP 2 with expert parallelism, equal the HF
directory's."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import TINY, seeded_model, tp_greedy  # noqa: E402
from jaxserve.weights import load_model, save_orbax  # noqa: E402
from jaxserve.weights.layer_stack import LayerStack  # noqa: E402
from jaxserve.weights.orbax_io import OrbaxParams  # noqa: E402

MODELS = ("mixtral", "qwen3_moe", "gpt_oss")
OPTIONS = dict(page_size=8, max_num_batched_tokens=32, max_num_seqs=4, num_pages=40,
               attention_backend="xla")  # the cpu backend packs on the host: no restore
PROMPTS = [[5, 9, 31, 77, 120, 4, 8], list(range(40, 80))]


def _hf_model(name: str):
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(**{**TINY, "intermediate_size": 48}, **moe,
                                         num_local_experts=4)
        return seeded_model(transformers.MixtralForCausalLM, cfg, {"gate.weight": 30.0})
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**TINY, **moe, num_experts=4, moe_intermediate_size=40,
                                          head_dim=16, mlp_only_layers=[1], norm_topk_prob=True)
        return seeded_model(transformers.Qwen3MoeForCausalLM, cfg,
                            {"gate.weight": 30.0, ".experts.": 3.0})
    cfg = transformers.GptOssConfig(**{**TINY, "intermediate_size": 32}, **moe, head_dim=16,
                                    num_local_experts=4, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    model = seeded_model(transformers.GptOssForCausalLM, cfg, {"router.weight": 30.0})
    with torch.no_grad():  # sinks and biases that matter (transformers starts them at 0)
        for param_name, w in model.named_parameters():
            if param_name.endswith(("sinks", "bias")):
                w.copy_(torch.randn_like(w))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF directory, orbax directory saved from its lazy load), each made once."""
    from jaxserve.weights.random_init import numbered_tokenizer

    @functools.cache
    def make(name: str):
        hf = str(tmp_path_factory.mktemp(name))
        _hf_model(name).save_pretrained(hf)
        numbered_tokenizer(TINY["vocab_size"], TINY["eos_token_id"]).save(hf)
        return hf, save_orbax(str(tmp_path_factory.mktemp(name) / "orbax"),
                              load_model(hf, lazy=True))

    return make


def _layers_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, stack in want.items():
        assert isinstance(got[name], LayerStack) == isinstance(stack, LayerStack), name
        for i in range(len(stack)):
            if stack[i] is None:
                assert got[name][i] is None, (name, i)
            else:
                np.testing.assert_array_equal(got[name][i], stack[i], err_msg=f"{name}[{i}]")


@pytest.mark.parametrize("name", MODELS)
def test_eager_load_is_the_hf_load(checkpoints, name):
    """Every weight equal; a weight only some layers have is None at the same layers."""
    hf, orbax = checkpoints(name)
    want, got = load_model(hf), load_model(orbax)
    assert got.config == want.config and got.fingerprint == want.fingerprint
    assert got.params.keys() == want.params.keys()
    _layers_equal(got.params["layers"], want.params["layers"])
    for key in want.params.keys() - {"layers"}:
        np.testing.assert_array_equal(got.params[key], want.params[key], err_msg=key)
    partial = {k for k, v in want.params["layers"].items() if isinstance(v, LayerStack)}
    assert partial == ({"w_gate", "w_up", "w_down", "router", "experts_gate", "experts_up",
                        "experts_down"} if name == "qwen3_moe" else set())


def test_a_newer_format_is_refused_by_name(tmp_path):
    from jaxserve.weights.orbax_io import FORMAT_VERSION, META_FILE

    (tmp_path / META_FILE).write_text(json.dumps({"format": "jaxserve-orbax",
                                                  "version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=f"format version {FORMAT_VERSION + 1}; this jaxserve "
                                         f"reads up to {FORMAT_VERSION}"):
        load_model(str(tmp_path))


def placed_leaves(runner) -> dict:
    """path -> (host value, PartitionSpec) of every leaf a runner placed."""
    import jax

    return {jax.tree_util.keystr(path): (np.asarray(leaf), leaf.sharding.spec)
            for path, leaf in jax.tree_util.tree_leaves_with_path(runner.params)}


def restored_equals_placed(hf: str, orbax: str, mesh, expert_parallel: bool) -> list[str]:
    """The runner's params restored from the lazy orbax load equal (leaves, values, specs)
    those placed from the HF directory's eager load; returns the names of the leaves."""
    from jaxserve.runtime.runner import ModelRunner

    lazy = load_model(orbax, lazy=True)
    assert isinstance(lazy.params, OrbaxParams)
    runners = [ModelRunner(loaded.config, loaded.params, num_pages=4, page_size=8, mesh=mesh,
                           expert_parallel=expert_parallel)
               for loaded in (lazy, load_model(hf))]
    got, want = (placed_leaves(r) for r in runners)
    assert got.keys() == want.keys()
    for path, (value, spec) in want.items():
        assert got[path][1] == spec, path
        np.testing.assert_array_equal(got[path][0], value, err_msg=path)
    return sorted({path.rsplit("'", 2)[-2] for path in want})


@pytest.mark.parametrize("name", MODELS)
def test_lazy_restore_places_what_the_hf_load_places(checkpoints, name):
    """One device: every leaf of every layer (experts, routers, biases, sinks, the dense
    layer's MLP) restored into place as place_params places it."""
    names = restored_equals_placed(*checkpoints(name), mesh=None, expert_parallel=False)
    assert set(names) == _leaf_names(name)


def _leaf_names(name: str, expert_parallel: bool = False) -> set[str]:
    names = {"embed", "final_norm", "lm_head", "attn_norm", "w_qkv", "wo", "mlp_norm", "router",
             "experts_gate_up", "experts_down"} | ({"expert_ids"} if expert_parallel else set())
    if name == "qwen3_moe":  # q/k norms; layer 1 dense
        return names | {"q_norm", "k_norm", "w_gate_up", "w_down"}
    if name == "gpt_oss":
        return names | {"b_qkv", "bo", "sinks", "router_bias", "experts_gate_up_bias",
                        "experts_down_bias"}
    return names


def _greedy(directory: str, lazy: bool) -> list[list[int]]:
    from jaxserve.config import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import LLM

    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), load_model(directory, lazy=lazy))
    outs = LLM.from_engine(engine).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def hf_tokens(checkpoints) -> list[list[int]]:
    return _greedy(checkpoints("qwen3_moe")[0], lazy=True)


@pytest.mark.parametrize("lazy", [False, True])
def test_orbax_greedy_tokens_equal_the_hf_directory(checkpoints, hf_tokens, lazy):
    assert len(hf_tokens) == 2 and all(len(t) == 6 for t in hf_tokens)
    assert _greedy(checkpoints("qwen3_moe")[1], lazy) == hf_tokens


_EP_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_orbax_moe import OPTIONS, PROMPTS, restored_equals_placed
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.runtime import sharding
from jaxserve.weights import load_model
cases = json.loads(sys.argv[2])
mesh = sharding.make_mesh(2)
leaves = {name: restored_equals_placed(hf, orbax, mesh, True) for name, (hf, orbax) in cases.items()}
engine = LLMEngine(EngineConfig.from_options(**OPTIONS, tensor_parallel_size=2,
                                             enable_expert_parallel=True),
                   load_model(cases["qwen3_moe"][1], lazy=True))
layer = engine.runner.params["layers"][0]
outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in PROMPTS],
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps({"leaves": leaves, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "expert_shard": layer["experts_gate_up"].sharding.shard_shape(
                      layer["experts_gate_up"].shape)}))
"""


def test_expert_parallel_restore_at_tp2(checkpoints, hf_tokens):
    """Two virtual CPU devices (own process), experts spread over them: the Qwen3-MoE's and
    gpt-oss's restored params equal place_params' (expert_ids, experts and their biases
    sharded on the expert axis, sinks by query head), and the Qwen3-MoE's greedy tokens from
    the lazy orbax load are one device's from the HF directory."""
    import os

    cases = {name: checkpoints(name) for name in ("qwen3_moe", "gpt_oss")}
    got = tp_greedy(_EP_SCRIPT, os.path.dirname(os.path.abspath(__file__)), json.dumps(cases))
    assert {name: set(names) for name, names in got["leaves"].items()} == {
        name: _leaf_names(name, expert_parallel=True) for name in cases}
    assert got["expert_shard"] == [2, 64, 2 * 40]  # 4 experts, 2 a device
    assert got["tokens"] == hf_tokens
