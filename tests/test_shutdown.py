"""Bounded shutdown of `jaxserve serve` (a subprocess serving the tiny model): on SIGINT it
stops accepting, lets live requests run for --shutdown_timeout seconds, answers the rest with
OpenAI-shaped errors and exits 0; a second signal exits at once, cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxserve.weights import save_orbax
from tiny_model import tiny_loaded

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_orbax(str(tmp_path_factory.mktemp("tiny") / "model"), tiny_loaded(max_len=2048))


def start_server(model_dir, shutdown_timeout: float):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", f"--model={model_dir}",
           f"--port={port}", f"--shutdown_timeout={shutdown_timeout}", "--max_num_seqs=1",
           "--num_pages=512", "--page_size=8", "--attention_backend=xla",
           "--served_model_name=tiny", "--log_level=warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def stream_all(url, n: int, results: list):
    """n streaming requests, each in a thread; results gets each one's status and data lines
    as they come. Returns once every request has its status (the server holds them all), so
    a signal sent then finds every one live, however loaded the machine."""
    def one(i):
        body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 1500, "stream": True,
                "temperature": 0, "ignore_eos": True}
        lines = results[i] = []
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                lines.append(r.status_code)
                lines += [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        except httpx.HTTPError as e:
            lines.append(repr(e))
        results[i] = lines

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(results[i] for i in range(n)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads


def test_sigint_drains_then_answers_the_rest_and_exits_0(model_dir):
    proc, url = start_server(model_dir, shutdown_timeout=1.0)
    results = [None] * 20
    threads = stream_all(url, 20, results)
    time.sleep(0.5)  # the first one is streaming, the rest wait (max_num_seqs=1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert proc.returncode == 0, err
    assert elapsed < 15, elapsed
    assert "Traceback" not in err, err
    finished = errored = 0
    for lines in results:
        assert lines[0] == 200 and lines[-1] == "[DONE]", lines[:3]
        last = json.loads(lines[-2])
        if "error" in last:
            assert set(last["error"]) == {"message", "type", "param", "code"}
            assert "shut" in last["error"]["message"]
            errored += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert errored > 0  # 20 x 1500 tokens, one at a time, cannot finish in one second


def test_a_second_signal_exits_at_once(model_dir):
    proc, url = start_server(model_dir, shutdown_timeout=60.0)
    results = [None] * 12
    threads = stream_all(url, 12, results)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    for t in threads:
        t.join(30)


def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(tmp_path):
    """Issue 54 row 14: the conflict was found after the model had loaded (20 s)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # no such model: reaching the load would be a different error
        proc = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "serve",
                               f"--model={tmp_path / 'absent'}", f"--port={port}"],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], proc.stderr


def test_live_answers_while_the_engine_is_built_and_ready_says_starting(model_dir):
    """docs/serving.md: the server listens at once; /health/live answered only once the engine
    was built. The first answers now come before the engine exists."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli.main", "serve",
                             f"--model={model_dir}", f"--port={port}", "--num_pages=64",
                             "--page_size=8", "--attention_backend=xla", "--log_level=warning",
                             "--compile_warmup=none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url, seen = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1][1] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            try:
                live = httpx.get(url + "/health/live", timeout=5)
                ready = httpx.get(url + "/health/ready", timeout=5)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            assert live.status_code == 200
            seen.append((ready.json().get("reason", "ok"), ready.status_code))
        assert seen[0][1] == 503 and seen[0][0].startswith("starting"), seen[:3]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_model_that_cannot_load_is_one_line_and_exit_2_after_listening(tmp_path):
    """The engine is built while the socket answers health: its failure still ends the
    server with one line and exit 2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "serve",
                           f"--model={tmp_path / 'absent'}", f"--port={port}",
                           "--log_level=warning"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "jaxserve serve: error:" in line]
    assert len(errors) == 1 and "absent" in errors[0] and "Traceback" not in proc.stderr
