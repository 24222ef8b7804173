"""Block sizes (tuning knobs) for the Pallas attention kernels, kept apart from the numerics.

Block sizes change memory traffic and parallelism, never the result beyond floating-point
evaluation order. Each dataclass is frozen, keyword-only and validated on construction.
"""

from __future__ import annotations

import dataclasses


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBlockSizes:
    """Paged decode: how many KV pages one online-softmax step reads (pages_per_block * B keys).

    Clamped to the page-table width P at call time.
    """

    pages_per_block: int = 4

    def __post_init__(self):
        _check_positive("DecodeBlockSizes", pages_per_block=self.pages_per_block)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillBlockSizes:
    """Ragged prefill: block_q flat query tokens per program, block_kv_pages pages per key block.

    A query block may span several sequences; T is padded up to a multiple of block_q.
    block_kv_pages is clamped to the page-table width P at call time.
    """

    block_q: int = 32
    block_kv_pages: int = 4

    def __post_init__(self):
        _check_positive(
                "PrefillBlockSizes", block_q=self.block_q, block_kv_pages=self.block_kv_pages
        )
