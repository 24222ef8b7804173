"""Buckets: the few sizes each padded dimension of a step may take, so that compilations are
bounded and can all happen at warm-up (`step_shapes` lists the shapes the scheduler can
produce)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def _powers_of_two_and_halves(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo and the sizes halfway (3 * 2^k) between them, then hi: at most a
    third of a bucket is padding, not half."""
    sizes = {b for b in _powers_of_two(lo, hi) if b < hi}
    sizes |= {b * 3 // 2 for b in sizes if b % 2 == 0 and b * 3 // 2 < hi}
    return tuple(sorted(sizes)) + (hi,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Allowed sizes per padded dimension; a step takes the smallest that fits."""

    seqs: tuple[int, ...]  # decode rows, prefill rows, sample rows
    tokens: tuple[int, ...]  # prefill tokens
    pages: int  # page-table width: the most pages one sequence can hold (attention loops only
    #             as far as the longest sequence in the step, so the width is not a bucket)
    query_block: int = 1  # prefill chunks start at multiples of this (see AttentionMetadata)
    copies: tuple[int, ...] = (4, 32)  # copy-on-write pages per step (at most one per sequence)
    logprobs: tuple[int, ...] = (1, 5, 20)
    packed: bool = False  # decode rows packed with the prefill chunks (see the module docstring)
    # Speculative decoding's drafts per sequence: a verification chunk samples at every token.
    spec_tokens: int = 0
    lora: bool = False  # LoRA adapters served: every step carries each token's adapter slot

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int,
                   query_block: int = 1, packed: bool = False,
                   spec_tokens: int = 0) -> "Buckets":
        # Packed, decode-only steps are token buckets too: from 1, so one stream pads nothing.
        # Every padded token of a packed step runs through the matmuls, so its buckets are
        # finer: without the sizes between powers of two, decode of 3 to 40 streams ran 3-10%
        # slower, for 8 compiles off the path to ready (docs/serving.md, "Start-up, measured").
        lo = 1 if packed else 16
        spaced = _powers_of_two_and_halves if packed else _powers_of_two
        tokens = spaced(lo, max(lo, max_num_batched_tokens))
        if query_block > 1:  # room for the alignment padding of every prefill row
            top = tokens[-1] + (query_block - 1) * min(max_num_seqs, tokens[-1])
            tokens += (-(-top // query_block) * query_block,)
        copies = tuple(sorted({4, 32, max(4, max_num_seqs)}))
        assert not (packed and query_block > 1), "packed chunks start anywhere"
        return cls(seqs=_powers_of_two(1, max_num_seqs), tokens=tokens,
                   pages=max_pages_per_seq, query_block=query_block, copies=copies, packed=packed,
                   spec_tokens=spec_tokens)

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int) -> int:
        if n == 0:
            return 0
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def rows_bucket(self, rows: int) -> int:
        """The rows bucket `rows` rows pad to (the largest bucket when none holds them)."""
        return Buckets.fit(self.seqs, min(rows, self.seqs[-1]))

    def prefill_sample_rows(self, rows: int, tokens: int, needed: int, verifying: bool) -> int:
        """Sample rows of a step's prefill part with `rows` rows and `tokens` tokens (buckets),
        of which `needed` are used: one per row, or in a step that verifies drafts up to
        1 + spec_tokens per row within its tokens, so that the step's shape (and whether it
        verifies) fixes it; more (the n forks sampled at a prompt's end) pad to a rows bucket."""
        base = min(tokens, rows * (1 + self.spec_tokens)) if verifying else rows
        return base if needed <= base else Buckets.fit(self.seqs, needed)

    @property
    def max_sample_rows(self) -> int:
        """The most sample rows a step can have (decode rows and the prefill part's)."""
        top = self.seqs[-1]
        return top + (max(top, min(self.tokens[-1], top * (1 + self.spec_tokens)))
                      if self.spec_tokens else top)

    def packed_rows(self, tokens: int) -> int:
        """Rows of a packed step of `tokens` (a bucket): every chunk has a token, so no step has
        more rows than tokens, nor more than the largest rows bucket. Padding the rows this far
        makes the token bucket the step's only shape dimension; the padded rows cost only their
        page-table entries and sample rows."""
        return self.rows_bucket(min(tokens, self.seqs[-1]))

    def step_shapes(self, page_size: int, full: bool = False) -> list[tuple[int, int, int]]:
        """(decode rows Sd, prefill tokens, prefill rows) of the steps to compile at warm-up.
        Packed: one shape per token bucket, every shape the scheduler can produce. Otherwise,
        by default every decode-only bucket and every prefill-only token bucket with one row;
        full=True adds every combination of decode rows, prefill tokens and prefill rows the
        scheduler can produce."""
        if self.packed:
            return [(0, tp, self.packed_rows(tp)) for tp in self.tokens]
        seqs = (0,) + self.seqs
        tokens = (0,) + self.tokens
        qb = self.query_block
        max_units = -(-self.pages * page_size // qb)  # query blocks one row's chunk can span
        shapes = set()
        for sd, (prev, tp) in itertools.product(seqs, zip((0,) + tokens, tokens)):
            if sd + tp == 0:
                continue
            if tp == 0:
                rows = [0]
            else:
                # Rows that can land in this token bucket: each fills whole query blocks, and
                # none is longer than its page table holds (max_model_len), so sp rows reach
                # past the previous bucket only if sp * max_units blocks do.
                # Rows pad to their own buckets, so r <= units rows can take a rows bucket above
                # units (3 rows in the 3-token bucket are 4 rows).
                top = self.rows_bucket(tp // qb)
                fits = [s for s in seqs if 0 < s <= top and s * max_units * qb > prev]
                rows = fits if full else fits[:1]
            shapes.update((sd, tp, sp) for sp in rows if full or sd == 0 or tp == 0)
        return sorted(shapes)
