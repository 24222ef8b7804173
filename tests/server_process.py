"""The server as deployed, for the fuzz (tests/test_server_robustness.py, scripts/fuzz_server.py):
`jaxserve serve` in its own process on the tiny model (written as an orbax checkpoint), and a
neighbour in a process of its own, a well-formed streaming chat request repeated for as long as
the fuzz runs, which records the gap between consecutive chunks of each stream: what a user
beside a hostile client sees. Neither shares a heap with pytest and hypothesis, whose
collections would pause them. The server's own loop and gc figures come from its /debug/stats.

  python tests/server_process.py URL   # the neighbour: streams until SIGINT, then its report
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

MODEL = "tiny"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's jaxserve
# The in-process fuzz's batch (test_server_robustness.py), with pages enough that the neighbour
# is never preempted (a gap then is the server's, not the page budget's), and the platform's
# own attention backend, as deployed (on a CPU its packed backend, whose default warm-up
# compiles every step shape; --compile_warmup=full adds the sampling calls that logprobs,
# penalties and logit_bias would otherwise compile on first use).
ENGINE_FLAGS = ("--num_pages=512", "--page_size=8", "--max_num_seqs=8",
                "--max_num_batched_tokens=64")


def write_tiny_model(path: str) -> str:
    from jaxserve.weights import save_orbax
    from tiny_model import tiny_loaded
    return save_orbax(path, tiny_loaded())


@contextlib.contextmanager
def served(model_dir: str, *flags: str, log_path: str | None = None, timeout: float = 300):
    """Yields the base URL of `jaxserve serve` on a free loopback port once /health/ready says
    200 (the warm-up's shapes compiled); SIGINT at the end. Its stderr goes to log_path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", f"--model={model_dir}",
           f"--port={port}", f"--served_model_name={MODEL}", "--log_level=warning",
           *ENGINE_FLAGS, *flags]
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"jaxserve serve exited {proc.returncode} ({log_path})"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "jaxserve serve was not ready in time"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


NEIGHBOUR = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}],
             "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}


class Neighbour:
    """A streaming chat request repeated until stop(): each stream's chunk gaps (the time
    between consecutive `data:` lines; the wait for the first chunk, which includes the queue
    and the prefill, is kept apart), its text (greedy: the same every time) and its failures."""

    def __init__(self, url: str):
        self.url = url
        self.gaps: list[float] = []
        self.worst: list[tuple[float, float]] = []  # the longest gaps, with when they ended
        self.first_chunk_s: list[float] = []
        self.texts: dict[str, int] = {}
        self.failures: list[str] = []
        self.streams = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="neighbour", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    self._one(client)
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                    time.sleep(0.1)

    def _one(self, client) -> None:
        text, last = [], None
        sent = time.perf_counter()
        with client.stream("POST", self.url + "/v1/chat/completions", json=NEIGHBOUR) as r:
            if r.status_code != 200:
                self.failures.append(f"{r.status_code} {r.read()[:200]!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if last is None:
                    self.first_chunk_s.append(now - sent)
                else:
                    self.gaps.append(now - last)
                    if now - last > 0.25:
                        self.worst = sorted(self.worst + [(now - last, time.time())])[-5:]
                last = now
                if line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.failures.append(line[:200])
                    for choice in event.get("choices", ()):
                        text.append(choice["delta"].get("content") or "")
        self.streams += 1
        joined = "".join(text)
        self.texts[joined] = self.texts.get(joined, 0) + 1

    def report(self) -> dict:
        gaps = sorted(self.gaps)
        return {"neighbour_streams": self.streams, "neighbour_chunks": len(gaps) + self.streams,
                "neighbour_max_gap_s": round(gaps[-1], 3) if gaps else None,
                "neighbour_p99_gap_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3) if gaps
                else None,
                "neighbour_p50_gap_s": round(gaps[len(gaps) // 2], 4) if gaps else None,
                "neighbour_gaps_over_1s": sum(g > 1.0 for g in gaps),
                "neighbour_max_first_chunk_s": round(max(self.first_chunk_s), 3)
                if self.first_chunk_s else None,
                "neighbour_distinct_texts": len(self.texts),
                "neighbour_failures": len(self.failures),
                "neighbour_worst_gaps": [
                    f"{gap:.3f} s ending {time.strftime('%H:%M:%S', time.gmtime(end))}."
                    f"{int(end % 1 * 1000):03d} UTC" for gap, end in reversed(self.worst)],
                "neighbour_failure_examples": self.failures[:3]}


@contextlib.contextmanager
def neighbour_process(url: str):
    """Yields a function that stops the neighbour (a process running this file) and returns
    its report; called at the end if not before."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), url],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    report = {}

    def stop() -> dict:
        if not report:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
            report.update(json.loads(out.strip().splitlines()[-1]))
        return report

    try:
        yield stop
    finally:
        stop()


def wait_idle(url: str, headers: dict | None = None, timeout: float = 120) -> dict:
    """/debug/stats once nothing runs, waits or holds a page (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/debug/stats", headers=headers or {}, timeout=30).json()
        if stats["running"] == stats["waiting"] == stats["referenced_pages"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def main(url: str) -> None:
    import gc
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    gc.freeze()  # the imports: no collection in this process walks them while it measures
    with Neighbour(url) as neighbour:
        stopped.wait()
    print(json.dumps(neighbour.report()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
