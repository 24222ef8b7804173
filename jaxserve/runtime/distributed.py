"""Several processes (hosts) as one engine, through `jax.distributed`: one mesh spans every
process's devices; process 0 schedules and runs the front ends, and sends each device call's
(small) inputs to the others, so that every process runs the same jitted step on its shards.

Messages (Step, Sample, Copy, Reset, Stop: one dataclass each) go with
`multihost_utils.broadcast_one_to_all` (a collective of every process): a fixed header (the
message's bytes), then the pickled message. Peers are trusted (they are
the same deployment).

A peer that dies or never joins ends the run with a clear error within `timeout_s` (JAX's
defaults are 300 s to join and a 100 s heartbeat, and both end in a C++ abort):
- joining: a process not joined after timeout_s prints which coordinator it waited for and
  exits 1 (JAX's own join deadline is set later, so this fires first);
- a peer that dies mid-run breaks the next broadcast (its sockets close): PeerLostError;
- a peer that hangs or whose host vanishes misses heartbeats for timeout_s / 6: JAX's
  coordination service ends every process with an error naming that task.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import threading

import jax
import numpy as np

from typing import Any

TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Step:
    """ModelRunner.dispatch's arguments; feeds: whether it feeds on the previous step's samples."""
    batch: Any  # StepBatch
    copies: Any  # (src, dst) page arrays, or None
    feeds: bool
    controls: Any  # LogitControls, or None
    sample: bool


@dataclasses.dataclass(frozen=True)
class Sample:
    """The deferred sampling of the latest step (logit controls): ModelRunner.sample's."""
    sampling: Any  # SamplingMetadata
    controls: Any


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy-on-write page copies outside a step."""
    src: Any
    dst: Any


@dataclasses.dataclass(frozen=True)
class Reset:
    """A zeroed KV pool (after a failed step consumed the donated one)."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Process 0 is done: `follow` returns."""


class PeerLostError(RuntimeError):
    """A collective with the other processes failed: one of them died or left."""


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               timeout_s: int = TIMEOUT_S) -> None:
    """Join the processes (call before any other JAX use); CPU devices talk over gloo. A
    process that cannot join within timeout_s exits 1 with a message (a join cannot be
    abandoned: JAX would abort the process)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
    heartbeat_s = max(1, timeout_s // 6)
    watchdog = threading.Timer(timeout_s, _not_joined,
                               (coordinator_address, num_processes, process_id, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s + heartbeat_s,
                               heartbeat_timeout_seconds=heartbeat_s,
                               shutdown_timeout_seconds=timeout_s)
    watchdog.cancel()


def _not_joined(address: str, num_processes: int, process_id: int, timeout_s: int) -> None:
    print(f"jaxserve: error: process {process_id} of {num_processes} could not join the "
          f"others through the coordinator at {address} within {timeout_s} s: a process never "
          "started, died, or was given another --num_processes or --coordinator_address",
          file=sys.stderr, flush=True)
    os._exit(1)


class Channel:
    """Process 0 sends messages; every other process receives them in the same order."""

    def __init__(self):
        from jax.experimental import multihost_utils

        self._collective = multihost_utils.broadcast_one_to_all
        self.is_source = jax.process_index() == 0

    def _broadcast(self, x):
        try:
            return np.asarray(self._collective(x))  # waits: a failure surfaces here
        except Exception as e:  # XLA reports a closed gloo socket as a ValueError
            raise PeerLostError(
                f"process {jax.process_index()} of {jax.process_count()}: a broadcast to the "
                f"other processes failed, so one of them died or left ({e})") from e

    def send(self, message: Step | Sample | Copy | Reset | Stop) -> None:
        data = np.frombuffer(pickle.dumps(message), np.uint8)
        self._broadcast(np.array([data.size], np.int64))
        self._broadcast(data)

    def receive(self) -> Step | Sample | Copy | Reset | Stop:
        size = int(self._broadcast(np.zeros(1, np.int64))[0])
        return pickle.loads(self._broadcast(np.zeros(size, np.uint8)).tobytes())


def follow(runner, channel: Channel) -> int:
    """A process other than 0: run what process 0 runs, until it stops; returns the steps run."""
    out, steps = None, 0
    while True:
        match channel.receive():
            case Step(batch, copies, feeds, controls, sample):
                out = runner.dispatch(batch, copies, out if feeds else None, controls, sample)
                steps += 1
            case Sample(sampling, controls):
                runner.sample(out, sampling, controls)
            case Copy(src, dst):
                runner.copy_pages(src, dst)
            case Reset():
                runner.reset_pool()
            case Stop():
                return steps
            case message:
                raise RuntimeError(f"unknown message {message!r} from process 0")
