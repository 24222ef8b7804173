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

Layer groups (core/kv_groups.py): a model whose layers are of several kinds (Gemma 2/3's
local and global layers, Qwen2's from max_window_layers on) has one page table per group and
sequence (Sequence.page_ids for group 0, Sequence.group_page_ids for the others), all drawing
on the one pool. Each table grows alike; a sliding group's releases its pages before its
window as above, a full group's keeps them. Every count (pages needed, to hold, to admit) sums
the groups. A prefix-cache key of group g's page is the token chain's key tagged with g
(PrefixCache.group_key), and a hit of h pages needs every full group's pages 0..h-1 and each
sliding group's pages from the first one the query at position h * page_size reads (its last
window); pages before that are attached as released. find_prefix takes the longest such h
(vLLM intersects its groups' hits the same way). A model of one kind is one group, found and
kept exactly as before.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from jaxserve.core.page_pool import OutOfPages, PagePool
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.sequence import Sequence


class PrefixHit(NamedTuple):
    """Cached pages for the head of a prompt: group 0's, the chain keys of those pages, and
    the other groups' tables (a sliding group's pages before the hit's last window are 0)."""

    pages: list[int]
    keys: list[bytes]
    group_pages: tuple = ()

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def all_pages(self) -> list[int]:
        return [p for table in (self.pages, *self.group_pages) for p in table if p]


NO_HIT = PrefixHit([], [])


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: PrefixCache | None = None,
                 group_windows: tuple = (None,)):
        """group_windows: each layer group's window (None: full attention;
        kv_groups.KVGroups.windows); a model of one kind is one group: (None,) or (W,)."""
        if not group_windows:
            raise ValueError("group_windows: one window (or None) per layer group, at least one")
        self.pool = pool
        self.page_size = page_size
        self.cache = cache
        self.windows = tuple(group_windows)
        self._keys: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading full computed pages
        self.peak_referenced_pages = 0
        self._salt: dict[int, str | None] = {}

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's page tables, one per group (group 0's is seq.page_ids)."""
        return [seq.page_ids, *seq.group_page_ids]

    # ---- sizing ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def pages_to_hold(self, num_tokens: int, chunk: int) -> int:
        """The most pages a sequence of num_tokens holds at once, computed in chunks of at most
        `chunk` tokens, summed over the groups: all of them, or with a window the pages of
        window - 1 keys and a chunk (one more where they straddle a page boundary)."""
        n = self.pages_for(num_tokens)
        return sum(n if w is None else min(n, self.pages_for(w - 1 + chunk) + 1)
                   for w in self.windows)

    def release_outside_window(self, seq: Sequence, position: int) -> None:
        """Release seq's pages whose slots all lie before the window of a query at `position`
        (and so of every later one) in each sliding group: see the module docstring. A step
        still in flight that may read them holds them (the pool defers their reuse)."""
        for window, table in zip(self.windows, self.tables(seq)):
            if window is None:
                continue
            num_outside = min(len(table), max(0, position - window + 1) // self.page_size)
            for i in range(num_outside):
                if table[i]:
                    self.pool.decref(table[i])
                    table[i] = 0

    def _shared_pages_in(self, table: list[int], start: int, end: int) -> list[int]:
        """Indices of a table's pages overlapping slots [start, end) with refcount > 1."""
        b = self.page_size
        last = min(len(table), self.pages_for(end))
        return [i for i in range(start // b, last) if self.pool.refcount(table[i]) > 1]

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages to write seq.token_ids[num_computed : num_computed + num_tokens]: growth plus
        copy-on-write copies of shared pages in that range, over every group."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        return sum(max(0, self.pages_for(end) - len(table))
                   + len(self._shared_pages_in(table, start, end)) for table in self.tables(seq))

    def admission_pages(self, hit: PrefixHit, num_tokens: int) -> tuple[int, int]:
        """(pages to allocate, pages available for them) to admit a sequence with `hit` and
        compute up to token num_tokens: growth in every group, against free and evictable pages
        less the evictable ones the hit itself revives."""
        need = self.num_groups * (self.pages_for(num_tokens) - hit.num_pages)
        revived = sum(self.pool.is_evictable(p) for p in hit.all_pages())
        return need, self.pool.num_available - revived

    def tokens_fitting(self, seq: Sequence) -> int:
        """The end of the longest chunk whose new pages are available now (no copies counted):
        each page of growth costs one page per group."""
        grow = self.pool.num_available // self.num_groups
        return (len(seq.page_ids) + grow) * self.page_size

    # ---- admission ------------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence, salt: str | None) -> PrefixHit:
        """Cached pages for the head of seq.token_ids, never covering its last token. Requests that
        score their prompt (prompt_logprobs) or skip reading the cache compute every prompt
        token, so they take no hits."""
        params = seq.sampling_params
        if self.cache is None or params.prompt_logprobs is not None \
                or params.skip_reading_prefix_cache:
            return NO_HIT
        max_pages = (seq.num_tokens - 1) // self.page_size
        if self.num_groups == 1:
            return PrefixHit(*self.cache.lookup(seq.token_ids, salt, max_pages=max_pages))
        keys = self.cache.chain_keys(seq.token_ids, salt, max_pages)
        found = [[self.cache.page_of(self.cache.group_key(k, g)) for k in keys]
                 for g in range(self.num_groups)]
        # runs[g][i]: group g's cached pages in a row ending at page i, so a candidate h costs
        # one look per group (a long prompt without hits is not quadratic).
        runs = [list(itertools.accumulate(pages, lambda n, p: 0 if p is None else n + 1,
                                          initial=0))[1:] for pages in found]
        for h in range(len(keys), 0, -1):
            firsts = [0 if w is None else max(0, h * self.page_size - w + 1) // self.page_size
                      for w in self.windows]
            if all(run[h - 1] >= h - first for run, first in zip(runs, firsts)):
                tables = [[0] * first + pages[first:h] for pages, first in zip(found, firsts)]
                return PrefixHit(tables[0], keys[:h], tuple(tables[1:]))
        return NO_HIT

    def admit(self, seq: Sequence, salt: str | None, hit: PrefixHit | tuple = NO_HIT):
        """Start a page table for a sequence with no pages, attaching prefix-hit pages (refcount++)."""
        if seq.page_ids or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already holds pages")
        hit = PrefixHit(*hit)
        tables = [list(hit.pages), *map(list, hit.group_pages)]
        tables += [[] for _ in range(self.num_groups - len(tables))]
        for table in tables:
            for page in table:
                if page:
                    self.pool.incref(page)
        seq.page_ids, seq.group_page_ids = tables[0], tables[1:]
        seq.num_computed_tokens = len(hit.keys) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self._keys[seq.seq_id] = list(hit.keys)
        self._salt[seq.seq_id] = salt

    # ---- writing ----------------------------------------------------------------------------------
    def prepare_write(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> None:
        """Make seq's pages writable for its next num_tokens tokens: allocate the growth and replace
        every shared page in range by a private copy, recording (src, dst) in `copies`, in
        every group. All or nothing: raises OutOfPages and changes nothing if the pages cannot
        be had."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        tables = self.tables(seq)
        shared = [self._shared_pages_in(table, start, end) for table in tables]
        grow = [max(0, self.pages_for(end) - len(table)) for table in tables]
        if sum(grow) + sum(map(len, shared)) > self.pool.num_available:
            raise OutOfPages(f"need {sum(grow) + sum(map(len, shared))} pages, "
                             f"{self.pool.num_available} available")
        for g, table in enumerate(tables):
            fresh = self.pool.allocate(grow[g] + len(shared[g]))
            for i, dst in zip(shared[g], fresh):
                src = table[i]
                copies.append((src, dst))
                table[i] = dst
                self.pool.decref(src)
            table.extend(fresh[len(shared[g]):])
        self.release_outside_window(seq, start)

    def prepare_slots(self, slots: list[tuple[Sequence, int]]) -> bool:
        """Make slot `position` of each (seq, position) writable, where seq's pages already cover
        every slot before it: a fresh page at a page boundary, in every group. All or nothing:
        False, changing nothing, when a slot's page is shared (it would need a copy) or the
        pool lacks pages."""
        if any(self._shared_pages_in(table, position, position + 1)
               for seq, position in slots for table in self.tables(seq)):
            return False
        grow = [table for seq, position in slots for table in self.tables(seq)
                if self.pages_for(position + 1) > len(table)]
        if len(grow) > self.pool.num_available:
            return False
        for table in grow:
            table.extend(self.pool.allocate(1))
        for seq, position in slots:
            self.release_outside_window(seq, position)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every page of parent (refcount++), in every group; writes later
        copy-on-write."""
        if child.page_ids:
            raise ValueError(f"fork target {child.seq_id} already holds pages")
        tables = [list(table) for table in self.tables(parent)]
        for page in (p for table in tables for p in table):
            if page:  # 0: released (outside the window)
                self.pool.incref(page)
        child.page_ids, child.group_page_ids = tables[0], tables[1:]
        child.num_computed_tokens = parent.num_computed_tokens
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))
        self._salt[child.seq_id] = self._salt.get(parent.seq_id)

    def register_full_pages(self, seq: Sequence) -> int:
        """Key seq's pages that are full of computed tokens and offer them to the prefix cache,
        each group's under its own key. Returns how many pages were newly inserted."""
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
        for g, table in enumerate(self.tables(seq)):
            for i, key in enumerate(new_keys, start=len(keys)):
                if table[i]:  # a page released before it was offered stays unoffered
                    inserted += self.cache.insert(self.cache.group_key(key, g), table[i])
        keys.extend(new_keys)
        return inserted

    # ---- release ----------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop all of seq's references (tail first, so its tail pages are evicted first). The caller
        resets num_computed_tokens when the sequence will be recomputed (preemption)."""
        for table in self.tables(seq):
            for page in reversed(table):
                if page:
                    self.pool.decref(page)
        # Empty tables, as many as groups: a finished sequence's chunk in a plan still counts them.
        seq.page_ids, seq.group_page_ids = [], [[] for _ in self.windows[1:]]
        self._keys.pop(seq.seq_id, None)
        self._salt.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop seq's pages past those that hold its first num_tokens slots in every group
        (speculative lookahead that was rolled back); their later slots are rewritten before
        they are read."""
        keep = self.pages_for(num_tokens)
        for table in self.tables(seq):
            for page in reversed(table[keep:]):
                if page:
                    self.pool.decref(page)
            del table[keep:]

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
    def referenced_pages_per_group(self, live_seqs: list[Sequence]) -> list[int]:
        """Pages referenced now, per group: those in the live sequences' tables of the group, a
        shared page once (every reference is a table entry: check); one group: the pool's
        count."""
        if self.num_groups == 1:
            return [self.pool.num_referenced]
        held: list[set[int]] = [set() for _ in self.windows]
        for seq in live_seqs:
            for pages, table in zip(held, self.tables(seq)):
                pages.update(table)
        return [len(pages - {0}) for pages in held]

    def page_stats(self, live_seqs: list[Sequence]) -> dict:
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
            referenced_pages_per_group=self.referenced_pages_per_group(live_seqs),
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
            for table in self.tables(seq):
                table_entries += len(table)  # released entries too: the table keeps them
                for j, page in enumerate(table):
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
        so a page appears in two tables only when its refcount says it is shared, and only in
        tables of one group."""
        self.pool.check()
        if self.cache is not None:
            self.cache.check()
        counts: dict[int, int] = {}
        groups: dict[int, int] = {}
        for seq in live_seqs:
            tables = self.tables(seq)
            assert len(tables) == self.num_groups or not any(tables), \
                f"seq {seq.seq_id} has {len(tables)} page tables for {self.num_groups} groups"
            for g, pages in enumerate(tables):
                assert len(pages) >= self.pages_for(seq.num_computed_tokens), \
                    f"seq {seq.seq_id} computed {seq.num_computed_tokens} tokens in {len(pages)} pages"
                released = len(pages) - len([p for p in pages if p])
                assert not any(pages[:released]), \
                    f"seq {seq.seq_id}: released pages are not a leading run"
                assert released == 0 or self.windows[g] is not None, \
                    f"seq {seq.seq_id} has page 0 in its table without a window"
                live = pages[released:]
                assert len(set(live)) == len(live), f"seq {seq.seq_id} repeats a page"
                for page in live:
                    counts[page] = counts.get(page, 0) + 1
                    assert groups.setdefault(page, g) == g, f"page {page} is in two groups"
        assert 0 not in counts, "page 0 is in a page table"
        for page in range(1, self.pool.num_pages):
            assert self.pool.refcount(page) == counts.get(page, 0), (
                f"page {page}: refcount {self.pool.refcount(page)} but {counts.get(page, 0)} table entries")
