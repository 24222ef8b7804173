"""PrefixCache keys, lookup, LRU eviction; KVManager prefix hits, forks and copy-on-write."""

import random

from hypothesis import given, settings, strategies as st

from jaxserve.core.kv_manager import KVManager
from jaxserve.core.page_pool import OutOfPages, PagePool
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import Request, Sequence

B = 4


def make(num_pages=9, fingerprint="m1"):
    pool = PagePool(num_pages)
    cache = PrefixCache(pool, B, fingerprint)
    return pool, cache, KVManager(pool, B, cache)


def seq_of(tokens, seq_id=0):
    req = Request(request_id=f"r{seq_id}", prompt_token_ids=list(tokens), sampling_params=SamplingParams())
    return Sequence(seq_id=seq_id, request=req, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def compute(kv, seq, n):
    """Write n more tokens (as a runner would) and register full pages."""
    copies = []
    kv.prepare_write(seq, n, copies)
    seq.num_computed_tokens += n
    kv.register_full_pages(seq)
    return copies


def test_keys_chain_parent_tokens_fingerprint_and_salt():
    pool, cache, _ = make()
    other = PrefixCache(PagePool(3), B, "m2")
    k1 = cache.page_key(None, [1, 2, 3, 4], None)
    assert k1 == cache.page_key(None, [1, 2, 3, 4], None)  # deterministic, not Python hash()
    assert k1 != cache.page_key(None, [1, 2, 3, 5], None)
    assert k1 != cache.page_key(None, [1, 2, 3, 4], "tenant")
    assert k1 != other.page_key(None, [1, 2, 3, 4], None)
    assert cache.page_key(k1, [5, 6, 7, 8], None) != cache.page_key(None, [5, 6, 7, 8], None)
    assert cache.page_key(None, [1, 2, 3, 4], "") != cache.page_key(None, [1, 2, 3, 4], None)


def test_lookup_returns_longest_chain_of_full_pages_only():
    pool, cache, kv = make()
    tokens = list(range(10))  # 2 full pages + 2 tokens
    a = seq_of(tokens)
    kv.admit(a, None)
    compute(kv, a, 10)
    assert cache.num_cached == 2  # the partial third page is not cached
    pages, _ = cache.lookup(tokens, None)
    assert pages == a.page_ids[:2]
    assert cache.lookup(tokens[:4] + [99] * 6, None)[0] == a.page_ids[:1]  # diverges in page 2
    assert cache.lookup([99] + tokens[1:], None)[0] == []  # diverges in page 1: no hit after it
    assert cache.lookup(tokens, "salt")[0] == []  # a different salt never hits


def test_hit_never_covers_the_last_token():
    pool, cache, kv = make()
    tokens = list(range(8))  # exactly 2 full pages
    a = seq_of(tokens)
    kv.admit(a, None)
    compute(kv, a, 8)
    b = seq_of(tokens, 1)
    hit = kv.find_prefix(b, None)
    assert hit[0] == a.page_ids[:1]  # truncated to the page boundary below the last token
    c = seq_of(tokens + [8], 2)  # 9 tokens: both full pages can be reused, token 8 computed
    assert kv.find_prefix(c, None)[0] == a.page_ids[:2]
    d = seq_of(tokens[:6], 3)  # prompt ends mid-page: hit is the first page
    assert kv.find_prefix(d, None)[0] == a.page_ids[:1]


def test_unreferenced_pages_stay_findable_until_evicted_lru_first():
    pool, cache, kv = make(num_pages=5)  # 4 usable
    a, b = seq_of([1] * 4, 0), seq_of([2] * 4, 1)
    for s in (a, b):
        kv.admit(s, None)
        compute(kv, s, 4)
    pa, pb = a.page_ids[0], b.page_ids[0]
    kv.free(a)
    kv.free(b)
    assert pool.num_evictable == 2 and pool.num_free == 2
    assert cache.lookup([1] * 4 + [0], None)[0] == [pa]
    got = pool.allocate(3)  # 2 free + the least recently released cached page (a's)
    assert pa in got and pb not in got
    assert cache.lookup([1] * 4 + [0], None)[0] == []  # evicted -> unfindable
    assert cache.lookup([2] * 4 + [0], None)[0] == [pb]
    pool.decref_all(got)
    cache.check()
    pool.check()


def test_fork_shares_pages_and_copy_on_write_before_writing_a_shared_page():
    pool, cache, kv = make()
    a = seq_of([5, 6, 7, 8, 9, 10])
    kv.admit(a, None)
    compute(kv, a, 6)
    child = seq_of(a.token_ids, 1)
    kv.fork(a, child)
    assert child.page_ids == a.page_ids and all(pool.refcount(p) == 2 for p in a.page_ids)
    a.token_ids.append(11)
    child.token_ids.append(12)
    shared_tail = a.page_ids[1]
    copies = compute(kv, a, 1)  # writes slot 6, in the shared partial page -> copy
    assert copies == [(shared_tail, a.page_ids[1])] and a.page_ids[1] != shared_tail
    assert a.page_ids[0] == child.page_ids[0]  # the full first page stays shared
    assert pool.refcount(shared_tail) == 1
    assert compute(kv, child, 1) == []  # the last holder writes in place
    assert child.page_ids[1] == shared_tail
    kv.check([a, child])


def test_fully_cached_prompt_recomputes_into_a_fresh_page():
    pool, cache, kv = make()
    a = seq_of(list(range(8)))
    kv.admit(a, None)
    compute(kv, a, 8)
    b = seq_of(list(range(8)), 1)
    kv.admit(b, None, kv.find_prefix(b, None))
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 4
    copies = compute(kv, b, 4)
    assert copies == [] and b.page_ids[0] == a.page_ids[0] and b.page_ids[1] != a.page_ids[1]
    kv.check([a, b])
    # b's recomputed page 1 has the same key as a's: not registered twice
    assert cache.num_cached == 2


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_kv_manager_ops_keep_invariants(seed):
    """Admit with prefix hits, grow in odd-sized chunks, fork, free, at random; check ownership,
    conservation and that every cached page holds the tokens its key says after every op."""
    rng = random.Random(seed)
    pool, cache, kv = make(num_pages=rng.randint(4, 14))
    vocab = [0, 1]  # tiny vocabulary: many shared prefixes
    live: list[Sequence] = []
    contents: dict[int, list[int]] = {}  # page -> token ids written (a stand-in for KV)
    next_id = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.3:
            tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 14))]
            s = seq_of(tokens, next_id)
            next_id += 1
            hit = kv.find_prefix(s, None)
            for page, i in zip(hit[0], range(len(hit[0]))):
                assert contents[page] == tokens[i * B:(i + 1) * B], "prefix hit with wrong content"
            kv.admit(s, None, hit)
            live.append(s)
        elif op < 0.65 and live:
            s = rng.choice(live)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(rng.choice(vocab))
            n = rng.randint(1, s.num_tokens - s.num_computed_tokens)
            before = (list(s.page_ids), pool.num_free, pool.num_evictable)
            copies = []
            try:
                kv.prepare_write(s, n, copies)
            except OutOfPages:
                assert (list(s.page_ids), pool.num_free, pool.num_evictable) == before
                continue
            for src, dst in copies:
                contents[dst] = list(contents.get(src, []))
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
                page = s.page_ids[pos // B]
                assert sum(page in t.page_ids for t in live) == 1, "write into a shared page"
                assert not cache.is_cached(page), "write into a cached page"
                c = contents.setdefault(page, [])
                del c[pos % B:]
                c.append(s.token_ids[pos])
            s.num_computed_tokens += n
            kv.register_full_pages(s)
        elif op < 0.8 and live:
            parent = rng.choice(live)
            child = seq_of(parent.token_ids, next_id)
            next_id += 1
            kv.fork(parent, child)
            live.append(child)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            kv.free(s)
        kv.check(live)
        for page in range(1, pool.num_pages):
            if pool.refcount(page) == 0 and not pool.is_evictable(page):
                assert not cache.is_cached(page), "a free page is findable"
    for s in live:
        kv.free(s)
    kv.check([])
    assert pool.num_referenced == 0 and pool.num_free + pool.num_evictable == pool.num_usable


def test_sliding_window_releases_pages_before_the_window():
    """Every layer windowed (W = 6, pages of 4): as a sequence decodes, each page whose slots all
    lie before the next token's window leaves its table (entry 0) and its reference is dropped,
    so it holds at most pages_to_hold pages; released pages stay findable for a new request
    with the same tokens; forks, frees and the invariants skip the released entries."""
    pool = PagePool(12)
    cache = PrefixCache(pool, B, "m1")
    kv = KVManager(pool, B, cache, group_windows=(6,))
    seq = seq_of(range(10))
    kv.admit(seq, None)
    compute(kv, seq, 10)
    peak = 0
    for t in range(10, 30):
        seq.token_ids.append(100 + t)
        compute(kv, seq, 1)
        peak = max(peak, pool.num_referenced)
        kv.check([seq])
    # the next token (position 30) reads keys 25..29: pages 0-5 (slots 0..23) are released
    assert seq.page_ids[:6] == [0] * 6 and all(seq.page_ids[6:])
    assert peak == kv.pages_to_hold(30, chunk=1) == 3 < kv.pages_for(30)
    child = seq_of(seq.token_ids, seq_id=1)
    kv.fork(seq, child)
    kv.check([seq, child])
    kv.free(seq)
    kv.free(child)
    kv.check([])
    again = seq_of(seq.token_ids[:20], seq_id=2)  # its first 4 pages were released, not lost
    assert len(kv.find_prefix(again, None)[0]) == 4
