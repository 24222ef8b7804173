"""Start-up as a user meets it: seconds from launching `jaxserve serve` to the first 200 of
`/health/ready`, and to the log's "every warm-up shape compiled", one line per run.

  python scripts/measure_startup.py --runs=2                 # warm: the caches as they are
  python scripts/measure_startup.py --cold --runs=1          # a fresh compilation cache each run

--cold points XDG_CACHE_HOME (the compilation cache and the kernels' first-use build) at a
fresh directory per run; the kernels built at install (the package's built/ directory) stay in
use, as after `pip install`. It runs the `jaxserve` on PATH. Report the machine's load beside
the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name or path.")
flags.DEFINE_integer("runs", 1, "Starts to time.")
flags.DEFINE_integer("port", 8765, "Port for the server.")
flags.DEFINE_bool("cold", False, "A fresh XDG_CACHE_HOME per run (no compilation cache).")
flags.DEFINE_bool("all_shapes", True, "Also wait for every warm-up shape to compile.")
flags.DEFINE_integer("timeout", 900, "Seconds to give one start.")
flags.DEFINE_multi_string("serve_flag", [], "Extra flags for jaxserve serve.")
flags.DEFINE_bool("keep_logs", False, "Keep each run's server log (its start-up timeline).")


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _one_start(env: dict) -> tuple[float, float | None]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    command = ["jaxserve", "serve", f"--model={FLAGS.model}", f"--port={FLAGS.port}",
               *FLAGS.serve_flag]
    began = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    ready = all_shapes = None
    try:
        while time.perf_counter() - began < FLAGS.timeout and proc.poll() is None:
            now = time.perf_counter() - began
            if ready is None and _ready(FLAGS.port):
                ready = now
                if not FLAGS.all_shapes:
                    break
            if ready is not None and "every warm-up shape compiled" in open(log.name).read():
                all_shapes = now
                break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ready is None:
        sys.exit(f"no 200 from /health/ready; the log: {log.name}\n"
                 + open(log.name).read()[-3000:])
    if FLAGS.keep_logs:
        print(f"the server's log: {log.name}")
    else:
        os.unlink(log.name)
    return ready, all_shapes


def main(argv):
    del argv
    for run in range(FLAGS.runs):
        env = dict(os.environ)
        fresh = tempfile.mkdtemp(prefix="jaxserve-cold-") if FLAGS.cold else None
        if fresh:
            env["XDG_CACHE_HOME"] = fresh
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        load = os.getloadavg()[0]
        ready, all_shapes = _one_start(env)
        shapes = f"{all_shapes:.1f} s" if all_shapes is not None else "-"
        print(f"run {run + 1} {'cold' if fresh else 'warm'}: ready {ready:.1f} s, every shape {shapes}, load average {load:.1f}", flush=True)
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
