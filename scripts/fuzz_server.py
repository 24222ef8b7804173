"""The long version of the server's fuzz and fault harness (tests/test_server_robustness.py,
tests/test_robustness.py): hypothesis-generated request bodies against the server on the tiny
random model, then the fault injections, with many more examples than CI runs.

  python scripts/fuzz_server.py                  # 5000 fuzzed bodies of each strategy
  python scripts/fuzz_server.py --examples=20000

Any JSON in the fields and the logit controls get --examples bodies each; the hostile shapes of
issue 54 (tests/fuzz_shapes.py) a share, by their cost: assistant tool_calls entries 1/5, forced
calls with $defs/$ref 1/10, many tools / huge descriptions / huge prompts 1/25, many prompts
with disconnects 1/50. Prints the run's size and duration and the tests' tally: bodies sent,
server errors (5xx), bodies that are not strict JSON, requests that hung (each has a timeout),
pages left referenced after the fuzz, and the longest the event loop was held (what a
neighbouring stream sees as a frozen gap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("examples", 5000, "Fuzzed request bodies per strategy.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    del argv
    report = os.path.join(tempfile.mkdtemp(), "fuzz.json")
    env = {**os.environ, "JAXSERVE_FUZZ_EXAMPLES": str(FLAGS.examples),
           "JAXSERVE_FUZZ_REPORT": report}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_server_robustness.py", "tests/test_robustness.py"],
                          cwd=ROOT, env=env, check=False)
    print(f"fuzz: --examples={FLAGS.examples} plus the fault injections in "
          f"{time.monotonic() - t0:.0f} s; pytest exit {done.returncode}")
    if os.path.exists(report):
        with open(report) as f:
            tally = json.load(f)
        print("fuzz: " + ", ".join(f"{k} {tally.get(k, 0)}" for k in (
            "bodies", "server_errors", "non_json", "hung", "leaked_pages",
            "worst_loop_hold_s", "worst_gc_s")))
    else:
        print("fuzz: no tally (the run stopped before its last server test)")
    return done.returncode


if __name__ == "__main__":
    app.run(main)
