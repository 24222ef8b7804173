"""Back host (CPU-device) arrays with 2 MiB transparent huge pages.

Single-stream decode streams every weight once a step: on 4 KiB pages, that is a TLB miss every
few kilobytes. With THP in "madvise" mode (a common default) XLA's buffers only get 4 KiB pages;
this asks the kernel (Linux 6.1+, MADV_COLLAPSE) to collapse the arrays' memory into huge pages
in place, contents unchanged (the measured gain is in docs/performance-history.md). Where the
kernel, the THP setting or the platform does not allow it, nothing happens: it is only a
speed-up.
"""

from __future__ import annotations

import bisect
import ctypes
import sys

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def _anonymous_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's private read-write mappings without a file behind them."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            if fields[1].startswith("rw") and fields[1][3] == "p" and path in ("", "[heap]"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                spans.append((start, end))
    return spans


def _huge_page_blocks(buffers: list[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[int]:
    """The 2 MiB blocks, inside one mapping each, that the buffers (address, bytes) fill at least
    half of: collapsing a block populates all of it, so mostly-empty ones would only add memory."""
    covered: dict[int, int] = {}
    for address, size in buffers:
        for block in range(address // HUGE_PAGE * HUGE_PAGE, address + size, HUGE_PAGE):
            overlap = min(block + HUGE_PAGE, address + size) - max(block, address)
            covered[block] = covered.get(block, 0) + overlap
    mappings = sorted(mappings)
    starts = [lo for lo, _ in mappings]

    def inside_one_mapping(block: int) -> bool:
        i = bisect.bisect_right(starts, block) - 1
        return i >= 0 and block + HUGE_PAGE <= mappings[i][1]

    return [block for block, n in sorted(covered.items())
            if 2 * n >= HUGE_PAGE and inside_one_mapping(block)]


def collapse_into_huge_pages(arrays) -> int:
    """Collapse the memory of CPU-resident JAX arrays into huge pages; returns the bytes
    collapsed (0 where unsupported). Safe to call on any arrays: others are skipped."""
    if not sys.platform.startswith("linux"):
        return 0
    buffers = []
    for x in arrays:
        try:
            if all(d.platform == "cpu" for d in x.devices()) and x.nbytes >= HUGE_PAGE // 4:
                buffers.append((x.unsafe_buffer_pointer(), x.nbytes))
        except (AttributeError, NotImplementedError, RuntimeError, ValueError):
            continue  # sharded, deleted, or not a device array
    if not buffers:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        blocks = _huge_page_blocks(buffers, _anonymous_mappings())
    except OSError:
        return 0
    runs: list[list[int]] = []  # consecutive blocks: one call each (a call has a fixed cost)
    for block in blocks:
        if runs and runs[-1][-1] + HUGE_PAGE == block:
            runs[-1].append(block)
        else:
            runs.append([block])
    done = 0
    for run in runs:
        size = len(run) * HUGE_PAGE
        if libc.madvise(run[0], size, _MADV_HUGEPAGE) != 0:
            continue
        if libc.madvise(run[0], size, _MADV_COLLAPSE) == 0:
            done += size
            continue
        # Some block failed (EAGAIN: a page was busy; EINVAL: the mappings changed under it):
        # retry block by block, leaving only the failing ones on small pages.
        done += HUGE_PAGE * sum(libc.madvise(b, HUGE_PAGE, _MADV_COLLAPSE) == 0 for b in run)
    return done
