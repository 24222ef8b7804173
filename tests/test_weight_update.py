"""Weights updated in place and memory given back (engine/weight_update.py, docs/rl.md), on the
tiny seeded model: after update_weights the greedy tokens equal a fresh engine loaded from a
checkpoint of those weights, nothing compiles and no prefix cached before is hit; in-flight
requests finish or fail by the caller's choice; sleep / wake_up round trips."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
import torch

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.engine.weight_update import EngineAsleep
from jaxserve.llm import LLM
from jaxserve.weights import LoadedModel, params_from_hf_state_dict

from tiny_model import tiny_loaded

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = "a prompt long enough to fill three pages"  # 40 bytes: 5 full pages of 8
OPTIONS = dict(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64)
# (loaders' key, Hugging Face suffix, stored transposed) of the tiny Llama's layer weights
LAYER_NAMES = [("attn_norm", "input_layernorm.weight", False),
               ("wq", "self_attn.q_proj.weight", True), ("wk", "self_attn.k_proj.weight", True),
               ("wv", "self_attn.v_proj.weight", True), ("wo", "self_attn.o_proj.weight", True),
               ("mlp_norm", "post_attention_layernorm.weight", False),
               ("w_gate", "mlp.gate_proj.weight", True), ("w_up", "mlp.up_proj.weight", True),
               ("w_down", "mlp.down_proj.weight", True)]

_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _seconds, **_: _compiles.append(event) if event in (
        "/jax/core/compile/backend_compile_duration",
        "/jax/core/compile/jaxpr_trace_duration") else None)


def hf_state_dict(params: dict) -> dict:
    """The loaders' layout -> a Hugging Face checkpoint's names and layout ([out, in])."""
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    for key, suffix, transposed in LAYER_NAMES:
        for i, w in enumerate(params["layers"][key]):
            sd[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w.T if transposed else w)
    return sd


def perturbed(seed: int, layers=None) -> dict:
    """The tiny model's checkpoint with noise on every weight (of `layers` only, if given)."""
    rng = np.random.default_rng(seed)
    sd = hf_state_dict(tiny_loaded().params)
    for name, w in sd.items():
        if layers is None or any(name.startswith(f"model.layers.{i}.") for i in layers):
            sd[name] = (w + 0.2 * rng.standard_normal(w.shape)).astype(np.float32)
    return sd


def fresh_tokens(sd: dict, prompts=(PROMPT,)) -> list[list[int]]:
    """Greedy tokens of a new engine loaded from the checkpoint `sd` (the loader's conversion)."""
    base = tiny_loaded()
    loaded = LoadedModel(base.config, params_from_hf_state_dict(base.config, sd),
                         base.tokenizer, fingerprint="fresh", source="test")
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_options(**OPTIONS), loaded))
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    engine.warmup(compile_threads=2)
    return LLM.from_engine(engine)


def generate(llm: LLM, prompts=(PROMPT,)):
    return llm.generate(list(prompts), GREEDY, use_tqdm=False)


def test_named_update_equals_a_fresh_engine_without_compiling_or_old_prefixes(llm):
    generate(llm)
    assert generate(llm)[0].num_cached_tokens > 0  # the prompt's pages are cached
    sd = perturbed(1)
    version, compilations = llm.engine.weights_version, llm.engine.compilations
    # numpy, torch and JAX arrays alike
    named = [(n, torch.from_numpy(w) if "mlp" in n else jax.numpy.asarray(w) if "attn" in n
              else w) for n, w in sd.items()]
    del _compiles[:]
    llm.update_weights(named)
    out = generate(llm)[0]
    assert _compiles == [] and llm.engine.compilations == compilations
    assert out.num_cached_tokens == 0  # pages of the old weights are not reused
    assert out.weights_version == version + 1
    assert [out.outputs[0].token_ids] == fresh_tokens(sd)


def test_partial_update_replaces_whole_layers_and_refuses_part_of_one(llm):
    full = perturbed(2)
    llm.update_weights(full)
    one_layer = perturbed(3, layers=[1])
    llm.update_weights({n: w for n, w in one_layer.items() if n.startswith("model.layers.1.")})
    expected = {**full, **{n: w for n, w in one_layer.items() if n.startswith("model.layers.1.")}}
    assert [generate(llm)[0].outputs[0].token_ids] == fresh_tokens(expected)
    with pytest.raises(ValueError, match="k_proj"):
        llm.update_weights([("model.layers.0.self_attn.q_proj.weight",
                             full["model.layers.0.self_attn.q_proj.weight"])])
    with pytest.raises(ValueError, match="does not use"):
        llm.update_weights({**full, "model.layers.0.mlp.extra.weight": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights({**full, "model.norm.weight": np.zeros(5, np.float32)})


def test_engine_layout_tree_is_used_without_a_copy(llm):
    sd = perturbed(4)
    base = tiny_loaded()
    other = LLMEngine(EngineConfig.from_options(**OPTIONS), LoadedModel(
        base.config, params_from_hf_state_dict(base.config, sd), base.tokenizer, "other", "t"))
    like = llm.params_like()
    assert jax.tree_util.tree_structure(like) == jax.tree_util.tree_structure(other.params_like())
    tree = jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x), x.sharding),
                                  other.runner.params)
    compilations = llm.engine.compilations
    del _compiles[:]
    llm.update_weights(tree)
    held = jax.tree_util.tree_leaves(llm.engine.runner.params)
    assert all(a is b for a, b in zip(held, jax.tree_util.tree_leaves(tree)))  # no copy
    out = generate(llm)[0]
    assert _compiles == [] and llm.engine.compilations == compilations
    assert [out.outputs[0].token_ids] == fresh_tokens(sd)
    bad = {**tree, "final_norm": np.zeros(7, np.float32)}
    with pytest.raises(ValueError, match="final_norm"):
        llm.update_weights(bad)


def test_in_flight_requests_finish_or_fail_by_choice(llm):
    engine, sd = llm.engine, perturbed(5)
    version = engine.weights_version
    for i in range(2):
        engine.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=0),
                           request_id=f"finish-{i}")
    engine.step()
    outs = engine.update_weights(sd, in_flight="finish")
    done = {o.request_id: o for o in outs if o.finished}
    assert sorted(done) == ["finish-0", "finish-1"]
    assert all(len(o.outputs[0].token_ids) == 20 and o.weights_version == version
               for o in done.values())
    for i in range(2):
        engine.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=0),
                           request_id=f"abort-{i}")
    engine.step()
    outs = engine.update_weights(sd, in_flight="abort")
    assert sorted(o.request_id for o in outs) == ["abort-0", "abort-1"]
    assert all(o.finished and o.outputs[0].finish_reason == "error" and
               "update_weights" in o.error and o.weights_version == version + 1 for o in outs)
    assert not engine.has_unfinished()
    usage = engine.kv_usage()
    assert usage["referenced_pages"] == 0, usage  # every page returned
    engine.scheduler.check_invariants()
    assert generate(llm)[0].weights_version == version + 2
    with pytest.raises(ValueError, match="in_flight"):
        engine.update_weights(sd, in_flight="keep")


def test_pause_holds_steps_until_resume(llm):
    llm.engine.pause()
    llm.engine.add_request(PROMPT, GREEDY, request_id="paused")
    assert llm.engine.step() == [] and llm.engine.step() == []
    with pytest.raises(ValueError, match="resume"):
        llm.update_weights(perturbed(6))
    llm.engine.resume()
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_sleep_and_wake_up_give_the_same_outputs(llm):
    before = generate(llm)[0].outputs[0].token_ids
    held = llm.engine.runner.memory_stats()
    compilations = llm.engine.compilations
    del _compiles[:]
    llm.sleep(level=1)
    assert llm.engine.runner.memory_stats()["kv_pool_bytes"] == 0
    with pytest.raises(EngineAsleep, match="wake_up"):
        generate(llm)
    llm.wake_up()
    out = generate(llm)[0]
    assert out.outputs[0].token_ids == before and out.num_cached_tokens == 0
    sd = perturbed(7)
    llm.sleep(level=2)
    stats = llm.engine.runner.memory_stats()
    assert stats["kv_pool_bytes"] == 0 and stats["weight_bytes"] == 0
    llm.wake_up()
    with pytest.raises(EngineAsleep, match="update_weights"):
        generate(llm)
    llm.update_weights(sd)
    assert llm.engine.runner.memory_stats() == held
    tokens = generate(llm)[0].outputs[0].token_ids
    assert _compiles == [] and llm.engine.compilations == compilations
    assert [tokens] == fresh_tokens(sd)


def test_async_engine_updates_between_steps(llm):
    from jaxserve.engine.async_engine import AsyncEngine

    engine, sd = llm.engine, perturbed(8)
    version, prompt = engine.weights_version, {"prompt_token_ids": engine.tokenize(PROMPT)[1]}
    server = AsyncEngine(engine)

    async def run():
        params = SamplingParams(max_tokens=12, temperature=0)
        group = await server.add([prompt] * 2, params)
        await server.update_weights(sd)  # in_flight="finish": the group ends on the old weights
        old = [out async for _, out in group if out.finished]
        group = await server.add([prompt], GREEDY)
        new = [out async for _, out in group if out.finished]
        return old, new

    try:
        old, new = asyncio.run(run())
    finally:
        server.shutdown()
    assert [o.weights_version for o in old] == [version, version]
    assert all(len(o.outputs[0].token_ids) == 12 for o in old)
    assert new[0].weights_version == version + 1
    assert [new[0].outputs[0].token_ids] == fresh_tokens(sd)


@pytest.mark.parametrize("options", [dict(scan_layers="on"), dict(quantization="int8")])
def test_update_goes_through_scanned_layers_and_quantization(options):
    """The scanned layout (layers stacked on device) and int8 weights, as a fresh load makes
    them, without compiling."""
    sd, base = perturbed(11), tiny_loaded()
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_options(**OPTIONS, **options), base))
    generate(llm)
    compilations = llm.engine.compilations
    del _compiles[:]
    llm.update_weights(sd)
    tokens = generate(llm)[0].outputs[0].token_ids
    assert _compiles == [] and llm.engine.compilations == compilations
    fresh = LLM.from_engine(LLMEngine(EngineConfig.from_options(**OPTIONS, **options), LoadedModel(
        base.config, params_from_hf_state_dict(base.config, sd), base.tokenizer, "f", "t")))
    assert tokens == generate(fresh)[0].outputs[0].token_ids


DP_PROMPTS = [PROMPT, "another prompt", "a third one, longer than the others", "four"]
DATA_PARALLEL = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
sys.path.insert(0, "tests")
from test_weight_update import DP_PROMPTS as prompts, OPTIONS, GREEDY, perturbed
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import make_engine
from jaxserve.llm import LLM
from tiny_model import tiny_loaded

engine = make_engine(EngineConfig.from_options(**OPTIONS, attention_backend="xla",
                                               data_parallel_size=2), tiny_loaded())
llm = LLM.from_engine(engine)
tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
before, sd = tokens(), perturbed(31)
for i, p in enumerate(prompts):
    engine.add_request(p, SamplingParams(max_tokens=30, temperature=0), request_id=f"r{i}")
engine.step()
engine.pause()
paused_refused = False
try:
    engine.update_weights(sd)
except ValueError:
    paused_refused = engine.weights_version == 0
aborted = engine.update_weights(sd, in_flight="abort")
engine.resume()
after = tokens()
engine.sleep(1)
asleep = engine.is_sleeping and all(r.runner.pool is None for r in engine.replicas)
engine.wake_up()
print(json.dumps({"before": before, "after": after, "again": tokens(), "asleep": asleep,
                  "paused_refused": paused_refused, "unfinished": engine.has_unfinished(),
                  "replicas_used": [n > 0 for n in engine.router.requests],
                  "aborted": sorted(o.request_id for o in aborted if o.finished),
                  "versions": [r.weights_version for r in engine.replicas]}))
"""


def test_data_parallel_engine_updates_pauses_and_sleeps_every_replica():
    """DataParallelEngine's RolloutControl on 2 virtual CPU devices (in a subprocess: the
    device count is read when JAX starts)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", DATA_PARALLEL], capture_output=True, text=True,
                          cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["replicas_used"] == [True, True] and got["versions"] == [1, 1]
    assert got["paused_refused"] and got["asleep"] and not got["unfinished"]
    assert got["aborted"] == ["r0", "r1", "r2", "r3"]
    assert got["after"] == fresh_tokens(perturbed(31), DP_PROMPTS)
    assert got["after"] != got["before"] and got["again"] == got["after"]
