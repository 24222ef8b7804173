"""One process of a three-process engine over loopback, as a script (tests/test_multi_device.py
starts three): `python tests/multi_host_cases.py PORT PROCESS_ID ORBAX_DIR`. Each process has
one CPU device; the engine's TP 3 mesh spans them, and each restores only its device's shards
of the SmolLM2-shaped model saved in ORBAX_DIR. Process 0 serves multi_device_cases' workload
and prints its outputs as JSON; the others follow it and print the steps they ran."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_device_cases import serve  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine import make_engine  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402


def main() -> None:
    port, process_id = int(sys.argv[1]), int(sys.argv[2])
    # lazy: nothing is read here; the runner restores the shards after the processes join
    smol = load_model(sys.argv[3], lazy=True)
    joined = dict(tensor_parallel_size=3, num_processes=3, process_id=process_id,
                  coordinator_address=f"127.0.0.1:{port}")
    if process_id == 0:
        run = serve(smol, **joined)
        run.pop("engine").stop_followers()
        print(json.dumps(run))
    else:
        from multi_device_cases import OPTIONS

        engine = make_engine(EngineConfig.from_options(**{**OPTIONS, **joined}), smol)
        print(json.dumps({"steps": engine.follow()}))


if __name__ == "__main__":
    main()
