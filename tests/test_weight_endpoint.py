"""The server's weight and memory endpoints (server/weight_routes.py, docs/rl.md) on the tiny
seeded model: an update from a safetensors directory, a jaxserve orbax checkpoint or an orbax
checkpoint of params_like() gives a fresh engine's greedy text for those weights; a bad path or
shape is a 400 and the old weights serve on; requests in flight finish or fail as asked; the
endpoints need the flag and a key, and the flag without a key refuses to start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.server import AsyncEngine, ServerConfig, build_app
from jaxserve.weights import LoadedModel, params_from_hf_state_dict, save_orbax
from serving import serve_app
from test_weight_update import OPTIONS, PROMPT, perturbed
from tiny_model import tiny_loaded

httpx = pytest.importorskip("httpx")

KEY = "rl-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


def loaded_from(sd: dict) -> LoadedModel:
    base = tiny_loaded()
    return LoadedModel(base.config, params_from_hf_state_dict(base.config, sd), base.tokenizer,
                       fingerprint="fresh", source="test")


def fresh_text(sd: dict) -> str:
    """The greedy text of a new engine loaded with the checkpoint `sd`."""
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_options(**OPTIONS), loaded_from(sd)))
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0),
                        use_tqdm=False)[0].outputs[0].text


def safetensors_dir(directory, sd: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()},
              os.path.join(directory, "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def aengine():
    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    aengine = AsyncEngine(engine)
    aengine.warm_up(compile_threads=2).result(timeout=300)
    yield aengine
    aengine.shutdown()


@pytest.fixture(scope="module")
def url(aengine):
    config = ServerConfig(api_key=KEY, served_model_names=("tiny",), enable_weight_updates=True)
    with serve_app(build_app(aengine, config)) as url:
        yield url


def text(url: str, **extra) -> str:
    r = httpx.post(url + "/v1/completions", json={**BODY, **extra}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def update(url: str, path: str, **extra) -> httpx.Response:
    return httpx.post(url + "/update_weights", json={"path": path, **extra}, headers=AUTH,
                      timeout=120)


def on_loop(aengine, fn):
    return asyncio.run(aengine.call(fn))


def test_update_from_safetensors_gives_the_new_weights_outputs(url, aengine, tmp_path):
    sd = perturbed(21)
    version = on_loop(aengine, lambda e: e.weights_version)
    r = update(url, safetensors_dir(tmp_path / "st", sd))
    assert r.status_code == 200, r.text
    assert r.json()["weights_version"] == version + 1 and r.json()["seconds"] > 0
    assert text(url) == fresh_text(sd)
    # SGLang's name and field
    sd = perturbed(22)
    r = httpx.post(url + "/update_weights_from_disk", headers=AUTH, timeout=120,
                   json={"model_path": safetensors_dir(tmp_path / "st2", sd)})
    assert r.status_code == 200 and r.json()["weights_version"] == version + 2, r.text
    assert text(url) == fresh_text(sd)


def test_update_from_orbax_checkpoints(url, aengine, tmp_path):
    """save_orbax's layout (the loaders'), then the engine's own (params_like) saved by orbax."""
    import orbax.checkpoint as ocp

    sd = perturbed(23)
    path = save_orbax(str(tmp_path / "saved"), loaded_from(sd))
    assert update(url, path).status_code == 200
    expected = fresh_text(sd)
    assert text(url) == expected
    params = on_loop(aengine, lambda e: e.runner.params)
    ocp.PyTreeCheckpointer().save(str(tmp_path / "tree"), params)
    assert update(url, safetensors_dir(tmp_path / "other", perturbed(24))).status_code == 200
    assert text(url) != expected
    r = update(url, str(tmp_path / "tree"))
    assert r.status_code == 200, r.text
    assert text(url) == expected


def test_bad_paths_and_shapes_are_400s_and_the_old_weights_serve_on(url, aengine, tmp_path):
    before, version = text(url), on_loop(aengine, lambda e: e.weights_version)
    sd = perturbed(25)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :7]
    notes = tmp_path / "notes.txt"
    notes.write_text("not weights")
    cases = {str(tmp_path / "missing"): "no such file", str(notes): "not .safetensors",
             str(tmp_path): "holds no",
             safetensors_dir(tmp_path / "bad", sd): "up_proj"}
    for path, message in cases.items():
        r = update(url, path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "path", error
    for body in ({}, {"path": 3}, {"path": str(notes), "in_flight": "keep"}):
        r = httpx.post(url + "/update_weights", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("path", "in_flight")
    r = httpx.post(url + "/update_weights", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert text(url) == before
    assert on_loop(aengine, lambda e: e.weights_version) == version


def test_requests_in_flight_finish_or_fail_as_asked(url, aengine, tmp_path):
    path = safetensors_dir(tmp_path / "st", perturbed(26))
    long = dict(max_tokens=160, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # paused, a request waits in the engine: "finish" is refused, "abort" fails it
        assert httpx.post(url + "/pause", headers=AUTH).json() == {"is_paused": True}
        assert httpx.get(url + "/is_paused", headers=AUTH).json() == {"is_paused": True}
        waiting = pool.submit(httpx.post, url + "/v1/completions", json={**BODY, **long},
                              headers=AUTH, timeout=60)
        deadline = time.monotonic() + 30
        while not on_loop(aengine, lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = update(url, path)
        assert r.status_code == 400 and "resume" in r.json()["error"]["message"], r.text
        r = update(url, path, in_flight="abort")
        assert r.status_code == 200 and r.json()["requests_in_flight"] == 1, r.text
        failed = waiting.result(timeout=60)
        assert failed.status_code == 500 and "update_weights" in failed.text, failed.text
        assert httpx.post(url + "/resume", headers=AUTH).json() == {"is_paused": False}
        # running, a request ends under the old weights before the update answers
        running = pool.submit(httpx.post, url + "/v1/completions", json={**BODY, **long},
                              headers=AUTH, timeout=60)
        while not on_loop(aengine, lambda e: e.has_unfinished()):
            time.sleep(0.005)
        r = update(url, path, in_flight="finish")
        assert r.status_code == 200 and r.json()["requests_in_flight"] == 1, r.text
        done = running.result(timeout=60)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 160


def test_sleep_and_wake_up(url, aengine, tmp_path):
    before = text(url)
    r = httpx.post(url + "/sleep", params={"level": 1}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": 1}
    assert on_loop(aengine, lambda e: e.runner.memory_stats()["kv_pool_bytes"]) == 0
    r = httpx.post(url + "/v1/completions", json=BODY, headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_asleep"
    r = httpx.get(url + "/health/ready")
    assert r.status_code == 503 and r.json()["reason"].startswith("asleep"), r.text
    assert httpx.post(url + "/wake_up", headers=AUTH).json() == {"is_sleeping": False}
    assert httpx.get(url + "/health/ready").status_code == 200
    assert text(url) == before
    sd = perturbed(27)
    assert httpx.post(url + "/sleep?level=2", headers=AUTH).status_code == 200
    assert on_loop(aengine, lambda e: e.runner.memory_stats()["weight_bytes"]) == 0
    r = httpx.post(url + "/wake_up", params={"tags": "kv_cache"}, headers=AUTH)
    assert r.json() == {"is_sleeping": True}  # the weights come back by an update only
    assert update(url, safetensors_dir(tmp_path / "st", sd)).status_code == 200
    assert httpx.get(url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert text(url) == fresh_text(sd)
    for query in ("level=3", "level=x"):
        r = httpx.post(url + "/sleep?" + query, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = httpx.post(url + "/wake_up?tags=pool", headers=AUTH)
    assert r.status_code == 400 and "tags" in r.json()["error"]["message"]


def test_endpoints_need_the_key_and_the_flag(url, aengine):
    for method, path in (("POST", "/update_weights"), ("POST", "/pause"), ("POST", "/sleep"),
                         ("GET", "/is_sleeping"), ("POST", "/update_weights_from_disk")):
        r = httpx.request(method, url + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with serve_app(build_app(aengine, ServerConfig(api_key=KEY))) as plain:
        for method, path in (("POST", "/update_weights"), ("POST", "/sleep"),
                             ("GET", "/is_paused")):
            r = httpx.request(method, plain + path, headers=AUTH)
            assert r.status_code == 404 and "error" in r.json()
    # several tenants: a tenant's key may not change every tenant's model
    config = ServerConfig(api_keys=((KEY, "a"), ("other", "b")), operator_keys=("op",),
                          enable_weight_updates=True)
    with serve_app(build_app(aengine, config)) as tenants:
        r = httpx.get(tenants + "/is_paused", headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required"
        r = httpx.get(tenants + "/is_paused", headers={"Authorization": "Bearer op"})
        assert r.status_code == 200 and r.json() == {"is_paused": False}


def test_the_flag_without_a_key_refuses_to_start():
    with pytest.raises(ValueError, match="enable_weight_updates.*API key"):
        ServerConfig(enable_weight_updates=True)
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "serve", "--model=tiny",
                           "--enable_weight_updates"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 2, done.stderr
    assert "enable_weight_updates" in done.stderr and "API key" in done.stderr
