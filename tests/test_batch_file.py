"""Batch files: results in input order with per-line errors, resume skips finished lines (keyed by
line, so a duplicate custom_id never takes another line's result), and temperature-0 outputs equal
LLM.generate / LLM.chat on the same engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def llm(default_model_path):
    from jaxserve.llm import LLM

    return LLM(model=MODEL, max_num_seqs=16, num_pages=256)


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _request(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")


def test_batch_order_errors_and_equality(llm, tmp_path):
    from jaxserve.batch_file import run_batch

    long_prompt = "word " * (llm.engine.max_model_len + 5)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [
        _request("a", "/v1/completions", {"model": MODEL, "prompt": "The sky is",
                                          "max_tokens": 6, "temperature": 0}),
        "{not json",
        _request("b", "/v1/chat/completions", {"model": MODEL, "messages": chat,
                                               "max_tokens": 12, "temperature": 0}),
        _request("c", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -3}),
        _request("d", "/v1/completions", {"model": MODEL, "prompt": long_prompt,
                                          "max_tokens": 4}),
        _request("e", "/v1/moderations", {"model": MODEL, "input": "x"}),
        _request("f", "/v1/completions", {"model": MODEL, "prompt": ["Water is", "Fire is"],
                                          "max_tokens": 5, "temperature": 0, "stream": True,
                                          "unknown_field": 1}),
        _request("a", "/v1/completions", {"model": MODEL, "prompt": "dup"}),
        "[" * 100_000 + "]" * 100_000,  # was a RecursionError that ended the whole file
        _request("g", "/v1/chat/completions", {"model": MODEL, "messages": [  # was a KeyError
            *chat, {"role": "assistant", "tool_calls": [{"type": "function"}]}]}),  # that too
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, lines)
    summary = run_batch(llm.engine, str(inp), str(out))
    results = _lines(out)
    assert [r["custom_id"] for r in results] == ["a", None, "b", "c", "d", "e", "f", "a", None,
                                                  "g"]
    assert (summary.total, summary.skipped, summary.succeeded, summary.failed) == (10, 0, 3, 7)
    assert results[8]["error"]["code"] == "invalid_json" and "levels" in results[8]["error"][
        "message"]

    ok = {r["custom_id"]: r["response"]["body"] for r in results
          if r["response"] and r["response"]["status_code"] == 200}
    greedy = SamplingParams(temperature=0, max_tokens=6)
    assert ok["a"]["choices"][0]["text"] == llm.generate("The sky is", greedy)[0].outputs[0].text
    ref_chat = llm.chat(chat, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert ok["b"]["choices"][0]["message"]["content"] == ref_chat and "Paris" in ref_chat
    ref_f = llm.generate(["Water is", "Fire is"], SamplingParams(temperature=0, max_tokens=5))
    assert [c["text"] for c in ok["f"]["choices"]] == [o.outputs[0].text for o in ref_f]
    assert ok["a"]["usage"]["completion_tokens"] <= 6

    assert results[1]["response"] is None and results[1]["error"]["code"] == "invalid_json"
    assert results[3]["response"]["status_code"] == 400
    assert results[3]["response"]["body"]["error"]["param"] == "temperature"
    assert results[4]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert results[5]["error"]["code"] == "invalid_url"
    assert results[7]["error"]["code"] == "duplicate_custom_id"
    assert results[9]["response"]["status_code"] == 400
    assert results[9]["response"]["body"]["error"]["param"] == "messages[1].tool_calls[0].function"
    assert llm.stats()["referenced_pages"] == 0 and llm.stats()["running"] == 0


def test_a_bug_fails_its_line_alone(llm, tmp_path, monkeypatch):
    """An unexpected exception reading a line (as row 5's KeyError was) is that line's 500;
    the other lines run."""
    import jaxserve.batch_file as batch_file

    def parse(kind, body, ctx):
        if body["prompt"] == "boom":
            raise KeyError("function")
        return parse_request(kind, body, ctx)

    parse_request = batch_file.parse_request
    monkeypatch.setattr(batch_file, "parse_request", parse)
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_request(c, "/v1/completions", {**body, "prompt": c}) for c in ("boom", "ok")])
    summary = batch_file.run_batch(llm.engine, str(inp), str(out))
    assert (summary.succeeded, summary.failed) == (1, 1)
    assert [r["response"]["status_code"] for r in _lines(out)] == [500, 200]


def test_batch_resume_skips_done_lines(llm, tmp_path):
    from jaxserve.batch_file import run_batch

    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    lines = [_request(f"r{i}", "/v1/completions", {**body, "prompt": f"Item {i}:"})
             for i in range(4)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, lines[:2])
    first = run_batch(llm.engine, str(inp), str(out))
    assert (first.succeeded, first.skipped) == (2, 0)
    done = _lines(out)

    _write(inp, lines)  # the file grew: only the new lines run, the old results are kept
    second = run_batch(llm.engine, str(inp), str(out))
    assert (second.succeeded, second.skipped) == (2, 2)
    results = _lines(out)
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2", "r3"]
    assert results[:2] == done  # untouched (same ids: not recomputed)
    third = run_batch(llm.engine, str(inp), str(out))
    assert (third.succeeded, third.skipped) == (0, 4) and _lines(out) == results


def test_batch_duplicate_id_rerun_rewrites_nothing(llm, tmp_path):
    from jaxserve.batch_file import run_batch

    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    _write(tmp_path / "in.jsonl", [
        _request("a", "/v1/completions", {**body, "prompt": "One"}),
        _request("b", "/v1/completions", {**body, "prompt": "Two"}),
        _request("a", "/v1/completions", {**body, "prompt": "Three"}),
    ])
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    first = run_batch(llm.engine, inp, out)
    results = _lines(out)
    assert (first.succeeded, first.failed) == (2, 1)
    assert [r["response"]["status_code"] for r in results[:2]] == [200, 200]
    assert results[2]["response"] is None
    assert results[2]["error"]["code"] == "duplicate_custom_id"

    second = run_batch(llm.engine, inp, out)  # the documented resume
    assert (second.skipped, second.succeeded, second.failed) == (3, 0, 0)
    assert _lines(out) == results  # line 1 keeps its 200, line 3 its own error


class _Killed(Exception):
    pass


class _KilledAt:
    """The shared engine, "killed" when asked for its (n+1)-th request. With one line in flight
    at a time the engine is then idle, so the next test finds it clean."""

    def __init__(self, engine, n):
        self._engine, self._left = engine, n

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt, params, **kw):
        if self._left == 0:
            raise _Killed
        self._left -= 1
        return self._engine.add_request(prompt, params, **kw)


def test_batch_resume_after_kill_with_duplicate_id(llm, tmp_path):
    from jaxserve.batch_file import run_batch

    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    _write(tmp_path / "in.jsonl", [
        _request("a", "/v1/completions", {**body, "prompt": "One"}),
        _request("b", "/v1/completions", {**body, "prompt": "Two"}),
        _request("a", "/v1/completions", {**body, "prompt": "Three"}),
        _request("c", "/v1/completions", {**body, "prompt": "Four"}),
    ])
    inp, out = str(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    with pytest.raises(_Killed):  # lines 1 and 2 finish and are appended, then the kill
        run_batch(_KilledAt(llm.engine, 2), inp, str(out), max_in_flight=1)
    appended = out.read_text().splitlines()
    assert len(appended) == 2
    kept = json.loads(appended[0])
    out.write_text(appended[0] + "\n" + appended[1][:40])  # line 2's write torn by the kill
    with pytest.raises(_Killed):  # the resume reruns line 2, appends it, and is killed too
        run_batch(_KilledAt(llm.engine, 1), inp, str(out), max_in_flight=1)
    rerun = json.loads(out.read_text().splitlines()[-1])
    assert rerun["custom_id"] == "b"

    summary = run_batch(llm.engine, inp, str(out))
    assert (summary.skipped, summary.succeeded, summary.failed) == (2, 1, 1)
    results = _lines(out)
    assert [r["custom_id"] for r in results] == ["a", "b", "a", "c"]
    assert [r["line"] for r in results] == [1, 2, 3, 4]
    assert results[:2] == [kept, rerun]  # finished before a kill: not rewritten
    assert results[2]["response"] is None  # not a copy of line 1's response
    assert results[2]["error"]["code"] == "duplicate_custom_id"
    assert [r["response"]["status_code"] for r in results if r["response"]] == [200, 200, 200]
    assert len({r["id"] for r in results}) == 4
    run_batch(llm.engine, inp, str(out))
    assert _lines(out) == results
    assert llm.stats()["referenced_pages"] == 0 and llm.stats()["running"] == 0


def test_progress_bar_counts_the_summarys_lines(tmp_path):
    """The bar said 3/3 where the summary said 5: lines refused before running (bad JSON, a
    duplicate custom_id) and resumed lines are lines done."""
    from jaxserve.batch_file import BatchWriter, plan_batch

    body = {"model": MODEL, "prompt": "x"}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ["{bad", *[_request(c, "/v1/completions", body) for c in "abca"]])
    plan = plan_batch(str(inp), str(out))
    writer = BatchWriter(str(out), plan, progress=True)
    bar = writer.bar
    assert (bar.n, bar.total, len(plan.todo)) == (2, 5, 3)
    for i, *_ in plan.todo:
        writer.emit(i, {"custom_id": "x", "response": None, "error": {"code": "c"}})
    summary = writer.finish()
    assert bar.n == bar.total == summary.total == 5


def test_batch_cli(default_model_path, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_request("only", "/v1/completions",
                          {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})])
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "batch", f"--input={inp}",
                           f"--output={out}", "--max_num_seqs=4", "--num_pages=32",
                           "--noprogress"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["succeeded"] == 1
    assert _lines(out)[0]["response"]["status_code"] == 200
