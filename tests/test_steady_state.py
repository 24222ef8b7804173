"""Serving measures the steady state by default: `jaxserve bench` compiles every step shape it
can meet before its measured window (and warns when one compiled inside it), the server reports
liveness and readiness (warming up, draining, dead) apart, and a rate sweep reports goodput
against the offered rate. On the tiny random model, saved as an orbax checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server import AsyncEngine, ServerConfig, build_app
from jaxserve.weights import save_orbax
from serving import serve_app
from tiny_model import tiny_loaded

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The bench draws prompt token ids from a vocabulary of more than 1001 ids.
    return save_orbax(str(tmp_path_factory.mktemp("tiny") / "model"),
                      tiny_loaded(vocab_size=2048))


def bench(model_dir, tmp_path, *flags):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "bench", f"--model={model_dir}",
           "--max_num_seqs=8", "--max_num_batched_tokens=64", "--num_pages=128",
           "--page_size=8", "--num_prompts=12", "--input_len=uniform:4:40",
           "--output_len=uniform:2:16", f"--json_out={out}", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_default_bench_compiles_nothing_in_the_measured_window(model_dir, tmp_path, backend):
    """cpu (packed): every shape is compiled at warm-up; xla: a full warm-up for the check."""
    warmup = [] if backend == "cpu" else ["--compile_warmup=full"]
    out, done = bench(model_dir, tmp_path, "--request_rate=20", f"--attention_backend={backend}",
                      *warmup)
    rep = out["report"]
    assert rep["completed"] == 12 and rep["compilations_warmup"] > 0
    assert rep["compilations_after_warmup"] == 0 and rep["warnings"] == []
    assert "WARNING" not in done.stdout
    assert "Unable to initialize backend" not in done.stderr  # quiet start-up


def test_a_cold_bench_says_it_measured_compilation(model_dir, tmp_path):
    out, done = bench(model_dir, tmp_path, "--compile_warmup=none", "--num_warmup=0",
                      "--attention_backend=xla")
    n = out["report"]["compilations_after_warmup"]
    assert n > 0 and out["report"]["warnings"] == [
        f"{n} step shapes compiled during the measured window: its latencies include XLA "
        "compilation (warm up with --compile_warmup)"]
    assert f"WARNING: {n} step shapes compiled" in done.stdout


def test_rate_sweep_reports_goodput_per_variant_and_rate(model_dir, tmp_path):
    out, done = bench(model_dir, tmp_path, "--request_rate=sweep:5,40", "--ablate=scheduling",
                      "--slo_ttft_ms=5000", f"--plot_dir={tmp_path}")
    rows = out["sweep"]["rows"]
    assert [(r[0], r[1]) for r in rows] == [("iteration", 5), ("static", 5),
                                           ("iteration", 40), ("static", 40)]
    assert all(0 <= r[3] <= 1 and r[2] <= r[5] + 1e-9 for r in rows)
    assert (tmp_path / "bench_goodput_sweep.png").stat().st_size > 0
    assert "Goodput under SLOs" in done.stdout


def test_sweep_needs_an_slo(model_dir, tmp_path):
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "bench", f"--model={model_dir}",
           "--request_rate=sweep:1,2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "SLO" in done.stderr


def test_liveness_and_readiness():
    engine = LLMEngine(EngineConfig.from_options(num_pages=32, page_size=8, max_num_seqs=2,
                                                 max_num_batched_tokens=32,
                                                 attention_backend="xla"), tiny_loaded())
    aengine = AsyncEngine(engine)
    with serve_app(build_app(aengine, ServerConfig())) as url:
        assert httpx.get(url + "/health/live").status_code == 200
        report = aengine.warm_up().result(timeout=300)
        assert report["compilations"] > 0
        ready = httpx.get(url + "/health/ready").json()
        assert ready["status"] == "ok" and ready["compilations_pending"] >= 0  # may compile on
        aengine.warming_up = True  # as while warm_up runs
        r = httpx.get(url + "/health/ready")
        assert r.status_code == 503 and "warming up" in r.json()["reason"]
        assert httpx.get(url + "/health").status_code == 503  # /health is readiness
        aengine.warming_up = False
        aengine.draining = True
        r = httpx.get(url + "/health/ready")
        assert r.status_code == 503 and "draining" in r.json()["reason"]
        assert httpx.get(url + "/health/live").status_code == 200
        aengine.shutdown()
        assert httpx.get(url + "/health/live").status_code == 503
        assert "dead" in httpx.get(url + "/health/ready").json()["reason"]
