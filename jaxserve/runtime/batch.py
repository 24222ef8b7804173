"""StepPlan -> StepBatch: fixed-shape numpy arrays padded to a small set of buckets.

This is the only place host plans become arrays; the runner moves them to the device. Layout of
the T flat tokens: Sd decode rows (one token each, padded to a bucket), then the prefill chunks,
each starting at a multiple of `query_block` (1 packs them back to back), padded to a token
bucket. Padded tokens write to scratch page 0. With `Buckets.packed` (an attention backend that
treats every row alike, "cpu"), decode rows are not split out (Sd = 0): every chunk is packed
back to back and only the total is padded, so a step of 141 decode rows and 883 prompt tokens is
1024 tokens, not 256 + 1024; its rows are then padded to the bucket that the token bucket implies
(Buckets.packed_rows), so each token bucket is one step shape, all of which warm-up compiles.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxserve.core.sampling_params import SamplingParams, seed_words
from jaxserve.core.sequence import Request, Sequence
from jaxserve.core.step_plan import ScheduledChunk, StepPlan
from jaxserve.model.attention import AttentionMetadata
from jaxserve.pytree import pytree_dataclass, static_field
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.logit_controls import MIN_ENTRIES, no_controls
from jaxserve.runtime.sampling import FILTERED, GREEDY, RANDOM, SamplingMetadata


@pytree_dataclass
class StepBatch:
    token_ids: jax.Array  # i32[T]
    feed_rows: jax.Array  # i32[T] >= 0: the token is the previous step's sample at this row
    attn: AttentionMetadata
    logits_indices: jax.Array  # i32[R] flat token whose logits each sample row reads
    sampling: SamplingMetadata
    prompt_targets: jax.Array  # i32[T] next prompt token after each token (for prompt logprobs)
    prompt_logprobs: int = static_field()  # -1: none; k >= 0: return prompt logprobs and top k
    lora_slots: jax.Array | None = None  # i32[T] each token's LoRA adapter slot (Buckets.lora)


def build_batch(plan: StepPlan, buckets: Buckets, page_size: int,
                verifying: bool | None = None) -> tuple[StepBatch, int, list[int]]:
    """Returns the padded batch, the number of real sample rows (the first rows of R), and the
    flat index of each chunk's first token (in plan.chunks order). A step that verifies
    speculative drafts has more sample rows (`verifying`: whether the plan does, unless given,
    as warm-up does to compile that variant)."""
    decode = [] if buckets.packed else [c for c in plan.chunks if c.is_decode]
    prefill = plan.chunks[len(decode):]
    assert all(not c.is_decode for c in prefill) or buckets.packed, \
        "decode chunks must come first in the plan"
    sd = Buckets.fit(buckets.seqs, len(decode))
    sp = Buckets.fit(buckets.seqs, len(prefill))
    qb = buckets.query_block
    prefill_tokens = Buckets.fit(buckets.tokens, sum(-(-c.num_tokens // qb) * qb for c in prefill))
    if buckets.packed:  # rows follow the token bucket: one step shape per token bucket
        sp = max(sp, buckets.packed_rows(prefill_tokens))
    num_rows = sd + sp
    # Layer groups (core/kv_groups.py): a table and slot mapping per group, group 0's also
    # as the plain ones; a model of one group gets no more.
    groups = max((1 + len(c.seq.group_page_ids) for c in plan.chunks), default=1)
    width = buckets.pages
    t = sd + prefill_tokens
    token_ids = np.zeros(t, np.int32)
    feed_rows = np.full(t, -1, np.int32)
    positions = np.zeros(t, np.int32)
    token_row = np.full(t, num_rows, np.int32)
    group_tables = np.zeros((groups, num_rows, width), np.int32)
    group_slots = np.tile(np.arange(t, dtype=np.int32) % page_size, (groups, 1))
    seq_lens = np.zeros(num_rows, np.int32)
    query_start = np.zeros(num_rows + 1, np.int32)
    prompt_targets = np.zeros(t, np.int32)
    lora_slots = np.zeros(t, np.int32) if buckets.lora else None  # padding: slot 0, the base
    prompt_k = -1
    rows = []  # (flat index of the token whose logits are sampled, sequence)
    offsets = []

    def place(row: int, chunk, first: int):
        seq, n, start = chunk.seq, chunk.num_tokens, chunk.start
        end = start + n
        offsets.append(first)
        if seq.is_finished:  # failed after planning (StepPipeline._launch): a padding row
            rows.extend((first + n - 1, None) for _ in chunk.sample_rows)
            return
        pos = np.arange(start, end, dtype=np.int32)
        for g, table in enumerate([seq.page_ids, *seq.group_page_ids]):
            pages = np.asarray(table[:math.ceil(end / page_size)], np.int32)
            group_tables[g, row, :len(pages)] = pages
            group_slots[g, first:first + n] = pages[pos // page_size] * page_size \
                + pos % page_size
        seq_lens[row] = end
        if chunk.feed_row >= 0:  # a decode of the token the step in flight samples
            feed_rows[first] = chunk.feed_row
        else:
            token_ids[first:first + n] = chunk.input_token_ids
        positions[first:first + n] = pos
        token_row[first:first + n] = row
        if lora_slots is not None:
            lora_slots[first:first + n] = chunk.lora_slot
        nonlocal prompt_k
        wanted = seq.sampling_params.prompt_logprobs
        if wanted is not None and start < seq.num_prompt_tokens:
            prompt_k = max(prompt_k, wanted)
            targets = seq.token_ids[start + 1:min(end + 1, seq.num_prompt_tokens)]
            prompt_targets[first:first + len(targets)] = targets
        rows.extend((first + offset, s) for offset, s in chunk.sample_rows)

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

    # Decode rows sample once each; sizing R from the step's shape adds no compile dimension.
    if verifying is None:
        verifying = any(c.draft_token_ids for c in prefill)
    r = sd + buckets.prefill_sample_rows(sp, prefill_tokens, len(rows) - len(decode), verifying)
    logits_indices = np.zeros(r, np.int32)
    temperature = np.zeros(r, np.float32)
    top_k = np.zeros(r, np.int32)
    top_p = np.ones(r, np.float32)
    min_p = np.zeros(r, np.float32)
    seeds = np.zeros((r, 2), np.uint32)
    forks = np.zeros(r, np.int32)
    sample_pos = np.zeros(r, np.int32)
    max_logprobs = -1  # -1: no row wants logprobs
    for i, (index, seq) in enumerate(rows):
        logits_indices[i] = index
        if seq is None:
            continue  # a padding row's sample: greedy, dropped
        sp_ = seq.sampling_params
        temperature[i], top_k[i], top_p[i], min_p[i] = sp_.temperature, sp_.top_k, sp_.top_p, sp_.min_p
        seeds[i] = seed_words(sp_.seed or 0)
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
        attn=AttentionMetadata(positions=positions, slot_mapping=group_slots[0],
                               page_tables=group_tables[0], seq_lens=seq_lens,
                               query_start=query_start, token_row=token_row, num_decode=sd,
                               query_block=qb,
                               group_page_tables=group_tables if groups > 1 else None,
                               group_slot_mapping=group_slots if groups > 1 else None),
        logits_indices=logits_indices,
        sampling=SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
            forks=forks, positions=sample_pos, mode=mode,
            num_top_logprobs=-1 if max_logprobs < 0 else Buckets.fit(buckets.logprobs,
                                                                     max_logprobs)),
        prompt_targets=prompt_targets,
        prompt_logprobs=-1 if prompt_k < 0 else Buckets.fit((0,) + buckets.logprobs, prompt_k),
        lora_slots=lora_slots)
    return batch, len(rows), offsets


def page_copies(copies: list[tuple[int, int]], buckets: Buckets) -> tuple[np.ndarray, np.ndarray]:
    """Copy-on-write (src, dst) pairs -> i32 src, dst arrays padded to a copies bucket with
    page 0 -> page 0 (a no-op on the scratch page)."""
    n = Buckets.fit(buckets.copies, len(copies))
    src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for i, (a, b) in enumerate(copies):
        src[i], dst[i] = a, b
    return src, dst


def warmup_plan(shape: tuple[int, int, int], buckets: Buckets, page_size: int,
                prompt_logprobs: int | None = None, num_groups: int = 1) -> StepPlan:
    """A plan of the step shape (Sd, prefill tokens, prefill rows) from Buckets.step_shapes, of
    greedy dummy sequences that read and write only the scratch page 0 (scoring their prompts
    with prompt_logprobs, if given), with a page table per layer group."""
    sd, prefill_tokens, sp = shape
    qb = buckets.query_block
    max_chunk = buckets.pages * page_size
    max_units = -(-max_chunk // qb)
    dummy = Request("warmup", [0], SamplingParams(temperature=0, prompt_logprobs=prompt_logprobs))

    def seq(num_tokens: int) -> Sequence:
        return Sequence(-1, dummy, [0] * num_tokens, 1, page_ids=[0] * buckets.pages,
                        group_page_ids=[[0] * buckets.pages] * (num_groups - 1))

    plan = StepPlan()
    for _ in range(sd):
        s = seq(2)
        plan.chunks.append(ScheduledChunk(s, 1, 1, [s]))
    units = min(prefill_tokens // qb, sp * max_units)  # past the previous bucket, within this one
    r = min(sp, units)  # rows (each at least one block) that pad to sp
    for i in range(r):
        n = min((units // r + (i < units % r)) * qb, max_chunk)  # pads to those blocks
        s = seq(n)
        plan.chunks.append(ScheduledChunk(s, 0, n, [s]))
    return plan


def warmup_batches(buckets: Buckets, page_size: int, full: bool = False, num_groups: int = 1):
    """(batch, rows) of each step shape of Buckets.step_shapes that warm-up compiles, on dummy
    plans that use only the scratch page 0. With speculative decoding, a step that verifies
    drafts samples more rows: a variant of the shape wherever that changes its sample rows."""
    for shape in buckets.step_shapes(page_size, full):
        plan = warmup_plan(shape, buckets, page_size, num_groups=num_groups)
        sizes = set()
        for verifying in (False, True) if buckets.spec_tokens else (False,):
            batch, rows, _ = build_batch(plan, buckets, page_size, verifying=verifying)
            r = batch.logits_indices.shape[0]
            if r not in sizes:
                sizes.add(r)
                yield batch, rows


def warmup_samplings(sampling: SamplingMetadata, rows: int, buckets: Buckets, vocab_size: int,
                     full: bool = False):
    """(what, sampling, controls) of each sampling call warm-up compiles for a step of `rows`
    sample rows: each sampling mode, without logit controls and with masks only (structured
    outputs). With full, also each top-logprobs bucket and penalties / logit_bias of the first
    entry bucket, which otherwise compile on first use, inside a step: one to three seconds on
    a CPU with every stream waiting (larger entry buckets still do)."""
    controls_of = {"": None, ", logit controls": no_controls(rows, vocab_size)}
    top_counts = (sampling.num_top_logprobs,)
    if full:
        controls_of[", penalties or logit_bias"] = no_controls(rows, vocab_size, MIN_ENTRIES)
        top_counts += tuple(k for k in (0,) + buckets.logprobs if k not in top_counts)
    for top in top_counts:
        for named, controls in controls_of.items():
            for mode in (GREEDY, RANDOM, FILTERED):
                what = f"sampling of {rows} rows, mode {mode}{named}" + (
                    f", top {top} logprobs" if top >= 0 else "")
                yield (what, dataclasses.replace(sampling, mode=mode, num_top_logprobs=top),
                       controls)
