"""The real default model (SmolLM2-135M: 9 query heads over 3 KV heads) at TP 1 and TP 3 on
three virtual CPU devices, as a script (tests/test_multi_device.py's slow test runs it):
`python tests/smollm2_tp_cases.py GGUF_PATH` prints {"tp1": run, "tp3": run}, each run
multi_device_cases.serve's workload (prefix caching, chunked prefill, forced preemption, int8
KV pages, ngram speculation)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_device_cases import serve  # noqa: E402

from jaxserve.weights import load_model  # noqa: E402


def main() -> None:
    loaded = load_model(sys.argv[1])
    runs = {}
    for tp in (1, 3):
        run = serve(loaded, max_tokens=12, tensor_parallel_size=tp)
        run.pop("engine")
        runs[f"tp{tp}"] = run
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
