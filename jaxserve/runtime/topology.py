"""TPU targets without a TPU: libtpu describes a topology (JAX's names: "v5e:2x2", "v6e:2x4",
"v5p:2x2x1", ...) on any x86 host, and jax.jit(f).lower(abstract inputs on its devices)
.compile() runs XLA and Mosaic for those chips; nothing executes.

libtpu's lockfile: the first process on a host that loads libtpu holds /tmp/libtpu_lockfile until
it exits, and any other process then fails to load the TPU plugin ("Internal error when accessing
libtpu multi-process lockfile"), the topology lookup included. Compiling needs no chip, so where
this process's default backend is not a TPU, ALLOW_MULTIPLE_LIBTPU_LOAD=1 is set for the lookup
and restored after (tests/tpu_topology.py does the same), with _OFF_TPU_ENV's other settings.

HBM per chip, by generation (Google Cloud's TPU pages): v4 32 GiB, v5e 16 GiB, v5p 95 GiB,
v6e 32 GiB; a topology with more devices than chips (v4's two TensorCores without megacore)
splits a chip's HBM between them. A device that reports its allocator limit is believed instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax

GIB = 2 ** 30
# Off a TPU host: share libtpu's lock; and libtpu asks the cloud's metadata server for this
# host's TPU type and workers, and logs errors when nothing answers: these say what to assume
# (the topology's name alone decides what is compiled: the same executable either way).
_OFF_TPU_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
                "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
HBM_BYTES_PER_CHIP = {"TPU v4": 32 * GIB, "TPU v5 lite": 16 * GIB, "TPU v5": 95 * GIB,
                      "TPU v5p": 95 * GIB, "TPU v6 lite": 32 * GIB}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple  # the topology's TpuDevices (compile-only)
    device_kind: str  # "TPU v6 lite"
    hbm_bytes_per_device: int


def _chips(name: str) -> int | None:
    """Chips in a topology name's grid ("v5e:2x2" -> 4); None when it names none."""
    dims = name.partition(":")[2]
    return math.prod(int(d) for d in dims.split("x")) if re.fullmatch(r"\d+(x\d+)*", dims) else None


def _hbm_bytes(device, devices: int, chips: int | None) -> int:
    try:
        limit = device.memory_stats().get("bytes_limit")
    except Exception:  # noqa: BLE001 - a compile-only device has no allocator statistics
        limit = None
    if limit:
        return int(limit)
    per_chip = HBM_BYTES_PER_CHIP.get(device.device_kind)
    if per_chip is None:
        raise ValueError(f"the HBM of a {device.device_kind!r} chip is not known (known: "
                         f"{sorted(HBM_BYTES_PER_CHIP)}); give --memory_budget_bytes")
    return per_chip // max(1, devices // (chips or devices))


@functools.cache
def tpu_topology(name: str) -> Topology:
    """The named TPU topology's devices and HBM per device; ValueError for a name libtpu does not
    know or a host without libtpu."""
    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("compiling for a TPU topology needs libtpu, the one this jax pairs "
                         "with: pip install 'jaxserve[tpu]' (or 'libtpu==0.0.42.1' for jax "
                         "0.10.2; linux x86_64)")
    before = {k: os.environ.get(k) for k in _OFF_TPU_ENV}
    if jax.default_backend() != "tpu":  # a real TPU's process keeps its lock and its host
        for k, v in _OFF_TPU_ENV.items():  # read while the plugin loads, here
            os.environ.setdefault(k, v)
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu says why in its message
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"unknown TPU topology {name!r} (JAX's names: v5e:2x2, v6e:2x4, "
                         f"v5p:2x2x1, ...): {message}") from None
    finally:  # subprocesses see the environment they had
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    devices = tuple(desc.devices)
    return Topology(name, devices, devices[0].device_kind,
                    _hbm_bytes(devices[0], len(devices), _chips(name)))


def compile_target(mesh: jax.sharding.Mesh):
    """A context in which lowering targets `mesh`'s chips (a topology's), where this process's
    own devices are CPUs: its abstract mesh names the chip, which Mosaic's device-dependent
    rules and JAX's kernel's tuned block sizes read (as pallas_kernels/tpu/jax_kernel.py's
    compile_target does for one chip), and matches the mesh a tensor-parallel step's shard_map
    runs on. Thread-local: enter it in the compiling thread."""
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
