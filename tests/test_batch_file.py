"""Batch files: results in input order with per-line errors, resume skips finished lines, and
temperature-0 outputs equal LLM.generate / LLM.chat on the same engine."""

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
        _request("e", "/v1/embeddings", {"model": MODEL, "input": "x"}),
        _request("f", "/v1/completions", {"model": MODEL, "prompt": ["Water is", "Fire is"],
                                          "max_tokens": 5, "temperature": 0, "stream": True,
                                          "unknown_field": 1}),
        _request("a", "/v1/completions", {"model": MODEL, "prompt": "dup"}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, lines)
    summary = run_batch(llm.engine, str(inp), str(out))
    results = _lines(out)
    assert [r["custom_id"] for r in results] == ["a", None, "b", "c", "d", "e", "f", "a"]
    assert (summary.total, summary.skipped, summary.succeeded, summary.failed) == (8, 0, 3, 5)

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
    assert llm.stats()["referenced_pages"] == 0 and llm.stats()["running"] == 0


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
