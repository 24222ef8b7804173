"""One process of a three-process engine over loopback, as a script (tests/test_multi_device.py
starts three): `python tests/multi_host_cases.py PORT PROCESS_ID`. Each process has one CPU
device; the engine's TP 3 mesh spans them. Process 0 serves multi_device_cases' workload on the
SmolLM2-shaped model and prints its outputs as JSON; the others follow it and print the steps
they ran."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_device_cases import SMOL_SHAPED, serve  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine import make_engine  # noqa: E402
from jaxserve.weights.random_init import random_model  # noqa: E402


def main() -> None:
    port, process_id = int(sys.argv[1]), int(sys.argv[2])
    smol = random_model(SMOL_SHAPED, seed=3, weight_scale=0.3)
    joined = dict(tensor_parallel_size=3, num_processes=3, process_id=process_id,
                  coordinator_address=f"127.0.0.1:{port}")
    if process_id == 0:
        run = serve(smol, **joined)
        run.pop("engine").stop_followers()
        print(json.dumps(run))
    else:
        from multi_device_cases import OPTIONS

        engine = make_engine(EngineConfig(**{**OPTIONS, **joined}), smol)
        print(json.dumps({"steps": engine.follow()}))


if __name__ == "__main__":
    main()
