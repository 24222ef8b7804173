"""Huge-page backing of host arrays (jaxserve.backends.cpu.huge_pages): block choice, unchanged contents, and
no change to any output."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends.cpu.huge_pages import HUGE_PAGE, _huge_page_blocks, collapse_into_huge_pages
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine

H = HUGE_PAGE


def test_blocks_are_the_half_filled_ones_inside_a_mapping():
    mapping = [(10 * H, 20 * H)]
    # 3.5 blocks from 11H: blocks 11-13 full, block 14 half full.
    assert _huge_page_blocks([(11 * H, 3 * H + H // 2)], mapping) == [11 * H, 12 * H, 13 * H, 14 * H]
    # Less than half of a block: left alone; two small buffers in one block add up.
    assert _huge_page_blocks([(11 * H + 10, H // 4)], mapping) == []
    assert _huge_page_blocks([(11 * H, H // 4), (11 * H + H // 2, H // 4)], mapping) == [11 * H]
    # A block reaching past the mapping is never touched.
    assert _huge_page_blocks([(19 * H + H // 4, H)], mapping) == [19 * H]
    assert _huge_page_blocks([(20 * H - H // 2 - 1, H)], [(10 * H, 20 * H - 1)]) == []
    assert _huge_page_blocks([(30 * H, 4 * H)], mapping) == []


def test_collapse_keeps_contents_and_counts_only_what_it_collapsed():
    x = jnp.arange(6 * H // 4, dtype=jnp.float32)  # 6 MiB
    before = np.asarray(x).copy()
    done = collapse_into_huge_pages([x, jnp.zeros(3)])  # the small array is skipped
    assert done % H == 0 and done <= 7 * H
    np.testing.assert_array_equal(np.asarray(x), before)
    if done:  # the kernel agreed (Linux 6.1+, THP not "never"): it shows in smaps
        address = x.unsafe_buffer_pointer()
        huge_kb, inside = 0, False
        for line in open("/proc/self/smaps"):
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                inside = lo < address + x.nbytes and address < hi  # madvise splits mappings
            elif inside and fields[0] == "AnonHugePages:":
                huge_kb += int(fields[1])
        assert huge_kb * 1024 >= H


@pytest.mark.slow
def test_huge_pages_change_no_output(default_loaded):
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0, max_tokens=12)
    runs = {}
    for flag in (False, True):
        engine = LLMEngine(EngineConfig.from_options(num_pages=64, max_num_seqs=2, huge_pages=flag),
                           default_loaded)
        assert (engine.stats()["huge_page_bytes"] > 0) <= flag
        ids = [engine.add_request(p, params).request_id for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        runs[flag] = [done[i] for i in ids]
    assert runs[False] == runs[True] and all(len(t) == 12 for t in runs[True])
