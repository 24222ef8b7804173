"""Weights placed shard by shard (tests/shard_load_cases.py, in a subprocess with 4 virtual CPU
devices): GGUF, Hugging Face safetensors and orbax checkpoints of one tiny Qwen2 model served
at TP 1, 2 and 4 give the same greedy tokens (GGUF and safetensors read one layer at a time,
orbax restored straight into the devices' shardings and fused there), and each device holds exactly its share of every sharded
weight (never a whole copy) and all of every replicated one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDED = ("w_qkv", "b_qkv", "w_gate_up", "wo", "w_down")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "shard_load_cases.py"),
                           str(tmp_path_factory.mktemp("shard_load"))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_format_and_tp_gives_the_single_device_tokens(cases):
    runs = cases["runs"]
    want = runs["gguf-tp1"]["outputs"]
    assert len(runs) == 9 and all(len(o) == 8 for o in want)
    for name, run in runs.items():
        assert run["outputs"] == want, name
        assert run["read_as"] == ("OrbaxParams" if name.startswith("orbax") else "LayerStack")


@pytest.mark.parametrize("source", ["gguf", "hf", "orbax"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_only_its_shard(cases, source, tp):
    c = cases["config"]
    one = cases["runs"][f"{source}-tp1"]["leaves"]
    run = cases["runs"][f"{source}-tp{tp}"]
    kv_per_device = max(1, c["num_kv_heads"] // tp)  # 2 KV heads at TP 4: each repeated
    qkv_rows = (c["num_heads"] // tp + 2 * kv_per_device) * c["head_dim"]
    assert run["leaves"].keys() == one.keys()
    for path, leaf in run["leaves"].items():
        name = path.rsplit("'", 2)[-2]
        assert len(leaf["per_device"]) == tp, path
        if name in ("w_qkv", "b_qkv"):
            row_bytes = 4 * (c["hidden_size"] if name == "w_qkv" else 1)
            assert leaf["per_device"] == [qkv_rows * row_bytes] * tp, path
        elif name in SHARDED:
            assert leaf["per_device"] == [one[path]["nbytes"] // tp] * tp, path
        else:  # embedding, head, norms: whole on every device
            assert leaf["per_device"] == [one[path]["nbytes"]] * tp, path
    assert run["weight_bytes_per_device"] == sum(
        leaf["per_device"][0] for leaf in run["leaves"].values())
