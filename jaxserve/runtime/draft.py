"""DraftRunner: the draft model of speculative decoding's "draft" method, on the device.

The draft's KV pool has the draft model's shape and the target's num_pages and page_size, and is
indexed by the same page ids: a sequence's pages hold its draft KV beside its target KV, so one
allocation (lookahead slots included) and one rollback serve both. What the pool holds of each
sequence is the host's record (core/draft_kv.py), which the engine's Speculator keeps and passes
in. `propose` computes what the draft has not seen of each row: a long stretch (a prompt) in
calls of its own, timed apart (`catch_up_seconds`: a prefill, not a cost of the step), then in
one jitted call the last token or two, which give the first draft, and the other k - 1 greedy
decode steps in a loop on the device, writing draft KV at the lookahead slots.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.core.kv_groups import groups_of
from jaxserve.core.sequence import Sequence
from jaxserve.core.step_plan import ScheduledChunk, StepPlan
from jaxserve.core.structured_output import bitmask_words, fill_masks
from jaxserve.model import llama
from jaxserve.model.attention import AttentionMetadata
from jaxserve.runtime.batch import build_batch, warmup_plan
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.logit_controls import apply_mask
from jaxserve.runtime.runner import ModelRunner


def check_shared_vocabulary(target_cfg: ModelConfig, target_tokenizer, draft_cfg: ModelConfig,
                            draft_tokenizer) -> None:
    """A draft proposes token ids that the target verifies: both must mean the same tokens."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens, the "
                         f"target's {target_cfg.vocab_size}: a draft model must share the "
                         "target's tokenizer")
    vocab = lambda t: t.backend.get_vocab(with_added_tokens=True)  # noqa: E731
    if vocab(draft_tokenizer) != vocab(target_tokenizer):
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the "
                         "target's: a draft model must share the target's tokenizer")


def check_draft_window(target_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    """A target whose every layer is windowed releases the pages before its window (the draft
    pool shares its page ids): the draft must never read them, so it too must attend at most
    that window at every layer. A target of several layer groups (core/kv_groups.py): the draft
    reads group 0's pages (a full group's, never released) with every layer, so it must be a
    model of one full-attention group."""
    target = groups_of(target_cfg)
    if target.num_groups > 1 and (target.windows[0] is not None
                                  or groups_of(draft_cfg).windows != (None,)):
        raise ValueError(f"the target model's layers form {target.num_groups} KV page groups "
                         f"({target.describe()}); a draft model must then attend fully at every "
                         "layer: use the ngram method or a full-attention draft model")
    window = target_cfg.kv_window
    if window is None:
        return
    if draft_cfg.kv_window is None or draft_cfg.kv_window > window:
        raise ValueError(f"the target model attends a sliding window of {window} tokens at "
                         "every layer and releases the KV pages before it; a draft model must "
                         f"then be windowed at every layer by at most {window} (this one: "
                         f"{draft_cfg.kv_window or 'full attention'}): use the target's own "
                         "weights (--speculative_model unset) or the ngram method")


def _argmax(logits, backend: Backend):
    fast = backend.argmax
    return fast(logits)[0] if fast is not None else jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _catch_up(params, pool, token_ids, md: AttentionMetadata, *, cfg: ModelConfig,
              backend: Backend):
    """Draft KV for a batch of chunks, nothing sampled."""
    pool, _ = llama.forward(params, pool, token_ids, md, cfg=cfg, backend=backend)
    return pool


def _propose(params, pool, token_ids, md: AttentionMetadata, logits_indices, num_drafts,
             first_mask, *, cfg: ModelConfig, backend: Backend, max_k: int):
    """One chunk per row ending in the row's last token (its logits at logits_indices i32[R])
    gives each row's first draft, among the tokens first_mask i32[R, ceil(V/32)] allows (a
    grammar's next tokens; all ones for a row without one); then decode steps, all rows at
    once, each feeding the previous draft at the next position, until row r has num_drafts[r]
    (0: a padding row). Returns the pool and the drafts i32[R, max_k] (those past a row's
    num_drafts are meaningless)."""
    pool, hidden = llama.forward(params, pool, token_ids, md, cfg=cfg, backend=backend)
    first = _argmax(apply_mask(llama.logits(params, hidden[logits_indices], cfg), first_mask),
                    backend)
    r = logits_indices.shape[0]
    rows = jnp.arange(r, dtype=jnp.int32)
    last_pos = md.positions[logits_indices]
    tables = md.page_tables[jnp.minimum(md.token_row[logits_indices], md.page_tables.shape[0] - 1)]
    width, page_size = tables.shape[1], pool.layers[0].page_size
    drafts = jnp.zeros((r, max_k), jnp.int32).at[:, 0].set(first)

    def step(i, carry):
        pool, drafts = carry
        live = i < num_drafts  # draft i follows draft i - 1, written at last_pos + i
        pos = last_pos + i
        page = tables[rows, jnp.minimum(pos // page_size, width - 1)]
        step_md = AttentionMetadata(
            positions=jnp.where(live, pos, 0),
            slot_mapping=jnp.where(live, page * page_size + pos % page_size, rows % page_size),
            page_tables=tables, seq_lens=jnp.where(live, pos + 1, 0),
            query_start=jnp.arange(r + 1, dtype=jnp.int32),
            token_row=jnp.where(live, rows, r), num_decode=r, query_block=md.query_block)
        pool, h = llama.forward(params, pool, drafts[:, i - 1], step_md, cfg=cfg,
                                backend=backend)
        return pool, drafts.at[:, i].set(_argmax(llama.logits(params, h, cfg), backend))

    return jax.lax.fori_loop(1, jnp.max(num_drafts), step, (pool, drafts))


@functools.lru_cache(maxsize=None)
def _jitted(cfg: ModelConfig, backend: Backend, max_k: int):
    catch_up = jax.jit(functools.partial(_catch_up, cfg=cfg, backend=backend),
                       donate_argnames=("pool",))
    propose = jax.jit(functools.partial(_propose, cfg=cfg, backend=backend, max_k=max_k),
                      donate_argnames=("pool",))
    return catch_up, propose


def _decode_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    return sorted(chunks, key=lambda c: not c.is_decode)  # stable: build_batch's row order


def _todo(chunk: ScheduledChunk, first: int) -> ScheduledChunk:
    """The chunk a proposal computes for a verification chunk: its sequence's tokens from
    `first` to its last one (sampled there)."""
    return ScheduledChunk(chunk.seq, first, chunk.start + 1 - first, [chunk.seq])


class DraftRunner:
    """The draft model's params and KV pool (in a ModelRunner of its own) and its two jitted
    calls: `propose` and the catch-up of rows too long to compute in one call."""

    def __init__(self, cfg: ModelConfig, params: dict, *, buckets: Buckets,
                 page_size: int, num_pages: int, max_tokens: int, max_k: int, dtype: str,
                 kv_cache_dtype: str, backend: Backend, quantization: str,
                 huge_pages: bool = False,
                 mesh=None):
        """mesh: one device (default the first), where the draft's params and pool live."""
        self.model = ModelRunner(cfg, params, num_pages=num_pages, page_size=page_size,
                                 dtype=dtype, kv_cache_dtype=kv_cache_dtype, backend=backend,
                                 quantization=quantization, max_sample_rows=1,
                                 huge_pages=huge_pages, mesh=mesh)
        self.buckets, self.page_size, self.max_tokens = buckets, page_size, max_tokens
        self._catch_up, self._propose = _jitted(cfg, backend, max_k)
        self._signatures: set = set()
        self.catch_up_seconds = 0.0  # of the latest proposal

    def _all_allowed(self, rows: int) -> np.ndarray:
        return np.full((rows, bitmask_words(self.model.cfg.vocab_size)), -1, np.int32)

    @property
    def compilations(self) -> int:
        return len(self._signatures)

    def reset(self) -> None:
        """A fresh pool (after a failed step), holding nothing of any sequence."""
        self.model.reset_pool()

    def propose(self, rows: list[tuple[ScheduledChunk, int]]
                ) -> list[tuple[ScheduledChunk, list[int]]]:
        """Drafts for verification chunks (num_drafts each), to give their plan
        (StepPlan.with_drafts); each row is a chunk and how many of its sequence's leading
        positions the draft's pool holds already (the host's record, core/draft_kv.py)."""
        self.catch_up_seconds = 0.0
        if not rows:
            return []
        chunks = [c for c, _ in rows]
        firsts = [min(computed, c.start) for c, computed in rows]
        if any(c.start - f > 1 for c, f in zip(chunks, firsts)):
            t0 = time.perf_counter()
            self._catch_up_to([(c.seq, f, c.start) for c, f in zip(chunks, firsts)])
            jax.block_until_ready(self.model.pool)
            self.catch_up_seconds = time.perf_counter() - t0
            firsts = [c.start for c in chunks]
        # Each row's chunk: what the draft has not computed, up to and with the last token.
        pairs = sorted(zip(chunks, firsts), key=lambda p: not _todo(*p).is_decode)
        chunks = [c for c, _ in pairs]
        todo = [_todo(c, f) for c, f in pairs]
        batch, num_rows, offsets = build_batch(StepPlan(chunks=todo), self.buckets,
                                               self.page_size)
        tables = batch.attn.page_tables
        for chunk, first in zip(todo, offsets):  # the lookahead pages too
            pages = chunk.seq.page_ids
            tables[batch.attn.token_row[first], :len(pages)] = pages
        num_drafts = np.zeros(batch.logits_indices.shape[0], np.int32)
        num_drafts[:num_rows] = [c.num_drafts for c in chunks]
        # A grammar's row drafts its first token among those the grammar allows next (the
        # later drafts follow the draft model alone: the verification's masks check them).
        first_mask = self._all_allowed(num_drafts.shape[0])
        try:
            fill_masks([(i, c.seq, []) for i, c in enumerate(chunks)
                        if c.seq.request.grammar is not None], first_mask)
        except ValueError:  # a broken matcher: the step's own masks fail its request alone
            first_mask = self._all_allowed(num_drafts.shape[0])
        self._signatures.add(("propose", batch.token_ids.shape[0], num_drafts.shape[0]))
        self.model.pool, drafts = self._propose(self.model.params, pool=self.model.pool,
                                                token_ids=batch.token_ids, md=batch.attn,
                                                logits_indices=batch.logits_indices,
                                                num_drafts=num_drafts, first_mask=first_mask)
        drafts = np.asarray(jax.device_get(drafts))
        return [(chunk, drafts[i, :chunk.num_drafts].tolist()) for i, chunk in enumerate(chunks)]

    def _catch_up_to(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """Draft KV for each row's tokens [first, end), in calls of at most max_tokens tokens."""
        done = {seq.seq_id: first for seq, first, _ in rows}
        while True:
            chunks, room = [], self.max_tokens
            for seq, _, end in rows:
                n = min(end - done[seq.seq_id], room)
                if n > 0:
                    chunks.append(ScheduledChunk(seq, done[seq.seq_id], n, [seq]))
                    done[seq.seq_id] += n
                    room -= n
            if not chunks:
                return
            batch, _, _ = build_batch(StepPlan(chunks=_decode_first(chunks)), self.buckets,
                                      self.page_size)
            self._signatures.add(("catch_up", batch.token_ids.shape[0],
                                  batch.attn.page_tables.shape[0]))
            self.model.pool = self._catch_up(self.model.params, pool=self.model.pool,
                                             token_ids=batch.token_ids, md=batch.attn)

    def warmup(self) -> int:
        """Compile the catch-up for every step shape of the buckets, and `propose` for those
        a proposal takes (packed: at most two tokens a row), on dummy rows of the scratch page
        0 that draft nothing. Returns how many shapes were run."""
        run = 0
        for shape in self.buckets.step_shapes(self.page_size):
            batch, _, _ = build_batch(warmup_plan(shape, self.buckets, self.page_size),
                                      self.buckets, self.page_size)
            rows = batch.logits_indices.shape[0]
            tokens = batch.token_ids.shape[0]
            self._signatures.add(("catch_up", tokens, batch.attn.page_tables.shape[0]))
            self.model.pool = self._catch_up(self.model.params, pool=self.model.pool,
                                             token_ids=batch.token_ids, md=batch.attn)
            run += 1
            if self.buckets.packed and tokens > 2 * self.buckets.seqs[-1]:
                continue
            self._signatures.add(("propose", tokens, rows))
            self.model.pool, _ = self._propose(
                self.model.params, pool=self.model.pool, token_ids=batch.token_ids,
                md=batch.attn, logits_indices=batch.logits_indices,
                num_drafts=np.zeros(rows, np.int32), first_mask=self._all_allowed(rows))
            run += 1
        jax.block_until_ready(self.model.pool)
        return run
