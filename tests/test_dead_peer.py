"""Multi-host failure: three local processes over loopback (tests/dead_peer_cases.py) with a
short distributed_timeout_s. A peer that dies mid-run, or never joins, ends the others with a
clear error within a bounded time instead of a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 18  # join deadline; a peer silent for 3 s is dead (slack for a loaded CI machine)


def _start(process_ids: list[int]) -> tuple[list[subprocess.Popen], float]:
    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "dead_peer_cases.py"),
                               str(port), str(i), str(TIMEOUT_S)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for i in process_ids]
    return procs, time.monotonic()


def _finish(proc: subprocess.Popen) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds to exit after start); killed if it hangs."""
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process hung: {err[-3000:]}") from None
    return proc.returncode, out, err, time.monotonic()


def test_a_peer_that_dies_mid_run_ends_the_others_with_an_error():
    procs, t0 = _start([0, 1, 2])
    results = [_finish(p) for p in procs]
    code, out, err, t_died = results[2]
    assert code == 1 and "dying" in out, err[-3000:]
    for code, out, err, t_end in results[:2]:
        assert "joined" in out and code != 0, err[-3000:]
        # Process 0's broadcast or 1's receive fails on the closed sockets; or, if it was busy
        # elsewhere (compiling) for the 3 s heartbeat deadline, JAX's coordination service
        # ends it first, naming the task.
        assert ("PeerLostError" in err and "died or left" in err
                or "Task 2 heartbeat timeout" in err), err[-3000:]
        assert t_end - t_died < TIMEOUT_S + 10


def test_a_peer_that_never_joins_ends_the_others_at_the_join_deadline():
    procs, t0 = _start([0, 1])  # process 2 of 3 never starts
    for code, out, err, t_end in (_finish(p) for p in procs):
        assert code == 1 and "joined" not in out, err[-3000:]
        assert "could not join the others through the coordinator at 127.0.0.1" in err
        assert TIMEOUT_S <= t_end - t0 < TIMEOUT_S + 30
