"""PrefixCache: finds pages already holding the KV of a token prefix. Owns the key <-> page maps; the
refcounts and the LRU of unreferenced cached pages live in the PagePool it is attached to.

Only FULL pages are cached. Page i's key chains page i-1's key, the page's token ids, the model
fingerprint and the optional cache salt, hashed with blake2b (never Python hash()), so two prompts
share page i only if they agree on every token of pages 0..i under the same model and salt.
Unreferenced cached pages stay findable until the pool evicts them (least recently released first)
to satisfy an allocation; an evicted page is unfindable at once. Plain Python, no JAX.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence as Seq

from jaxserve.core.page_pool import PagePool


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int, model_fingerprint: str):
        self.pool = pool
        self.page_size = page_size
        self.model_fingerprint = model_fingerprint
        self._page_by_key: dict[bytes, int] = {}
        self._key_by_page: dict[int, bytes] = {}
        pool.on_evict = self._forget

    def page_key(self, parent: bytes | None, tokens: Seq[int], salt: str | tuple | None) -> bytes:
        """Key of one full page given its parent's key (None for the first page). salt: the
        cache salt, or (cache salt, LoRA adapter key) for a request under an adapter."""
        if len(tokens) != self.page_size:
            raise ValueError(f"only full pages are keyed: {len(tokens)} tokens, page_size {self.page_size}")
        h = hashlib.blake2b(digest_size=16)
        h.update(parent if parent is not None else b"root")
        salt, adapter = salt if isinstance(salt, tuple) else (salt, None)
        parts = (self.model_fingerprint, "" if salt is None else "salt:" + salt)
        for part in parts if adapter is None else (*parts, "lora:" + adapter):
            data = part.encode()
            h.update(struct.pack("<Q", len(data)))
            h.update(data)
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return h.digest()

    def chain_keys(self, token_ids: Seq[int], salt: str | None, num_pages: int,
                   parent: bytes | None = None, first_page: int = 0) -> list[bytes]:
        """Keys of full pages first_page .. num_pages-1 of token_ids, chained from `parent`."""
        keys, b = [], self.page_size
        for i in range(first_page, num_pages):
            parent = self.page_key(parent, token_ids[i * b:(i + 1) * b], salt)
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Seq[int], salt: str | None,
               max_pages: int | None = None) -> tuple[list[int], list[bytes]]:
        """The longest chain of cached full pages for token_ids (at most max_pages): (pages, keys).
        Does not take references; the caller increfs the pages it attaches."""
        limit = len(token_ids) // self.page_size
        if max_pages is not None:
            limit = min(limit, max_pages)
        pages, keys, parent, b = [], [], None, self.page_size
        for i in range(limit):
            parent = self.page_key(parent, token_ids[i * b:(i + 1) * b], salt)
            page = self._page_by_key.get(parent)
            if page is None:
                break
            pages.append(page)
            keys.append(parent)
        return pages, keys

    @staticmethod
    def group_key(key: bytes, group: int) -> bytes:
        """The key of layer group `group`'s page at `key` (core/kv_groups.py): group 0's is the
        chain key itself, so a model of one group keys its pages as it always did."""
        if group == 0:
            return key
        return hashlib.blake2b(key + struct.pack("<q", group), digest_size=16).digest()

    def page_of(self, key: bytes) -> int | None:
        return self._page_by_key.get(key)

    def insert(self, key: bytes, page: int) -> bool:
        """Make a referenced, full page findable under key. False (nothing changes) if the key is
        already cached (another page computed the same prefix) or the page already has a key."""
        if key in self._page_by_key or page in self._key_by_page:
            return False
        self.pool.retain(page)
        self._page_by_key[key] = page
        self._key_by_page[page] = key
        return True

    def _forget(self, page: int) -> None:
        key = self._key_by_page.pop(page)
        del self._page_by_key[key]

    def clear(self) -> int:
        """Evict every unreferenced cached page. Returns how many."""
        pages = self.pool.evictable_pages()
        for page in pages:
            self.pool.evict(page)
        return len(pages)

    def reset(self, model_fingerprint: str | None = None) -> int:
        """Forget the cached prefixes (new weights: update_weights): every unreferenced cached
        page is evicted, and with a new fingerprint no key chained before is made again, so a
        page still referenced is never found. Returns the pages evicted."""
        if model_fingerprint is not None:
            self.model_fingerprint = model_fingerprint
        return self.clear()

    def contains_key(self, key: bytes) -> bool:
        return key in self._page_by_key

    def is_cached(self, page: int) -> bool:
        return page in self._key_by_page

    def key_of(self, page: int) -> bytes | None:
        return self._key_by_page.get(page)

    @property
    def num_cached(self) -> int:
        """Findable pages, referenced or not."""
        return len(self._page_by_key)

    @property
    def num_unreferenced(self) -> int:
        return self.pool.num_evictable

    def check(self) -> None:
        assert len(self._page_by_key) == len(self._key_by_page)
        for key, page in self._page_by_key.items():
            assert self._key_by_page[page] == key
            assert self.pool.is_retained(page), f"cached page {page} not retained by the pool"
        for page in self.pool.evictable_pages():
            assert page in self._key_by_page, f"evictable page {page} is not findable"
