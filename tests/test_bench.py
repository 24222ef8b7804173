"""Benchmark harness: workload sampling, metric math, the in-process and HTTP drivers, the KV
peak vs the analytic model, and `jaxserve bench` end to end."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from jaxserve.tools import kv_budget
from jaxserve.tools.bench import build_report, format_report, run_http, summarize
from jaxserve.tools.bench.report import format_ablation, greedy_agreement, length_buckets, percentile
from jaxserve.tools.bench.runner import RequestRecord, RunResult
from jaxserve.tools.bench.workload import LengthDist, WorkloadSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 49152


# ---- workloads ------------------------------------------------------------------------------

def test_workload_is_seeded():
    spec = WorkloadSpec(num_prompts=20, request_rate=5.0, input_len="uniform:4:40",
                        output_len="normal:20:5", shared_prefix_len=8, prefix_group_size=4)
    assert spec.generate(VOCAB) == spec.generate(VOCAB)
    assert spec.generate(VOCAB) != spec.replace(seed=1).generate(VOCAB)
    assert spec.generate(VOCAB, warmup=True) != spec.generate(VOCAB)[:spec.num_warmup]


def test_fixed_uniform_list_normal_lengths():
    fixed = WorkloadSpec(num_prompts=50, input_len=37, output_len="11").generate(VOCAB)
    assert {r.prompt_len for r in fixed} == {37} and {r.output_len for r in fixed} == {11}
    assert all(r.arrival_offset == 0.0 for r in fixed)  # rate inf: all at once
    uni = WorkloadSpec(num_prompts=2000, input_len="uniform:16:256", output_len="list:3,5,7")
    reqs = uni.generate(VOCAB)
    lens = [r.prompt_len for r in reqs]
    assert min(lens) == 16 and max(lens) == 256  # both bounds are reached and respected
    assert abs(np.mean(lens) - 136) < 5
    assert [r.output_len for r in reqs[:6]] == [3, 5, 7, 3, 5, 7]
    norm = LengthDist.parse("normal:100:30:150").sample(np.random.default_rng(0), 5000)
    assert min(norm) >= 1 and max(norm) == 150 and abs(np.median(norm) - 100) < 3
    assert all(1000 <= t < VOCAB for r in reqs for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        LengthDist.parse("uniform:9:3")
    with pytest.raises(ValueError):
        LengthDist.parse("zipf:2")


def test_poisson_and_gamma_arrivals():
    rng = np.random.default_rng(0)
    rate = 4.0
    poisson = np.diff(WorkloadSpec(request_rate=rate).arrival_offsets(rng, 20001))
    assert abs(poisson.mean() - 1 / rate) < 0.03 / rate
    assert abs(poisson.std() / poisson.mean() - 1.0) < 0.05  # exponential: CV = 1
    bursty = np.diff(WorkloadSpec(request_rate=rate, arrival="gamma", burstiness=0.25)
                     .arrival_offsets(rng, 20001))
    smooth = np.diff(WorkloadSpec(request_rate=rate, arrival="gamma", burstiness=4.0)
                     .arrival_offsets(rng, 20001))
    for gaps in (bursty, smooth):  # same mean gap, 1/rate
        assert abs(gaps.mean() - 1 / rate) < 0.05 / rate
    # gamma with shape k: CV^2 = 1/k
    assert abs((bursty.std() / bursty.mean()) ** 2 - 4.0) < 0.4
    assert abs((smooth.std() / smooth.mean()) ** 2 - 0.25) < 0.03


def test_shared_prefix_groups_and_json(tmp_path):
    spec = WorkloadSpec(num_prompts=6, input_len=5, shared_prefix_len=16, prefix_group_size=3)
    reqs = spec.generate(VOCAB)
    assert all(r.prompt_len == 21 for r in reqs)
    assert [r.prefix_group for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert reqs[0].prompt_token_ids[:16] == reqs[2].prompt_token_ids[:16]
    assert reqs[0].prompt_token_ids[:16] != reqs[3].prompt_token_ids[:16]
    assert reqs[0].prompt_token_ids[16:] != reqs[1].prompt_token_ids[16:]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert WorkloadSpec.from_json(str(path)) == spec
    for name in ("bench_default", "bench_shared_prefix", "bench_bursty"):
        WorkloadSpec.from_json(os.path.join(REPO, "configs", f"{name}.json")).generate(VOCAB)
    with pytest.raises(ValueError, match="unknown workload field"):
        WorkloadSpec.from_dict({"num_prompt": 3})


# ---- metric math ----------------------------------------------------------------------------

def test_percentiles_against_hand_values():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    s = summarize(xs)
    assert (s["mean"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)
    assert math.isnan(summarize([])["p50"])
    assert np.allclose([percentile(list(range(101)), q) for q in (50, 90, 99)], [50, 90, 99])
    assert length_buckets([5] * 10) == [(5, 5)]
    assert length_buckets(list(range(1, 11))) == [(1, 3), (4, 5), (6, 7), (8, 10)]


def test_report_hand_values():
    # Request 0: arrives 0, tokens at 1.0, 1.5, 2.5 -> TTFT 1, TPOT (2.5-1)/2 = 0.75, ITL .5, 1
    # Request 1: arrives 1, tokens at 1.5, 1.7 -> TTFT 0.5, TPOT 0.2, ITL 0.2.
    recs = [RequestRecord(0, 10, 3, "completed", 3, 0.0, 1.0, 2.5, [1.0, 1.5, 2.5]),
            RequestRecord(1, 20, 2, "completed", 2, 1.0, 1.5, 1.7, [1.5, 1.7]),
            RequestRecord(2, 30, 2, "rejected", error="too long"),
            RequestRecord(3, 30, 2, "cancelled", 1, 1.0, 2.0, 2.0, [2.0])]
    rep = build_report(RunResult(recs, 2.5, [], mode="http"), slo_ttft_ms=800, slo_tpot_ms=None)
    assert (rep["completed"], rep["rejected"], rep["cancelled"], rep["failed"]) == (2, 1, 1, 0)
    assert rep["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert rep["tpot_ms"]["mean"] == pytest.approx(475.0)
    assert rep["itl_ms"]["mean"] == pytest.approx(1700.0 / 3)
    assert rep["e2e_ms"]["p50"] == pytest.approx(1600.0)  # E2E 2.5 and 0.7
    assert rep["output_tokens"] == 5 and rep["prompt_tokens"] == 30
    assert rep["output_throughput"] == pytest.approx(2.0)
    assert rep["total_token_throughput"] == pytest.approx(14.0)
    assert rep["goodput"]["requests"] == 1  # only request 1 has TTFT <= 800 ms
    assert "goodput" in format_report(rep)
    table = format_ablation([("x", dict(rep, label="a"), dict(rep, label="b"))])
    assert "x1.00" in table


# ---- in-process run -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_run(default_loaded):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.tools.bench import run_engine

    config = EngineConfig.from_options(max_num_seqs=8, num_pages=48, max_model_len=96,
                                       max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = LLMEngine(config, default_loaded)
    # The last prompt (100 tokens) exceeds max_model_len 96: it is rejected, not run.
    spec = WorkloadSpec(num_prompts=7, input_len="list:9,17,33,40,24,12,100",
                        output_len="list:3,6,2,5,4,1,3", num_warmup=1)
    result = run_engine(engine, spec)
    return spec, result, build_report(result, workload=spec)


@pytest.mark.slow
def test_small_run_counts(small_run):
    spec, result, rep = small_run
    assert rep["completed"] + rep["rejected"] + rep["cancelled"] + rep["failed"] == spec.num_prompts
    assert (rep["completed"], rep["rejected"]) == (6, 1)
    done = [r for r in result.records if r.status == "completed"]
    assert rep["output_tokens"] == sum(r.target_output_len for r in done) == 3 + 6 + 2 + 5 + 4 + 1
    assert all(len(r.token_times) == r.output_tokens for r in done)
    assert rep["ttft_ms"]["n"] == 6 and rep["tpot_ms"]["n"] == 5  # the 1-token request has no TPOT
    assert rep["compilations_warmup"] >= 1
    assert rep["preemptions"] == 0 and rep["prefix_cache_hit_rate"] == 0.0
    json.dumps(rep)  # JSON-ready
    text = format_report(rep)
    assert "6 / 1 / 0 / 0" in text


@pytest.mark.slow
def test_peak_kv_matches_analytic(small_run):
    """All at once, prefix caching off, no preemption: at the step with the most referenced pages
    the engine holds exactly kv_budget.pages_needed of the lengths live then (no slack)."""
    spec, result, rep = small_run
    peak = rep["kv_at_peak"]
    assert peak["measured_pages"] == peak["analytic_pages"] == rep["peak_kv_pages"] > 0
    assert peak["measured_pages"] == kv_budget.pages_needed(peak["live_lengths"], 16)
    # Never more than every request at its full retained length (prompt + output - 1).
    full = [r.prompt_len + r.target_output_len - 1 for r in result.records if r.status == "completed"]
    assert peak["measured_pages"] <= kv_budget.pages_needed(full, 16)
    assert peak["useful_bytes"] + peak["fragmentation_bytes"] == rep["peak_kv_bytes"]
    assert max(s["referenced_pages"] for s in result.timeline) == rep["peak_kv_pages"]


# ---- HTTP driver against a fake OpenAI-compatible server -------------------------------------

class _FakeCompletions(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["stream"] is True
        assert all(isinstance(t, int) for t in body["prompt"])
        if len(body["prompt"]) > 30:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "prompt too long"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": "x",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


def test_http_driver_counts_stream_tokens():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = WorkloadSpec(num_prompts=5, request_rate=50.0, input_len="list:8,12,40,9,10",
                            output_len="list:4,1,3,7,2", num_warmup=1)
        res = run_http(f"http://127.0.0.1:{server.server_port}", spec, vocab_size=VOCAB)
    finally:
        server.shutdown()
    rep = build_report(res, workload=spec)
    assert (rep["completed"], rep["rejected"], rep["failed"]) == (4, 1, 0)
    assert rep["output_tokens"] == 4 + 1 + 7 + 2
    assert all(len(r.token_times) == r.output_tokens for r in res.records if r.status == "completed")


# ---- CLI --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_end_to_end(tmp_path, default_model_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "bench", "--num_prompts=3",
           "--input_len=12", "--output_len=3", "--num_warmup=1", "--max_num_seqs=4",
           "--num_pages=24", "--max_model_len=64", "--enable_prefix_caching=false",
           f"--json_out={out}", f"--plot_dir={tmp_path / 'plots'}", "--slo_ttft_ms=60000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TTFT" in proc.stdout and "peak KV pages" in proc.stdout
    rep = json.loads(out.read_text())["report"]
    assert rep["completed"] == 3 and rep["output_tokens"] == 9
    assert rep["workload"]["input_len"] == {"kind": "fixed", "value": 12}
    assert rep["goodput"]["requests"] == 3
    for stem in ("bench_latency_cdf", "bench_throughput", "bench_memory"):
        for ext in ("png", "svg", "csv"):
            assert (tmp_path / "plots" / f"{stem}.{ext}").is_file()
    bad = subprocess.run(cmd[:4] + ["--input_len=zipf:3"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "bad length spec" in bad.stderr


def test_greedy_agreement_counts_identical_outputs_and_matching_prefixes():
    a = [[1, 2, 3], [4, 5], [7], []]
    b = [[1, 2, 3], [4, 6, 9], [7, 8], [1]]
    assert greedy_agreement(a, b) == {"identical_requests": 1, "requests": 4,
                                      "matching_prefix_tokens": 3 + 1 + 1 + 0,
                                      "mean_matching_prefix": 5 / 4}


# ---- embeddings and LoRA workloads -----------------------------------------------------------

def _bench(args, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "bench", *args, f"--json_out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


@pytest.mark.slow
def test_cli_embeddings_workload_against_sentence_transformers(tmp_path):
    """--runner=pooling: the engine's embeddings of 3 x 40 token ids and sentence-transformers'
    of the same ids, timed in one run, agree (cosine)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pooling_models import write_sentence_transformer

    model = write_sentence_transformer(str(tmp_path / "qwen3"), "qwen3")
    proc, out = _bench(["--runner=pooling", f"--model={model}", "--num_prompts=3",
                        "--input_len=40", "--repeats=1", "--compare_sentence_transformers",
                        "--max_num_batched_tokens=64"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = out["embeddings"]
    assert (rep["inputs"], rep["tokens"]) == (3, 120)
    assert rep["jaxserve"]["embeddings_per_s"] > 0 and rep["sentence_transformers"]["seconds"] > 0
    assert rep["speedup"] == pytest.approx(rep["sentence_transformers"]["seconds"]
                                           / rep["jaxserve"]["seconds"])
    assert rep["min_cosine"] >= 0.99999
    assert "embeddings/s" in proc.stdout
    bad, _ = _bench(["--runner=pooling", f"--model={model}", "--input_len=uniform:4:8"], tmp_path)
    assert bad.returncode == 2 and "fixed --input_len" in bad.stderr


@pytest.mark.slow
def test_cli_lora_workload_against_the_base(tmp_path):
    """--lora_modules: base and LoRA engines on the same workload at each stream count, the
    requests over the two adapters in turn; every request completes on both."""
    pytest.importorskip("peft")
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pooling_models import TINY, byte_tokenizer

    torch.manual_seed(0)
    # The workload's prompt ids start at 1000: a vocabulary above that.
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(TINY, vocab_size=1536))
                                         ).eval()
    model_dir = tmp_path / "llama"
    base.save_pretrained(model_dir)
    byte_tokenizer(None).save(str(model_dir))
    modules = []
    for i in range(2):
        torch.manual_seed(i + 1)
        get_peft_model(copy.deepcopy(base), LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "down_proj"])
                       ).save_pretrained(tmp_path / f"a{i}")
        modules.append(f"--lora_modules=a{i}={tmp_path / f'a{i}'}")
    proc, out = _bench([f"--model={model_dir}", *modules, "--max_loras=2", "--max_lora_rank=4",
                        "--lora_streams=1,3", "--input_len=8", "--output_len=4",
                        "--num_warmup=1", "--compile_warmup=none",
                        "--enable_prefix_caching=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = out["lora"]["rows"]
    assert [r["streams"] for r in rows] == [1, 3]
    for r in rows:
        for side in ("base", "lora"):
            assert r[side]["completed"] == r["streams"]
            assert r[side]["output_tokens"] == 4 * r["streams"]
        assert r["ratio"] == pytest.approx(r["lora"]["output_throughput"]
                                           / r["base"]["output_throughput"])
    assert "ratio" in proc.stdout
