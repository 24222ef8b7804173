"""KVManager: the page tables of sequences, on top of a PagePool and an optional PrefixCache.

It attaches prefix-cache hits at admission, allocates pages before a chunk writes, copies shared
pages before they are written (copy-on-write), forks sequences, registers pages in the prefix cache
once they are full of computed tokens, and drops a sequence's references when it finishes, is
aborted or is preempted. Plain Python, no JAX.

Full-prompt hits: a prefix hit never covers the whole token list; the last token must be computed to
have logits to sample. The hit is truncated to the page boundary at or below num_tokens - 1, so a
fully cached prompt whose length is a multiple of page_size recomputes its last page into a fresh
page (at most page_size tokens) instead of writing into a shared cached page; no copy is needed.

Sliding windows: for a model whose every layer attends only the last `window` positions, a page
whose slots all lie before the window of the sequence's next token is never read again. It is
released as the sequence grows: its page-table entry becomes the scratch page 0 (the attention
skips or masks it), its reference is dropped (a prefix-cache page stays findable for other
requests), and it is gone for this sequence: released entries are only ever a leading run of
the table. Preemption recomputes from token 0 as before. So a sequence holds about
window + chunk tokens of pages, however long it grows.
"""

from __future__ import annotations

import math

from jaxserve.core.page_pool import PagePool
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.sequence import Sequence


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: PrefixCache | None = None,
                 window: int | None = None):
        self.pool = pool
        self.page_size = page_size
        self.cache = cache
        self.window = window  # ModelConfig.kv_window: None unless every layer is windowed
        self._keys: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading full computed pages
        self.peak_referenced_pages = 0
        self._salt: dict[int, str | None] = {}

    # ---- sizing ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def pages_to_hold(self, num_tokens: int, chunk: int) -> int:
        """The most pages a sequence of num_tokens holds at once, computed in chunks of at most
        `chunk` tokens: all of them, or with a window the pages of window - 1 keys and a chunk
        (one more where they straddle a page boundary)."""
        if self.window is None:
            return self.pages_for(num_tokens)
        return min(self.pages_for(num_tokens), self.pages_for(self.window - 1 + chunk) + 1)

    def release_outside_window(self, seq: Sequence, position: int) -> None:
        """Release seq's pages whose slots all lie before the window of a query at `position`
        (and so of every later one): see the module docstring. A step still in flight that may
        read them holds them (the pool defers their reuse)."""
        if self.window is None:
            return
        num_outside = min(len(seq.page_ids), max(0, position - self.window + 1) // self.page_size)
        for i in range(num_outside):
            if seq.page_ids[i]:
                self.pool.decref(seq.page_ids[i])
                seq.page_ids[i] = 0

    def _shared_pages_in(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Indices of existing pages of seq overlapping slots [start, end) with refcount > 1."""
        b = self.page_size
        last = min(len(seq.page_ids), self.pages_for(end))
        return [i for i in range(start // b, last) if self.pool.refcount(seq.page_ids[i]) > 1]

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages to write seq.token_ids[num_computed : num_computed + num_tokens]: growth plus
        copy-on-write copies of shared pages in that range."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        grow = max(0, self.pages_for(end) - len(seq.page_ids))
        return grow + len(self._shared_pages_in(seq, start, end))

    # ---- admission ------------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence, salt: str | None) -> tuple[list[int], list[bytes]]:
        """Cached pages for the head of seq.token_ids, never covering its last token. Requests that
        score their prompt (prompt_logprobs) compute every prompt token, so they take no hits."""
        if self.cache is None or seq.sampling_params.prompt_logprobs is not None:
            return [], []
        max_pages = (seq.num_tokens - 1) // self.page_size
        return self.cache.lookup(seq.token_ids, salt, max_pages=max_pages)

    def admit(self, seq: Sequence, salt: str | None, hit: tuple[list[int], list[bytes]] = ([], [])):
        """Start a page table for a sequence with no pages, attaching prefix-hit pages (refcount++)."""
        if seq.page_ids or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already holds pages")
        pages, keys = hit
        for page in pages:
            self.pool.incref(page)
        seq.page_ids = list(pages)
        seq.num_computed_tokens = len(pages) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self._keys[seq.seq_id] = list(keys)
        self._salt[seq.seq_id] = salt

    # ---- writing ----------------------------------------------------------------------------------
    def prepare_write(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> None:
        """Make seq's pages writable for its next num_tokens tokens: allocate the growth and replace
        every shared page in range by a private copy, recording (src, dst) in `copies`.
        All or nothing: raises OutOfPages and changes nothing if the pages cannot be had."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        shared = self._shared_pages_in(seq, start, end)
        grow = max(0, self.pages_for(end) - len(seq.page_ids))
        fresh = self.pool.allocate(grow + len(shared))
        for i, dst in zip(shared, fresh):
            src = seq.page_ids[i]
            copies.append((src, dst))
            seq.page_ids[i] = dst
            self.pool.decref(src)
        seq.page_ids.extend(fresh[len(shared):])
        self.release_outside_window(seq, start)

    def prepare_slots(self, slots: list[tuple[Sequence, int]]) -> bool:
        """Make slot `position` of each (seq, position) writable, where seq's pages already cover
        every slot before it: a fresh page at a page boundary. All or nothing: False, changing
        nothing, when a slot's page is shared (it would need a copy) or the pool lacks pages."""
        if any(self._shared_pages_in(seq, position, position + 1) for seq, position in slots):
            return False
        grow = [seq for seq, position in slots if self.pages_for(position + 1) > len(seq.page_ids)]
        if len(grow) > self.pool.num_available:
            return False
        for seq, page in zip(grow, self.pool.allocate(len(grow))):
            seq.page_ids.append(page)
        for seq, position in slots:
            self.release_outside_window(seq, position)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every page of parent (refcount++); writes later copy-on-write."""
        if child.page_ids:
            raise ValueError(f"fork target {child.seq_id} already holds pages")
        for page in parent.page_ids:
            if page:  # 0: released (outside the window)
                self.pool.incref(page)
        child.page_ids = list(parent.page_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))
        self._salt[child.seq_id] = self._salt.get(parent.seq_id)

    def register_full_pages(self, seq: Sequence) -> int:
        """Key seq's pages that are full of computed tokens and offer them to the prefix cache.
        Returns how many pages were newly inserted."""
        if self.cache is None:
            return 0
        keys = self._keys.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.page_size
        if num_full <= len(keys):
            return 0
        salt = self._salt.get(seq.seq_id)
        parent = keys[-1] if keys else None
        new_keys = self.cache.chain_keys(seq.token_ids, salt, num_full, parent, first_page=len(keys))
        inserted = 0
        for i, key in enumerate(new_keys, start=len(keys)):
            if seq.page_ids[i]:  # a page released before it was offered stays unoffered
                inserted += self.cache.insert(key, seq.page_ids[i])
        keys.extend(new_keys)
        return inserted

    # ---- release ----------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop all of seq's references (tail first, so its tail pages are evicted first). The caller
        resets num_computed_tokens when the sequence will be recomputed (preemption)."""
        for page in reversed(seq.page_ids):
            if page:
                self.pool.decref(page)
        seq.page_ids = []
        self._keys.pop(seq.seq_id, None)
        self._salt.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop seq's pages past those that hold its first num_tokens slots (speculative
        lookahead that was rolled back); their later slots are rewritten before they are read."""
        keep = self.pages_for(num_tokens)
        for page in reversed(seq.page_ids[keep:]):
            self.pool.decref(page)
        del seq.page_ids[keep:]

    # ---- steps in flight --------------------------------------------------------------------------
    def step_launched(self, step: int) -> None:
        """A plan tagged `step` goes to the device: pages freed from now on wait for it."""
        self.pool.defer_frees(step)

    def steps_applied(self, outstanding: list[int]) -> None:
        """A step's results were applied; `outstanding` are the steps still in flight. Pages freed
        before the oldest of them are free again; later frees wait for the newest."""
        if outstanding:
            self.pool.release_pending(min(outstanding) - 1)
            self.pool.defer_frees(max(outstanding))
        else:
            self.pool.release_pending()
            self.pool.defer_frees(None)
        self.peak_referenced_pages = max(self.peak_referenced_pages, self.pool.num_referenced)

    # ---- introspection ----------------------------------------------------------------------------
    def page_stats(self) -> dict:
        pool = self.pool
        return dict(
            total_pages=pool.num_usable,  # usable pages: the scratch page 0 is excluded
            scratch_pages=1,
            page_size=self.page_size,
            free_pages=pool.num_free + pool.num_pending,
            pending_free_pages=pool.num_pending,
            cached_pages=pool.num_evictable,
            cached_pages_findable=self.cache.num_cached if self.cache else 0,
            referenced_pages=pool.num_referenced,
            evictions=pool.num_evictions,
            peak_referenced_pages=self.peak_referenced_pages)

    def usage(self, live_seqs: list[Sequence]) -> dict:
        """The pool right now, in slots: useful (computed tokens, shared pages counted once), tail
        fragmentation (allocated to live sequences but empty), cached-unreferenced and free
        pages, plus host page-table bytes (4 bytes per entry)."""
        filled: dict[int, int] = {}
        table_entries = 0
        b = self.page_size
        for seq in live_seqs:
            table_entries += len(seq.page_ids)  # released entries too: the table keeps them
            for j, page in enumerate(seq.page_ids):
                if not page:
                    continue
                filled[page] = max(filled.get(page, 0),
                                   min(b, max(0, seq.num_computed_tokens - j * b)))
        useful = sum(filled.values())
        referenced = self.pool.num_referenced
        return {"page_size": b, "referenced_pages": referenced, "useful_slots": useful,
                "fragmented_slots": referenced * b - useful,
                "cached_pages": self.pool.num_evictable,
                "free_pages": self.pool.num_free + self.pool.num_pending,
                "page_table_bytes": 4 * table_entries}

    # ---- checking ---------------------------------------------------------------------------------
    def check(self, live_seqs: list[Sequence]) -> None:
        """Conservation, plus: refcounts equal the number of page-table entries of live sequences,
        so a page appears in two tables only when its refcount says it is shared."""
        self.pool.check()
        if self.cache is not None:
            self.cache.check()
        counts: dict[int, int] = {}
        for seq in live_seqs:
            assert len(seq.page_ids) >= self.pages_for(seq.num_computed_tokens), \
                f"seq {seq.seq_id} computed {seq.num_computed_tokens} tokens in {len(seq.page_ids)} pages"
            pages = seq.page_ids
            released = len(pages) - len([p for p in pages if p])
            assert not any(pages[:released]), \
                f"seq {seq.seq_id}: released pages are not a leading run"
            assert released == 0 or self.window is not None, \
                f"seq {seq.seq_id} has page 0 in its table without a window"
            live = pages[released:]
            assert len(set(live)) == len(live), f"seq {seq.seq_id} repeats a page"
            for page in live:
                counts[page] = counts.get(page, 0) + 1
        assert 0 not in counts, "page 0 is in a page table"
        for page in range(1, self.pool.num_pages):
            assert self.pool.refcount(page) == counts.get(page, 0), (
                f"page {page}: refcount {self.pool.refcount(page)} but {counts.get(page, 0)} table entries")
