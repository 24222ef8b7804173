"""The long version of the server's fuzz and fault harness (tests/test_server_robustness.py,
tests/test_robustness.py): hypothesis-generated request bodies against the server on the tiny
random model, then the fault injections, with many more examples than CI runs.

  python scripts/fuzz_server.py                  # 5000 fuzzed bodies of each strategy
  python scripts/fuzz_server.py --examples=20000

Prints the run's size and duration; the tests assert no 5xx for a client error, neighbours'
outputs unchanged, no page left referenced and every request answered (each has a timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_integer("examples", 5000, "Fuzzed request bodies.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    del argv
    env = {**os.environ, "JAXSERVE_FUZZ_EXAMPLES": str(FLAGS.examples)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_server_robustness.py", "tests/test_robustness.py"],
                          cwd=ROOT, env=env, check=False)
    print(f"fuzz: {FLAGS.examples} bodies plus the fault injections in "
          f"{time.monotonic() - t0:.0f} s; pytest exit {done.returncode}")
    return done.returncode


if __name__ == "__main__":
    app.run(main)
