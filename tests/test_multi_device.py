"""Tensor and data parallelism on 4 virtual CPU devices (tests/multi_device_cases.py, run once
in a subprocess: the device count is fixed before JAX starts), and TP 3 across three local
processes (tests/multi_host_cases.py): greedy outputs equal to the single-device engine's with
prefix caching, chunked prefill, forced preemption, int8 KV pages and speculative decoding on;
the compiled step's collectives; the data-parallel router; clear errors for sizes that do not
fit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from jaxserve import backends
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from tiny_model import tiny_loaded

HERE = os.path.dirname(os.path.abspath(__file__))


def _env() -> dict:
    root = os.path.dirname(HERE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def cases() -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "multi_device_cases.py")],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model,case", [("tiny", "tp4"), ("smol", "tp3"), ("tiny", "dp2")])
def test_tensor_parallel_greedy_equals_single_device(cases, model, case):
    """tiny: 4 query heads over 2 KV heads (TP 4 repeats each KV head); smol: SmolLM2's 9 query
    and 3 KV heads (TP 3 shards them); dp2: two replicas."""
    one, many = cases["runs"][f"{model}-tp1"], cases["runs"][f"{model}-{case}"]
    assert many["outputs"] == one["outputs"]
    for run in (one, many):
        stats = run["stats"]
        assert stats["referenced_pages"] == 0
        assert stats["preemptions"] >= 1 and stats["prefix_cache_hits"] > 0
        assert stats["spec_drafted"] > 0
    # One device's KV: its share of the heads, at least one (tiny's 2 heads at TP 4: one each).
    hkv = {"tiny": 2, "smol": 3}[model]
    tp = int(case.split("-")[0][2:]) if case.startswith("tp") else 1
    share = max(hkv // tp, 1) / hkv
    assert many["stats"]["kv_pool_bytes_per_device"] == one["stats"]["kv_pool_bytes"] * share
    assert many["stats"]["weight_bytes_per_device"] < one["stats"]["weight_bytes"] or tp == 1


def test_windows_and_draft_model_under_tensor_parallelism(cases):
    """A model windowed at every layer (its pages before the window released) gives at TP 2
    its TP 1 greedy outputs; the draft method (the target as its own draft model, whole on
    the replica's first device) at TP 2 gives the plain TP 1 outputs."""
    one, two = cases["runs"]["window-tp1"], cases["runs"]["window-tp2"]
    assert two["outputs"] == one["outputs"]
    assert one["outputs"] != cases["runs"]["tiny-tp1"]["outputs"]  # the window matters
    draft = cases["runs"]["tiny-tp2-draft"]
    assert draft["outputs"] == cases["runs"]["tiny-tp1"]["outputs"]
    assert draft["stats"]["spec_drafted"] > 0 and draft["stats"]["referenced_pages"] == 0


def test_pallas_kernel_inside_shard_map(cases):
    """TP 2 with the TPU-style Pallas kernel (interpreted) on each device's KV heads: the
    single-device engine's first tokens (a shorter run: interpret mode is slow)."""
    from multi_device_cases import PALLAS_TOKENS

    one, pallas = cases["runs"]["tiny-tp1"], cases["runs"]["tiny-tp2-pallas"]
    assert pallas["outputs"] == [o[:PALLAS_TOKENS] for o in one["outputs"]]
    assert pallas["stats"]["referenced_pages"] == 0 and pallas["stats"]["prefix_cache_hits"] > 0


@pytest.mark.parametrize("name", ["tiny-tp4", "smol-tp3"])
def test_compiled_step_has_two_all_reduces_per_layer(cases, name):
    """After the attention output and the MLP down projection, nothing else: the pool and the
    weights stay where they are (no all-gather), the head is replicated."""
    hlo = cases["hlo"][name]
    layers = 2
    assert hlo["all_reduce"] == 2 * layers
    assert hlo["all_gather"] == 0 and hlo["all_to_all"] == 0
    hidden = {"tiny": 32, "smol": 72}[name.split("-")[0]]
    assert hlo["all_reduce_bytes"] == 2 * layers * hlo["tokens"] * hidden * 4  # f32


def test_data_parallel_router_places_by_prefix_and_load(cases):
    """DP 2 on a mixed workload added at once: each group sharing a first page lands on one
    replica, the two groups on different ones, the rest by load; greedy outputs equal the
    single-device engine's; the aborted request is gone from the replica that had it."""
    r = cases["router"]
    a, b = set(r["placed"]["a"]), set(r["placed"]["b"])
    assert len(a) == 1 and len(b) == 1 and a != b
    assert r["outputs"] == cases["mixed_reference"]
    placed = [i for replicas in r["placed"].values() for i in replicas]
    assert placed.count(0) == placed.count(1) == 6  # the 4 of their own went 2 and 2
    assert r["aborted"] and r["victim_routed"][r["victim_replica"]] == 1
    assert r["aborted_total"] == 1 and r["unfinished"] == [0, 0]
    assert r["referenced_pages"] == [0, 0]


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory) -> list[dict]:
    """tests/multi_host_cases.py as processes 0, 1 and 2 over loopback: their JSON lines. The
    model is an orbax checkpoint, which each process restores only its device's shards of."""
    from multi_device_cases import SMOL_SHAPED

    from jaxserve.weights import save_orbax
    from jaxserve.weights.random_init import random_model

    checkpoint = save_orbax(str(tmp_path_factory.mktemp("multi_host") / "smol"),
                            random_model(SMOL_SHAPED, seed=3, weight_scale=0.3))
    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multi_host_cases.py"),
                               str(port), str(i), checkpoint], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(3)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_three_processes_equal_single_device(cases, three_processes):
    """TP 3 over three processes of one CPU device each (gloo over loopback): process 0
    schedules and sends each step to the others; greedy outputs equal the single-device
    engine's, with prefix caching, chunked prefill, preemption, int8 KV and speculation on."""
    leader, *followers = three_processes
    one = cases["runs"]["smol-tp1"]
    assert leader["outputs"] == one["outputs"]
    stats = leader["stats"]
    assert stats["referenced_pages"] == 0 and stats["preemptions"] >= 1
    assert stats["kv_pool_bytes_per_device"] * 3 == one["stats"]["kv_pool_bytes"]
    steps = {f["steps"] for f in followers}
    assert len(steps) == 1 and steps.pop() > 0  # both ran every step process 0 launched


def test_sizes_that_do_not_fit_are_clear_errors():
    loaded = tiny_loaded()
    with pytest.raises(ValueError, match="must divide the model's 4 query heads"):
        LLMEngine(EngineConfig.from_options(model="x", tensor_parallel_size=3, huge_pages=False),
                  loaded)
    with pytest.raises(ValueError, match="needs 2 devices; this process has 1"):
        LLMEngine(EngineConfig.from_options(model="x", tensor_parallel_size=2, huge_pages=False),
                  loaded)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.from_options(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="attention_backend='xla'"):
        backends.resolve("cpu", tensor_parallel_size=2)
    assert backends.resolve("auto", tensor_parallel_size=2) != "cpu"
    with pytest.raises(ValueError, match="'draft' runs its model on process 0 alone"):
        EngineConfig.from_options(num_processes=2, coordinator_address="localhost:1234",
                                  speculative_config={"method": "draft"})


@pytest.mark.slow
def test_smollm2_at_tp3_equals_tp1(default_model_path):
    """The real SmolLM2-135M (3 KV heads: one a device) at TP 3 on three virtual devices gives
    the single-device engine's greedy tokens on the full-featured workload."""
    env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "smollm2_tp_cases.py"),
                           default_model_path], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    one, three = runs["tp1"], runs["tp3"]
    assert three["outputs"] == one["outputs"] and len(one["outputs"]) == 4
    for run in (one, three):
        assert run["stats"]["referenced_pages"] == 0 and run["stats"]["preemptions"] >= 1
    assert three["stats"]["kv_pool_bytes_per_device"] * 3 == one["stats"]["kv_pool_bytes"]
