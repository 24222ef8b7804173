"""One process of a three-process engine whose peers fail, as a script (tests/test_dead_peer.py
starts them): `python tests/dead_peer_cases.py PORT PROCESS_ID TIMEOUT_S`. Each process has one
CPU device of a TP 3 mesh. Process 0 serves a short greedy workload, 1 follows it, and 2 follows
it for three steps and then dies (os._exit, as a crash would). The test also starts only 0 and
1, so that 2 never joins."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_device_cases import OPTIONS, SMOL_SHAPED  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine import make_engine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights.random_init import random_model  # noqa: E402

DIES_AFTER_STEPS = 3


def main() -> None:
    port, process_id, timeout_s = (int(a) for a in sys.argv[1:4])
    config = EngineConfig.from_options(**{**OPTIONS, "speculative_config": None},
                                       tensor_parallel_size=3, num_processes=3,
                                       process_id=process_id,
                                       coordinator_address=f"127.0.0.1:{port}",
                                       distributed_timeout_s=timeout_s)
    engine = make_engine(config, random_model(SMOL_SHAPED, seed=3, weight_scale=0.3))
    print("joined", flush=True)
    if process_id == 0:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)  # 13 of the 15 pages
        LLM.from_engine(engine).generate([[1, 2, 3]], params, use_tqdm=False)
        engine.stop_followers()
        return
    if process_id == 2:
        dispatch, steps = engine.runner.dispatch, []

        def dispatch_then_die(*args, **kwargs):
            out = dispatch(*args, **kwargs)
            steps.append(1)
            if len(steps) == DIES_AFTER_STEPS:
                print("dying", flush=True)
                os._exit(1)
            return out

        engine.runner.dispatch = dispatch_then_die
    engine.follow()


if __name__ == "__main__":
    main()
