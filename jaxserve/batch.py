"""StepPlan -> StepBatch: fixed-shape numpy arrays padded to a small set of buckets.

This is the only place host plans become arrays; the runner moves them to the device. Layout of
the T flat tokens: Sd decode rows (one token each, padded to a bucket), then the prefill chunks,
each starting at a multiple of `query_block` (1 packs them back to back), padded to a token
bucket. Padded tokens write to scratch page 0. With `Buckets.packed` (an attention backend that
treats every row alike, "cpu"), decode rows are not split out (Sd = 0): every chunk is packed
back to back and only the total is padded, so a step of 141 decode rows and 883 prompt tokens is
1024 tokens, not 256 + 1024.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import jax
import numpy as np

from jaxserve.model.attention import AttentionMetadata, _pytree_dataclass, static_field
from jaxserve.sampling import FILTERED, GREEDY, RANDOM, SamplingMetadata
from jaxserve.step_plan import StepPlan


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

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int,
                   query_block: int = 1, packed: bool = False) -> "Buckets":
        # Packed, decode-only steps are token buckets too: from 1, so one stream pads nothing.
        # Every padded token of a packed step runs through the matmuls, so its buckets are
        # finer (compiles are cheap there: ~0.4 s a shape).
        lo = 1 if packed else 16
        spaced = _powers_of_two_and_halves if packed else _powers_of_two
        tokens = spaced(lo, max(lo, max_num_batched_tokens))
        if query_block > 1:  # room for the alignment padding of every prefill row
            top = tokens[-1] + (query_block - 1) * min(max_num_seqs, tokens[-1])
            tokens += (-(-top // query_block) * query_block,)
        copies = tuple(sorted({4, 32, max(4, max_num_seqs)}))
        assert not (packed and query_block > 1), "packed chunks start anywhere"
        return cls(seqs=_powers_of_two(1, max_num_seqs), tokens=tokens,
                   pages=max_pages_per_seq, query_block=query_block, copies=copies, packed=packed)

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int) -> int:
        if n == 0:
            return 0
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]


@_pytree_dataclass
class StepBatch:
    token_ids: jax.Array  # i32[T]
    feed_rows: jax.Array  # i32[T] >= 0: the token is the previous step's sample at this row
    attn: AttentionMetadata
    logits_indices: jax.Array  # i32[R] flat token whose logits each sample row reads
    sampling: SamplingMetadata
    prompt_targets: jax.Array  # i32[T] next prompt token after each token (for prompt logprobs)
    prompt_logprobs: int = static_field()  # -1: none; k >= 0: return prompt logprobs and top k


def build_batch(plan: StepPlan, buckets: Buckets,
                page_size: int) -> tuple[StepBatch, int, list[int]]:
    """Returns the padded batch, the number of real sample rows (the first rows of R), and the
    flat index of each chunk's first token (in plan.chunks order)."""
    decode = [] if buckets.packed else [c for c in plan.chunks if c.is_decode]
    prefill = plan.chunks[len(decode):]
    assert all(not c.is_decode for c in prefill) or buckets.packed, \
        "decode chunks must come first in the plan"
    sd = Buckets.fit(buckets.seqs, len(decode))
    sp = Buckets.fit(buckets.seqs, len(prefill))
    qb = buckets.query_block
    tp = Buckets.fit(buckets.tokens, sum(-(-c.num_tokens // qb) * qb for c in prefill))
    num_rows = sd + sp
    width = buckets.pages
    t = sd + tp
    token_ids = np.zeros(t, np.int32)
    feed_rows = np.full(t, -1, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.arange(t, dtype=np.int32) % page_size  # padding -> scratch page 0
    token_row = np.full(t, num_rows, np.int32)
    page_tables = np.zeros((num_rows, width), np.int32)
    seq_lens = np.zeros(num_rows, np.int32)
    query_start = np.zeros(num_rows + 1, np.int32)
    prompt_targets = np.zeros(t, np.int32)
    prompt_k = -1
    rows = []  # (flat index of the token whose logits are sampled, sequence)
    offsets = []

    def place(row: int, chunk, first: int):
        seq, n, start = chunk.seq, chunk.num_tokens, chunk.start
        end = start + n
        offsets.append(first)
        pages = seq.page_ids[:math.ceil(end / page_size)]
        page_tables[row, :len(pages)] = pages
        seq_lens[row] = end
        pos = np.arange(start, end, dtype=np.int32)
        if chunk.feed_row >= 0:  # a decode of the token the step in flight samples
            feed_rows[first] = chunk.feed_row
        else:
            token_ids[first:first + n] = seq.token_ids[start:end]
        positions[first:first + n] = pos
        slots[first:first + n] = np.asarray(pages, np.int32)[pos // page_size] * page_size \
            + pos % page_size
        token_row[first:first + n] = row
        nonlocal prompt_k
        wanted = seq.sampling_params.prompt_logprobs
        if wanted is not None and start < seq.num_prompt_tokens:
            prompt_k = max(prompt_k, wanted)
            targets = seq.token_ids[start + 1:min(end + 1, seq.num_prompt_tokens)]
            prompt_targets[first:first + len(targets)] = targets
        rows.extend((first + n - 1, s) for s in chunk.sample_seqs)

    for i, chunk in enumerate(decode):
        place(i, chunk, i)
        query_start[i + 1] = i + 1
    query_start[len(decode) + 1:sd + 1] = len(decode)
    first = sd
    for j, chunk in enumerate(prefill):
        place(sd + j, chunk, first)
        first += -(-chunk.num_tokens // qb) * qb
        query_start[sd + j + 1] = first
    query_start[sd + len(prefill) + 1:] = first

    # Decode rows sample once each; sizing R from (Sd, prefill rows) adds no compile dimension.
    r = sd + Buckets.fit(buckets.seqs, max(sp, len(rows) - len(decode)))
    logits_indices = np.zeros(r, np.int32)
    temperature = np.zeros(r, np.float32)
    top_k = np.zeros(r, np.int32)
    top_p = np.ones(r, np.float32)
    min_p = np.zeros(r, np.float32)
    seeds = np.zeros(r, np.uint32)
    forks = np.zeros(r, np.int32)
    sample_pos = np.zeros(r, np.int32)
    max_logprobs = -1  # -1: no row wants logprobs
    for i, (index, seq) in enumerate(rows):
        sp_ = seq.sampling_params
        logits_indices[i] = index
        temperature[i], top_k[i], top_p[i], min_p[i] = sp_.temperature, sp_.top_k, sp_.top_p, sp_.min_p
        seeds[i] = (sp_.seed or 0) & 0xFFFFFFFF
        forks[i] = seq.fork_index
        sample_pos[i] = positions[index] + 1  # forks sampled at a prompt's end share it
        if sp_.logprobs is not None:
            max_logprobs = max(max_logprobs, sp_.logprobs)
    if not rows or np.all(temperature[:len(rows)] == 0):
        mode = GREEDY
    elif np.any(top_k[:len(rows)] > 0) or np.any(top_p[:len(rows)] < 1) or np.any(min_p[:len(rows)] > 0):
        mode = FILTERED
    else:
        mode = RANDOM
    batch = StepBatch(
        token_ids=token_ids,
        feed_rows=feed_rows,
        attn=AttentionMetadata(positions=positions, slot_mapping=slots, page_tables=page_tables,
                               seq_lens=seq_lens, query_start=query_start, token_row=token_row,
                               num_decode=sd, query_block=qb),
        logits_indices=logits_indices,
        sampling=SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
            forks=forks, positions=sample_pos, mode=mode,
            num_top_logprobs=-1 if max_logprobs < 0 else Buckets.fit(buckets.logprobs,
                                                                     max_logprobs)),
        prompt_targets=prompt_targets,
        prompt_logprobs=-1 if prompt_k < 0 else Buckets.fit((0,) + buckets.logprobs, prompt_k))
    return batch, len(rows), offsets


def page_copies(copies: list[tuple[int, int]], buckets: Buckets) -> tuple[np.ndarray, np.ndarray]:
    """Copy-on-write (src, dst) pairs -> i32 src, dst arrays padded to a copies bucket with
    page 0 -> page 0 (a no-op on the scratch page)."""
    n = Buckets.fit(buckets.copies, len(copies))
    src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for i, (a, b) in enumerate(copies):
        src[i], dst[i] = a, b
    return src, dst
