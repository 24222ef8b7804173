"""Several processes (hosts) as one engine, through `jax.distributed`: one mesh spans every
process's devices; process 0 schedules and runs the front ends, and sends each device call's
(small) inputs to the others, so that every process runs the same jitted step on its shards.

Messages go with `multihost_utils.broadcast_one_to_all` (a collective of every process): a fixed
header (kind, payload bytes), then the pickled payload as bytes. Peers are trusted (they are
the same deployment). A peer that dies or never joins ends the run with an error within
`TIMEOUT_S` (JAX's defaults are 300 s to join and a 100 s heartbeat).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np

TIMEOUT_S = 60
HEARTBEAT_S = 10
STEP, COPY, RESET, STOP, SAMPLE = 1, 2, 3, 4, 5  # message kinds


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the processes (call before any other JAX use); CPU devices talk over gloo."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=TIMEOUT_S,
                               heartbeat_timeout_seconds=HEARTBEAT_S,
                               shutdown_timeout_seconds=TIMEOUT_S)


class Channel:
    """Process 0 sends (kind, payload); every other process receives them in the same order."""

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.is_source = jax.process_index() == 0

    def send(self, kind: int, payload=None) -> None:
        data = np.frombuffer(pickle.dumps(payload), np.uint8)
        self._broadcast(np.array([kind, data.size], np.int64))
        self._broadcast(data)

    def receive(self):
        kind, size = (int(x) for x in self._broadcast(np.zeros(2, np.int64)))
        data = np.asarray(self._broadcast(np.zeros(size, np.uint8)))
        return kind, pickle.loads(data.tobytes())


def follow(runner, channel: Channel) -> int:
    """A process other than 0: run what process 0 runs, until it stops; returns the steps run."""
    out, steps = None, 0
    while True:
        kind, payload = channel.receive()
        if kind == STEP:
            batch, copies, feeds, controls, sample = payload
            out = runner.dispatch(batch, copies, out if feeds else None, controls, sample)
            steps += 1
        elif kind == SAMPLE:  # the deferred sampling of the latest step (logit controls)
            runner.sample(out, *payload)
        elif kind == COPY:
            runner.copy_pages(*payload)
        elif kind == RESET:
            runner.reset_pool()
        elif kind == STOP:
            return steps
        else:
            raise RuntimeError(f"unknown message kind {kind} from process 0")
