"""Tuning of the GPU kernel, apart from its numerics: `GpuBlockSizes` (the knobs a caller may set)
and `plan` (the launch geometry they give for one call's static shapes).

The split rule (flash-decoding): a program is (query block, KV head, split). Rows that are few
and long leave most of a GPU idle unless each (query block, KV head) splits its pages over several
programs, so

  splits = clamp(ceil(TARGET_PROGRAMS / (working blocks * Hkv)), 1, MAX_SPLITS,
                 ceil(P / pages_per_block))

where working blocks = min(T, cdiv(T, block_q) + S) estimates the query blocks that hold tokens
(every decode row is one block; a long prompt is T / block_q blocks), and no split is left
without a page block. Examples (page 16, pages_per_block 4):

  64 decode rows x 2048 context, Hkv 8, G 4   -> 64 * 8 = 512 pairs, 2 splits, 1024 working
  1 decode row x 32768 context, Hkv 8          -> 8 pairs, 32 splits of 64 pages, 256 working
  256 decode rows, Hkv 8                       -> 2048 pairs, 1 split
  one 2048-token prefill, Hkv 8, G 1 (block_q 64) -> 33 * 8 = 264 pairs, 4 splits

TARGET_PROGRAMS and MAX_SPLITS are first guesses (an H200 has 132 SMs), not measured here.
"""

from __future__ import annotations

import dataclasses

TARGET_PROGRAMS = 1024  # programs with work that fill a large GPU several times over
MAX_SPLITS = 32  # splits of one query block's pages; partial results grow with it
MIN_ROWS = 16  # Triton's dots need M, N, K >= 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuBlockSizes:
    """block_q: query tokens per program (None: 16 // Gp when every row could be a decode row,
    T <= S, else 64 // Gp; raised until block_q * Gp >= 16); pages_per_block: pages per inner
    step (raised until pages_per_block * B >= 16, lowered to the table width); splits: KV splits
    per query block (None: the split rule above); num_warps, num_stages: Triton's."""

    block_q: int | None = None
    pages_per_block: int = 4
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "pages_per_block", "splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is None and name in ("block_q", "splits"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GpuBlockSizes.{name} must be a positive int, got {value!r}")
        for name in ("block_q", "pages_per_block"):
            value = getattr(self, name)
            if value is not None and not is_pow2(value):
                raise ValueError(f"GpuBlockSizes.{name} must be a power of two, got {value}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static launch geometry of one call."""

    group_pad: int  # G padded to a power of two
    block_q: int  # query tokens per program
    rows: int  # block_q * group_pad: rows of a program's query matrix, >= MIN_ROWS
    num_blocks: int  # query blocks: cdiv(T, block_q) + S, an upper bound (spare ones exit)
    pages_per_block: int  # pages per inner step: block_k = pages_per_block * B >= MIN_ROWS
    splits: int  # programs per (query block, KV head), each over pages_per_split pages
    pages_per_split: int  # a multiple of pages_per_block; splits * pages_per_split >= P

    @property
    def table_width(self) -> int:  # the page table padded to whole splits
        return self.splits * self.pages_per_split


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def num_splits(*, num_tokens: int, num_blocks: int, num_kv_heads: int, table_width: int,
               pages_per_block: int) -> int:
    """The split rule of the module docstring."""
    working = min(num_tokens, num_blocks) * num_kv_heads
    wanted = -(-TARGET_PROGRAMS // max(working, 1))
    return max(1, min(wanted, MAX_SPLITS, -(-table_width // pages_per_block)))


def plan(*, num_tokens: int, num_seqs: int, group: int, num_kv_heads: int, page_size: int,
         table_width: int, block_sizes: GpuBlockSizes) -> Plan:
    bs = block_sizes
    group_pad = 1 << (group - 1).bit_length()
    block_q = bs.block_q or max(1, (16 if num_tokens <= num_seqs else 64) // group_pad)
    block_q = max(block_q, MIN_ROWS // group_pad)
    num_blocks = -(-num_tokens // block_q) + num_seqs
    ppb = min(bs.pages_per_block, 1 << (table_width - 1).bit_length())
    ppb = max(ppb, MIN_ROWS // page_size)
    splits = bs.splits or num_splits(num_tokens=num_tokens, num_blocks=num_blocks,
                                     num_kv_heads=num_kv_heads, table_width=table_width,
                                     pages_per_block=ppb)
    pages_per_split = -(-table_width // (splits * ppb)) * ppb
    return Plan(group_pad=group_pad, block_q=block_q, rows=block_q * group_pad,
                num_blocks=num_blocks, pages_per_block=ppb, splits=splits,
                pages_per_split=pages_per_split)
