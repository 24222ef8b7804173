"""PagePool: free list, refcounts, scratch page 0, all-or-nothing allocation, deferred release."""

import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.page_pool import OutOfPages, PagePool


def state(pool):
    return (pool.num_free, pool.num_pending, pool.num_evictable, pool.num_referenced,
            [pool.refcount(p) for p in range(pool.num_pages)])


def test_page_zero_is_never_handed_out_and_usable_excludes_it():
    pool = PagePool(5)
    assert pool.num_usable == 4
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.decref(0)
    with pytest.raises(ValueError):
        pool.incref(0)
    pool.check()


def test_failed_allocation_changes_nothing():
    pool = PagePool(6)
    held = pool.allocate(3)
    before = state(pool)
    with pytest.raises(OutOfPages):
        pool.allocate(3)
    assert state(pool) == before
    assert len(pool.allocate(2)) == 2 and pool.num_available == 0
    pool.decref_all(held)
    assert pool.num_free == 3


def test_refcount_returns_page_only_at_zero():
    pool = PagePool(3)
    [p] = pool.allocate(1)
    pool.incref(p)
    pool.decref(p)
    assert pool.refcount(p) == 1 and pool.num_free == 1
    pool.decref(p)
    assert pool.refcount(p) == 0 and pool.num_free == 2
    with pytest.raises(ValueError):
        pool.decref(p)
    with pytest.raises(ValueError):
        pool.incref(p)  # a free page cannot be revived


def test_pages_freed_while_a_step_is_in_flight_wait_for_release():
    pool = PagePool(3)
    a, b = pool.allocate(2)
    pool.defer_frees(7)
    pool.decref(a)
    assert pool.num_pending == 1 and pool.num_available == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.defer_frees(8)
    pool.decref(b)
    assert pool.release_pending(upto_tag=7) == 1  # only the page freed under step 7
    assert pool.allocate(1) == [a]
    pool.defer_frees(None)
    assert pool.release_pending() == 1
    pool.check()


def test_retained_pages_become_evictable_lru_first():
    pool = PagePool(4)
    evicted = []
    pool.on_evict = evicted.append
    a, b, c = pool.allocate(3)
    pool.retain(a)
    pool.retain(b)
    pool.decref(b)  # released first -> evicted first
    pool.decref(a)
    pool.decref(c)  # not retained -> free
    assert (pool.num_free, pool.num_evictable) == (1, 2)
    assert pool.allocate(2) == [c, b] and evicted == [b]
    pool.incref(a)  # revive a cached page
    assert pool.num_evictable == 0 and pool.refcount(a) == 1
    pool.check()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / decref / retain / defer / release against a model of refcounts."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(9)
        self.refs: dict[int, int] = {}  # model: page -> refcount of pages we hold
        self.evicted: list[int] = []
        self.pool.on_evict = self.evicted.append

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        before = state(self.pool)
        available = self.pool.num_available
        try:
            pages = self.pool.allocate(n)
        except OutOfPages:
            assert n > available and state(self.pool) == before
            return
        assert len(set(pages)) == n and 0 not in pages
        for p in pages:
            assert p not in self.refs, f"page {p} handed out twice"
            self.refs[p] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        p = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.incref(p)
        self.refs[p] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data):
        p = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.decref(p)
        self.refs[p] -= 1
        if not self.refs[p]:
            del self.refs[p]

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def retain(self, data):
        self.pool.retain(data.draw(st.sampled_from(sorted(self.refs))))

    @precondition(lambda self: self.pool.num_evictable)
    @rule(data=st.data())
    def revive(self, data):
        p = data.draw(st.sampled_from(self.pool.evictable_pages()))
        self.pool.incref(p)
        self.refs[p] = 1

    @rule(tag=st.one_of(st.none(), st.integers(0, 3)))
    def set_defer(self, tag):
        self.pool.defer_frees(tag)

    @rule(upto=st.one_of(st.none(), st.integers(0, 3)))
    def release(self, upto):
        self.pool.release_pending(upto)

    @invariant()
    def conserved(self):
        self.pool.check()
        for p in range(1, self.pool.num_pages):
            assert self.pool.refcount(p) == self.refs.get(p, 0)
        assert self.pool.num_referenced == len(self.refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_seeded_random_ops_conserve_pages():
    rng = random.Random(1)
    pool = PagePool(17)
    held: list[int] = []
    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 4)
            ok = n <= pool.num_available
            try:
                held.extend(pool.allocate(n))
            except OutOfPages:
                assert not ok
        elif op < 0.6 and held:
            p = rng.choice(held)
            pool.incref(p)
            held.append(p)
        elif op < 0.9 and held:
            pool.decref(held.pop(rng.randrange(len(held))))
        elif op < 0.95:
            pool.defer_frees(rng.choice([None, 1]))
        else:
            pool.release_pending()
        pool.check()
        assert pool.num_referenced == len(set(held))
