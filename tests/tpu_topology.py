"""Compile for a TPU without a TPU: libtpu describes a chip generation's topology on any x86
host (`jax.experimental.topologies.get_topology_desc`), abstract inputs placed on one of its
devices make `jax.jit(f).lower(...).compile()` run XLA and Mosaic for that chip. Nothing runs.

  tpu_device(generation)           the first TpuDevice of a 2x2 topology ("v5e", "v6e");
                                   pytest.skip without libtpu
  abstract(shape, dtype, device)   a ShapeDtypeStruct placed on that device
  compile_for(fn, *args)           (compiled, seconds)

libtpu's lockfile. The first process on a host that initialises libtpu holds /tmp/libtpu_lockfile
until it exits (JAX tries a TPU backend in every process unless JAX_PLATFORMS excludes it);
any other process then fails to load the TPU plugin ("ABORTED: Internal error when accessing
libtpu multi-process lockfile"), and so would the topology lookup. Compiling needs no exclusive
access to a chip, so where the default backend is not a TPU, ALLOW_MULTIPLE_LIBTPU_LOAD=1 is set
for the lookup (it works even after a failed attempt in the same process) and then restored.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time

import jax
import pytest

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}


@functools.cache
def _topology(generation: str):
    from jax.experimental import topologies

    if jax.default_backend() == "tpu":  # a real TPU's process keeps its lock
        return topologies.get_topology_desc(topology_name=TOPOLOGIES[generation], platform="tpu")
    before = os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD")
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # read while the plugin loads, here
    try:
        return topologies.get_topology_desc(topology_name=TOPOLOGIES[generation], platform="tpu")
    finally:  # subprocesses of later tests see the environment they had
        if before is None:
            del os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"]
        else:
            os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = before


def tpu_device(generation: str):
    """The first device of the generation's 2x2 topology (one topology per process and
    generation); pytest.skip where libtpu is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not installed (the test extra installs it on linux x86_64)")
    return _topology(generation).devices[0]


def abstract(shape, dtype, device) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def compile_for(fn, *args):
    """jax.jit(fn) lowered on the abstract args and compiled for their device -> (compiled,
    seconds spent lowering and compiling)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start
