"""Serving benchmark harness: workloads (workload.py), drivers (runner.py), metrics (report.py).

`jaxserve bench` (jaxserve/cli/bench.py) puts them together; scripts/compare_peers.py reuses them.
"""

from jaxserve.tools.bench.report import build_report, format_ablation, format_report, summarize
from jaxserve.tools.bench.runner import RequestRecord, RunResult, run_engine, run_http
from jaxserve.tools.bench.workload import BenchRequest, LengthDist, WorkloadSpec

__all__ = ["WorkloadSpec", "LengthDist", "BenchRequest", "RequestRecord", "RunResult",
           "run_engine", "run_http", "build_report", "format_report", "format_ablation",
           "summarize"]
