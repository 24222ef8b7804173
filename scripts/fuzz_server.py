"""The long version of the server's fuzz and fault harness (tests/test_server_robustness.py,
tests/test_robustness.py): hypothesis-generated request bodies against `jaxserve serve` on the
tiny random model in its own process (as deployed), with a neighbour, a well-formed streaming
chat request repeated in a process of its own for the whole fuzz, then the fault injections,
with many more examples than CI runs.

  python scripts/fuzz_server.py                  # 5000 fuzzed bodies of each strategy
  python scripts/fuzz_server.py --examples=20000

Any JSON in the fields and the logit controls get --examples bodies each; the hostile shapes of
issue 54 (tests/fuzz_shapes.py) a share, by their cost: assistant tool_calls entries 1/5, forced
calls with $defs/$ref 1/10, many tools / huge descriptions / huge prompts 1/25, many prompts
with disconnects 1/50. Prints the run's size, duration and the machine's load averages before
and after, and the tests' tally: bodies sent, server errors (5xx), bodies that are not strict
JSON, requests that hung (each has a timeout), pages left referenced once the neighbour stops;
the neighbour's streams, its longest and 99th-percentile gap between chunks, gaps over a second,
its longest wait for a first chunk and whether its greedy text ever changed; and the server's
own figures from /debug/stats: its event loop's longest hold and its longest garbage collection,
with every hold of a second it logged. The full tally is also written to --report.
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
flags.DEFINE_string("report", None, "Where to write the tally as JSON (default: a temp file).")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    del argv
    report = os.path.abspath(FLAGS.report or os.path.join(tempfile.mkdtemp(), "fuzz.json"))
    load_before = os.getloadavg()
    env = {**os.environ, "JAXSERVE_FUZZ_EXAMPLES": str(FLAGS.examples),
           "JAXSERVE_FUZZ_REPORT": report}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_server_robustness.py", "tests/test_robustness.py"],
                          cwd=ROOT, env=env, check=False)
    print(f"fuzz: --examples={FLAGS.examples} plus the fault injections in "
          f"{time.monotonic() - t0:.0f} s; pytest exit {done.returncode}; load averages "
          f"(1, 5, 15 min) before {_load(load_before)}, after {_load(os.getloadavg())} on "
          f"{os.cpu_count()} cores")
    if os.path.exists(report):
        with open(report) as f:
            tally = json.load(f)
        print("fuzz: " + ", ".join(f"{k} {tally.get(k, 0)}" for k in (
            "bodies", "server_errors", "non_json", "hung", "leaked_pages")))
        print("neighbour: " + ", ".join(f"{k.removeprefix('neighbour_')} {tally.get(k)}" for k in (
            "neighbour_streams", "neighbour_chunks", "neighbour_max_gap_s", "neighbour_p99_gap_s",
            "neighbour_p50_gap_s", "neighbour_gaps_over_1s", "neighbour_max_first_chunk_s",
            "neighbour_distinct_texts", "neighbour_failures")))
        print("server: " + ", ".join(f"{k.removeprefix('server_')} {tally.get(k)}" for k in (
            "server_loop_max_lag_s", "server_loop_holds_over_100ms", "server_gc_max_pause_s",
            "server_engine_max_round_s")))
        for gap in tally.get("neighbour_worst_gaps", []):
            print(f"neighbour: gap {gap}")
        for line in tally.get("server_holds_logged", []):
            print(f"server log: {line}")
        print(f"fuzz: tally in {report}, the server's log in {report}.server.log")
    else:
        print("fuzz: no tally (the run stopped before its last server test)")
    return done.returncode


def _load(averages) -> str:
    return " ".join(f"{x:.2f}" for x in averages)


if __name__ == "__main__":
    app.run(main)
