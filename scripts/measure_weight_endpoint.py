"""The server's POST /update_weights timed (docs/rl.md): the model's own weights written once as
a safetensors directory in Hugging Face names, `jaxserve serve --enable_weight_updates --ready_after=all` started
in a subprocess, then the update sent `--repeats` times. Prints the client's and the server's
seconds per update and whether the greedy completion is the same before and after.

    python scripts/measure_weight_endpoint.py [--model smollm2-135m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from safetensors.numpy import save_file

from jaxserve.weights import load_model
from jaxserve.weights.named_update import hf_named

KEY = "measure"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve_flags", default="", help="More `jaxserve serve` flags.")
    args = parser.parse_args()
    loaded = load_model(args.model)
    directory = tempfile.mkdtemp(prefix="jaxserve-update-")
    named = {k: np.ascontiguousarray(v) for k, v in hf_named(loaded.config, loaded.params)}
    save_file(named, os.path.join(directory, "model.safetensors"))
    print(f"{len(named)} tensors, {sum(v.nbytes for v in named.values()) / 2**20:.1f} MiB "
          f"in {directory}")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli.main", "serve", f"--model={args.model}",
         f"--port={port}", f"--api_key={KEY}", "--enable_weight_updates", "--log_level=warning",
         "--ready_after=all",  # no warm-up compiling beside the updates
         *args.serve_flags.split()])
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(headers=AUTH, timeout=600)  # one connection: no setup in the times
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "server did not start"
            time.sleep(0.5)
        body = {"model": args.model, "prompt": "The capital of France is", "max_tokens": 16,
                "temperature": 0}

        def complete() -> str:
            r = client.post(url + "/v1/completions", json=body)
            return r.json()["choices"][0]["text"]

        before = complete()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = client.post(url + "/update_weights", json={"path": directory})
            elapsed = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            print(f"update: client {elapsed * 1e3:.0f} ms, server {r.json()['seconds'] * 1e3:.0f} "
                  f"ms, weights_version {r.json()['weights_version']}")
        print(f"same greedy completion after the updates: {complete() == before}")
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
