"""Logit controls on device: structured outputs' token bitmasks, logit_bias, and presence,
frequency and repetition penalties, applied to a step's logits before sampling.

They apply in the step's sampling call (runner.sample_rows, a small jitted call chained after
the model step on the device), and only in steps that hold a controlled row: a step without one
samples as before, and the model step's compiled shapes do not multiply. Rows without controls
get their logits back bitwise (+0 bias, -0 penalties, / 1, an all-ones mask), so their tokens do
not change; a controlled row's logprobs are of its controlled distribution. The sampling call's
shapes: the sample-row buckets times a few entry buckets (H below); warm-up compiles H = 0 (masks
only) in every sampling mode, the others compile on first use (about a second each).

Penalty counts are kept fixed-shape as H (row, token) entries, one per distinct token of a
penalised row's prompt and output and per logit_bias entry, padded to a power-of-4 bucket:
the dense [R, V] counts are scattered from them on the device.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.structured_output import bitmask_words, fill_masks
from jaxserve.pytree import pytree_dataclass

MIN_ENTRIES = 16  # entry buckets: 0 (masks only), 16, 64, 256, ... (powers of 4)


@pytree_dataclass
class LogitControls:
    mask: jax.Array  # i32[R, ceil(V/32)]: bit t % 32 of word t // 32 set = token t allowed
    entry_rows: jax.Array  # i32[H] sample row of each entry; padding: R (dropped)
    entry_tokens: jax.Array  # i32[H]
    output_counts: jax.Array  # f32[H] times the token is in the row's output so far
    seen: jax.Array  # f32[H] 1 where the token is in the row's prompt or output
    bias: jax.Array  # f32[H] the row's logit_bias for the token
    presence: jax.Array  # f32[R] presence_penalty; 0 = off
    frequency: jax.Array  # f32[R] frequency_penalty; 0 = off
    repetition: jax.Array  # f32[R] repetition_penalty; 1 = off


def apply_controls(logits, c: LogitControls):
    """logits f32[R, V] -> the controlled logits: repetition penalty (on tokens seen in the
    prompt or output), frequency and presence penalties (output counts), logit_bias, then the
    bitmask (disallowed tokens to -inf)."""
    r, v = logits.shape

    def dense(values):
        return jnp.zeros((r, v), jnp.float32).at[c.entry_rows, c.entry_tokens].add(
            values, mode="drop")

    if c.entry_rows.shape[0]:  # no entries (masks only): no [R, V] scatters
        counts, seen = dense(c.output_counts), dense(c.seen) > 0
        rep = c.repetition[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - c.frequency[:, None] * counts - c.presence[:, None] * (counts > 0)
        logits = logits + dense(c.bias)
    return apply_mask(logits, c.mask)


def apply_mask(logits, mask):
    """logits f32[R, V], mask i32[R, ceil(V/32)] (bit t % 32 of word t // 32: token t allowed)
    -> the logits with disallowed tokens at -inf."""
    r, v = logits.shape
    # Bits unpacked by a broadcast shift (a gather of words per token is slower on CPUs).
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(r, -1)[:, :v]
    return jnp.where(allowed != 0, logits, -jnp.inf)


def entries_bucket(n: int) -> int:
    if n == 0:
        return 0
    h = MIN_ENTRIES
    while h < n:
        h *= 4
    return h


def build_controls(seqs: list, num_rows: int, vocab_size: int,
                   drafts: dict[int, list[int]] | None = None) -> LogitControls | None:
    """Host arrays of the controls of a step's sample rows (`seqs`: the sequence sampled at each
    row, None for padding), padded to num_rows (the batch's R); None when no row has any.
    drafts: {first row of a verification: its drafts}; its rows row + 1 .. row + len(drafts)
    sample after each draft, and a grammar's masks there follow the drafts (fill_masks)."""
    live = [(row, s) for row, s in enumerate(seqs)
            if s is not None and not s.is_finished and s.sampling_params.has_logit_controls]
    if not live:
        return None
    mask = np.full((num_rows, bitmask_words(vocab_size)), -1, np.int32)
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    entries: dict[tuple[int, int], list[float]] = {}  # (row, token) -> [count, seen, bias]
    for row, seq in live:
        p = seq.sampling_params
        if p.has_penalties:
            presence[row], frequency[row] = p.presence_penalty, p.frequency_penalty
            repetition[row] = p.repetition_penalty
            for token, count in Counter(seq.output_token_ids).items():
                entries[(row, token)] = [count, 1.0, 0.0]
            if p.repetition_penalty != 1:
                for token in set(seq.token_ids[:seq.num_prompt_tokens]):
                    entries.setdefault((row, token), [0, 1.0, 0.0])
        for token, b in (p.logit_bias or {}).items():
            entries.setdefault((row, token), [0, 0.0, 0.0])[2] = b
    drafts = drafts or {}
    after_drafts = {row + i for row, d in drafts.items() for i in range(1, len(d) + 1)}
    fill_masks([(row, s, drafts.get(row, [])) for row, s in live
                if s.request.grammar is not None and row not in after_drafts], mask)
    h = entries_bucket(len(entries))
    rows, tokens = np.full(h, num_rows, np.int32), np.zeros(h, np.int32)
    values = np.zeros((3, h), np.float32)
    for i, ((row, token), vals) in enumerate(entries.items()):
        rows[i], tokens[i], values[:, i] = row, token, vals
    return LogitControls(mask=mask, entry_rows=rows, entry_tokens=tokens,
                         output_counts=values[0], seen=values[1], bias=values[2],
                         presence=presence, frequency=frequency, repetition=repetition)


def step_controls(plan, num_rows: int, vocab_size: int) -> LogitControls | None:
    """build_controls for a StepPlan's sample rows (a finished sequence's rows as padding)."""
    seqs, drafts = [], {}
    for chunk in plan.chunks:
        if chunk.draft_token_ids:
            drafts[len(seqs)] = chunk.draft_token_ids
        seqs += [None if chunk.seq.is_finished else seq for _, seq in chunk.sample_rows]
    return build_controls(seqs, num_rows, vocab_size, drafts)


def no_controls(num_rows: int, vocab_size: int, h: int = 0) -> LogitControls:
    """Controls that change nothing, with h entries (warm-up compiles these)."""
    zeros = np.zeros(h, np.float32)
    return LogitControls(mask=np.full((num_rows, bitmask_words(vocab_size)), -1, np.int32),
                         entry_rows=np.full(h, num_rows, np.int32),
                         entry_tokens=np.zeros(h, np.int32), output_counts=zeros, seen=zeros,
                         bias=zeros, presence=np.zeros(num_rows, np.float32),
                         frequency=np.zeros(num_rows, np.float32),
                         repetition=np.ones(num_rows, np.float32))
