"""PagePool: the host-side allocator of KV pages. Owns the free list, per-page refcounts, the LRU of
unreferenced pages retained by the prefix cache, and the pages whose release waits for an in-flight
step. Plain Python, no JAX.

Every usable page (1 .. num_pages-1; page 0 is reserved scratch, never handed out, never freed) is in
exactly one state:

    free         on the free list, allocatable
    pending      refcount 0, freed while a step that may still write it is in flight; becomes free
                 when that step's results are applied (`release_pending`)
    evictable    refcount 0 but retained by the prefix cache (findable); LRU-evicted on demand
    referenced   refcount >= 1

so free + pending + evictable + referenced == num_usable after every operation (`check`).
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable


class OutOfPages(RuntimeError):
    """allocate(n) could not get n pages; nothing was changed."""


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved scratch), got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._pending: list[tuple[int, int]] = []  # (tag of the newest step in flight, page)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._retained: set[int] = set()  # pages the prefix cache keeps findable
        self._defer_tag: int | None = None  # set while a step is in flight: frees become pending
        self.on_evict: Callable[[int], None] | None = None  # the cache drops its key for the page
        self.num_evictions = 0

    # ---- counts -----------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_usable - self.num_free - self.num_pending - self.num_evictable

    @property
    def num_available(self) -> int:
        """Pages allocate() can hand out now: free, then LRU-evicted cached pages."""
        return len(self._free) + len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    # ---- allocation and references ------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, free pages first, then evicting least-recently-released cached
        pages. All or nothing: raises OutOfPages and changes nothing when fewer than n are available."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_available:
            raise OutOfPages(f"need {n} pages, {len(self._free)} free + {len(self._evictable)} "
                             f"evictable available ({len(self._pending)} pending release)")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._retained.discard(page)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def incref(self, page: int) -> None:
        """Add a reference. A refcount-0 page may only be revived from the evictable (cached) set."""
        self._check_page(page)
        if self._refcount[page] == 0:
            if page not in self._evictable:
                raise ValueError(f"page {page} is free; only referenced or cached pages can be shared")
            del self._evictable[page]
        self._refcount[page] += 1

    def decref(self, page: int) -> None:
        """Drop a reference. At 0 the page becomes evictable if the cache retains it, else free (or
        pending while a step is in flight)."""
        self._check_page(page)
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} has no reference to drop")
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if page in self._retained:
                self._evictable[page] = None  # most recently released at the end
            elif self._defer_tag is not None:
                self._pending.append((self._defer_tag, page))
            else:
                self._free.append(page)

    def decref_all(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.decref(page)

    # ---- prefix-cache retention ---------------------------------------------------------------
    def retain(self, page: int) -> None:
        """The prefix cache keeps this (referenced) page findable after its last reference drops."""
        self._check_page(page)
        if self._refcount[page] < 1:
            raise ValueError(f"only a referenced page can be retained, page {page} has refcount 0")
        self._retained.add(page)

    def is_retained(self, page: int) -> bool:
        return page in self._retained

    def evict(self, page: int) -> None:
        """Drop one unreferenced cached page to the free list (used by PrefixCache.clear)."""
        del self._evictable[page]
        self._retained.discard(page)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        self._free.append(page)

    def evictable_pages(self) -> list[int]:
        return list(self._evictable)

    # ---- deferred release -----------------------------------------------------------------------
    def defer_frees(self, tag: int | None) -> None:
        """From now on, pages whose last reference drops are pending under `tag` (the newest step
        in flight, which may still write them) until release_pending; None: freed at once."""
        self._defer_tag = tag

    def release_pending(self, upto_tag: int | None = None) -> int:
        """Free pending pages whose tag <= upto_tag (all when None). Returns how many."""
        keep, released = [], 0
        for tag, page in self._pending:
            if upto_tag is None or tag <= upto_tag:
                self._free.append(page)
                released += 1
            else:
                keep.append((tag, page))
        self._pending = keep
        return released

    # ---- checking ---------------------------------------------------------------------------------
    def _check_page(self, page: int) -> None:
        if not 1 <= page < self.num_pages:
            raise ValueError(f"page {page} is not a usable page (1..{self.num_pages - 1}; 0 is scratch)")

    def check(self) -> None:
        """Raise AssertionError if the state partition or conservation is broken."""
        free = list(self._free)
        pending = [p for _, p in self._pending]
        evictable = list(self._evictable)
        referenced = [p for p in range(1, self.num_pages) if self._refcount[p] > 0]
        everything = free + pending + evictable + referenced
        assert 0 not in everything and self._refcount[0] == 0, "page 0 left the scratch state"
        assert len(everything) == len(set(everything)) == self.num_usable, (
            f"conservation broken: free {len(free)} + pending {len(pending)} + evictable "
            f"{len(evictable)} + referenced {len(referenced)} != {self.num_usable} "
            f"(duplicates: {len(everything) - len(set(everything))})")
        assert all(self._refcount[p] == 0 for p in free + pending + evictable)
        assert set(evictable) <= self._retained
        assert not (self._retained & (set(free) | set(pending))), "a free page is still retained"
