"""What a device's memory holds, measured: its capacity, the bytes in use now, and the peak since
the last reset. On an accelerator these are the allocator's counters (Device.memory_stats); on
the CPU, where device arrays are process memory, they are the process's resident set (Linux
/proc: VmRSS, and VmHWM reset through /proc/self/clear_refs)."""

from __future__ import annotations

import ctypes
import functools

import jax
import psutil


def _stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without allocator statistics
        return None


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def capacity(device=None) -> int:
    """Bytes the device may hold: the allocator's limit on an accelerator (which is already a
    fraction of HBM: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default on GPU); physical RAM on
    the CPU."""
    stats = _stats(device or jax.local_devices()[0])
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return int(psutil.virtual_memory().total)


def in_use(device=None) -> int:
    """Bytes held now: the allocator's bytes in use, or on the CPU the process's resident set
    once the C allocator has returned its free memory (malloc_trim: otherwise memory freed by
    one phase, still resident, would be counted again when a later phase reuses it)."""
    stats = _stats(device or jax.local_devices()[0])
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    _trim()
    return int(psutil.Process().memory_info().rss)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def reset_peak() -> bool:
    """Start a new peak measurement where the platform allows it (the CPU's VmHWM on Linux);
    False where the peak is the process's lifetime peak (accelerator allocators keep one)."""
    if _stats(jax.local_devices()[0]):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak(device=None) -> int:
    """The most bytes held since reset_peak (or since the process started)."""
    stats = _stats(device or jax.local_devices()[0])
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else in_use(device)


def compiled_temp_bytes(compiled) -> int:
    """What a compiled call allocates beside its arguments (XLA's memory analysis): its
    temporaries and the outputs that do not alias a donated argument (a step's KV pool)."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def bytes_on_device(tree) -> int:
    """Bytes of the arrays of `tree` held on one device, the first holding each (its shards of
    sharded arrays, the whole of replicated ones): what a tree costs per device of its mesh."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total
