"""Batch files over Ray replicas (jaxserve.integrations.ray): two replicas write what one
in-process engine writes, in input order; a replica killed mid-run loses and duplicates no line;
with every replica dead the written results stay and a rerun resumes; the Ray Data processor
gives LLM.generate's texts. One local Ray cluster (this machine's processes) for the module; the
model is the tiny seeded one, saved as an orbax checkpoint each actor loads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from tiny_model import tiny_loaded  # noqa: E402

from jaxserve.core.sampling_params import SamplingParams  # noqa: E402

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=128,
              huge_pages=False)
ROWS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from jaxserve.weights.orbax_io import save_orbax

    path = tmp_path_factory.mktemp("ray") / "model"
    save_orbax(str(path), tiny_loaded(seed=5, max_len=256))
    return str(path)


@pytest.fixture(scope="module")
def options(model_dir):
    return dict(model=model_dir, **ENGINE)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _request(cid, body, url="/v1/completions"):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def input_path(tmp_path_factory, model_dir):
    greedy = {"model": model_dir, "temperature": 0}
    lines = [_request(f"r{i}", {**greedy, "prompt": f"Item {i} is", "max_tokens": 4 + i % 9})
             for i in range(ROWS)]
    lines[3] = _request("chat", {**greedy, "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 6}, url="/v1/chat/completions")
    lines[7] = "{not json"
    lines[11] = _request("r11", {**greedy, "prompt": "x", "temperature": -1})  # a 400
    lines[15] = _request("r0", {**greedy, "prompt": "dup"})  # duplicate_custom_id
    lines[18] = _request("two", {**greedy, "prompt": ["A", "B"], "max_tokens": 5})
    path = tmp_path_factory.mktemp("ray_in") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _essence(result: dict) -> tuple:
    """A result without its random ids and timestamps."""
    response, body = result["response"], (result["response"] or {}).get("body") or {}
    choices = [(c.get("text", (c.get("message") or {}).get("content")), c.get("finish_reason"))
               for c in body.get("choices", [])]
    return (result["custom_id"], result["line"], result["line_sha256"], result["error"],
            response and response["status_code"], choices, body.get("usage"),
            body.get("error"))


@pytest.fixture(scope="module")
def reference(input_path, options, tmp_path_factory):
    """The file through one engine in this process (jaxserve.batch_file.run_batch)."""
    from jaxserve.batch_file import run_batch
    from jaxserve.config import EngineConfig
    from jaxserve.engine import make_engine

    engine = make_engine(EngineConfig.from_options(**options))
    out = tmp_path_factory.mktemp("ray_ref") / "out.jsonl"
    run_batch(engine, input_path, str(out))
    results = [_essence(r) for r in _lines(out)]
    assert [r[0] for r in results][:4] == ["r0", "r1", "r2", "chat"] and len(results) == ROWS
    assert sum(r[4] == 200 for r in results) == ROWS - 3
    return results


def _killer(actors_to_kill, output, after_lines: int):
    """on_replicas hook: kill the chosen replicas once `output` holds after_lines results."""
    def hook(actors):
        def watch():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with open(output) as f:
                    if sum(1 for line in f if line.endswith("\n")) >= after_lines:
                        break
                time.sleep(0.01)
            for k in actors_to_kill:
                ray.kill(actors[k])
        threading.Thread(target=watch, daemon=True).start()
    return hook


def test_two_replicas_write_what_one_engine_writes(cluster, options, input_path, reference,
                                                   tmp_path):
    from jaxserve.integrations.ray import run_batch_on_ray

    out = tmp_path / "out.jsonl"
    summary = run_batch_on_ray(options, input_path, str(out), replicas=2)
    assert [_essence(r) for r in _lines(out)] == reference
    assert (summary.total, summary.skipped, summary.succeeded, summary.failed) == (
        ROWS, 0, ROWS - 3, 3)
    assert (summary.replicas, summary.replicas_lost, summary.retried) == (2, 0, 0)
    again = run_batch_on_ray(options, input_path, str(out), replicas=2)  # nothing left to run
    assert (again.skipped, again.succeeded) == (ROWS, 0)
    assert [_essence(r) for r in _lines(out)] == reference


def test_a_killed_replica_loses_and_repeats_no_line(cluster, options, input_path, reference,
                                                    tmp_path):
    from jaxserve.integrations.ray import run_batch_on_ray

    out = tmp_path / "out.jsonl"
    out.write_text("")
    summary = run_batch_on_ray(options, input_path, str(out), replicas=2,
                               on_replicas=_killer([0], str(out), after_lines=3))
    assert summary.replicas_lost == 1 and summary.retried > 0 and summary.last_error
    assert [_essence(r) for r in _lines(out)] == reference  # every line once, in input order
    assert summary.succeeded + summary.failed == ROWS


def test_every_replica_dead_keeps_results_and_a_rerun_resumes(cluster, options, input_path,
                                                              reference, tmp_path):
    from jaxserve.integrations.ray import RayBatchError, run_batch_on_ray

    out = tmp_path / "out.jsonl"
    out.write_text("")
    with pytest.raises(RayBatchError, match="every Ray replica died"):
        run_batch_on_ray(options, input_path, str(out), replicas=1,
                         on_replicas=_killer([0], str(out), after_lines=4))
    kept = _lines(out)  # appended as they finished: in completion order
    assert 4 <= len(kept) < ROWS
    with open(out, "a") as f:
        f.write('{"custom_id": "torn')  # a line cut short by the kill
    summary = run_batch_on_ray(options, input_path, str(out), replicas=1)
    assert summary.skipped == len(kept) and summary.succeeded + summary.failed == ROWS - len(kept)
    results = _lines(out)
    assert [_essence(r) for r in results] == reference
    by_line = {r["line"]: r for r in results}
    assert all(by_line[r["line"]] == r for r in kept)  # finished results are never rewritten


def test_cli_joins_a_running_cluster(cluster, model_dir, input_path, reference, tmp_path):
    """`jaxserve batch --ray_replicas --ray_address` in another process: the same output."""
    out = tmp_path / "out.jsonl"
    flags = [f"--{k}={v}" for k, v in ENGINE.items() if not isinstance(v, bool)]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli.main", "batch", f"--model={model_dir}", *flags,
         "--nohuge_pages", f"--input={input_path}", f"--output={out}", "--noprogress",
         "--ray_replicas=1", f"--ray_address={ray.get_runtime_context().gcs_address}",
         "--tool_call_parser=hermes"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["succeeded"], summary["replicas"], summary["replicas_lost"]) == (
        ROWS - 3, 1, 0)
    assert [_essence(r) for r in _lines(out)] == reference


def test_what_cannot_run_is_refused(cluster, options, input_path, tmp_path):
    """Before any replica starts where the driver can tell; an engine no replica can start."""
    from jaxserve.integrations.ray import RayBatchError, run_batch_on_ray

    with pytest.raises(ValueError, match="need 3 CPU"):
        run_batch_on_ray(options, input_path, str(tmp_path / "out.jsonl"), replicas=3)
    with pytest.raises(ValueError, match="replicas must be an integer"):
        run_batch_on_ray(options, input_path, str(tmp_path / "out.jsonl"), replicas=0)
    with pytest.raises(ValueError, match="unexpected keyword argument 'model_name'"):
        run_batch_on_ray(options, input_path, str(tmp_path / "out.jsonl"), replicas=1,
                         model_name=("x",))
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(RayBatchError, match="no Ray replica started its engine.*no_such_model"):
        run_batch_on_ray({**options, "model": missing}, input_path, str(tmp_path / "out.jsonl"),
                         replicas=1)
    assert _lines(tmp_path / "out.jsonl") == []


def test_data_processor_gives_generate_texts(cluster, options, model_dir, tmp_path):
    """Two engines on the module's two CPUs, reading a JSON file: the read tasks need a CPU the
    engines leave them (they once waited for ever)."""
    pytest.importorskip("pyarrow", reason="Ray Data needs ray[data]")
    from jaxserve.integrations.ray import build_processor
    from jaxserve.llm import LLM

    prompts = [f"Row {i}:" for i in range(8)]
    chats = [[{"role": "user", "content": "Hello"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    rows += [{"id": len(rows) + k, "messages": m} for k, m in enumerate(chats)]
    rows[4]["sampling_params"] = {"max_tokens": 2}
    sampling = {"temperature": 0, "max_tokens": 6}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = build_processor(sampling=sampling, concurrency=2, batch_size=3, **options)
    ds = ray.data.read_json(str(tmp_path / "rows.jsonl"))
    out = sorted(processor(ds).take_all(), key=lambda r: r["id"])

    llm = LLM(**options)
    params = [SamplingParams(**sampling) for _ in prompts]
    params[4] = SamplingParams(temperature=0, max_tokens=2)
    expected = llm.generate(prompts, params, use_tqdm=False)
    expected += llm.chat(chats, SamplingParams(**sampling), use_tqdm=False)
    assert [r["generated_text"] for r in out] == [o.outputs[0].text for o in expected]
    assert [r["num_generated_tokens"] for r in out] == [len(o.outputs[0].token_ids)
                                                        for o in expected]
    assert out[4]["num_generated_tokens"] <= 2 and [r["prompt"] for r in out[:8]] == prompts

    with pytest.raises(ValueError, match="one text per row"):
        build_processor(sampling={"n": 2}, **options)
