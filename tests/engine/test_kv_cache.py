"""Block pool, prefix reuse and reservation lifetimes, without a model."""
import pytest

from pdrollout.engine.scheduler.kv_pool import BlockPool, Reservations


def test_prefix_match_needs_same_chain():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    toks = list(range(12))
    pool.commit(blocks, toks, 12)
    assert pool.match_prefix(toks + [99], 12) == blocks
    assert pool.match_prefix([0, 1, 2, 3, 9, 9, 9, 9], 8) == blocks[:1]   # diverges in block 2
    assert pool.match_prefix([1, 1, 2, 3], 4) == []                          # first block differs
    assert pool.match_prefix(toks, 7) == blocks[:1]                          # capped by max_tokens


def test_eviction_only_takes_unreferenced_blocks():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.commit(a, [1, 2, 3, 4], 4)
    b = pool.allocate(2)
    pool.commit(b, [5, 6, 7, 8], 4)
    pool.release(a)                      # a cached but unreferenced; b still held
    assert pool.num_available() == 2
    c = pool.allocate(2)                 # must evict a, never b
    assert sorted(c) == sorted(a)
    assert pool.allocate(1) is None
    assert pool.match_prefix([1, 2, 3, 4], 4) == []          # a's content is gone
    assert pool.match_prefix([5, 6, 7, 8], 4) == b           # b's content intact


def test_release_twice_is_an_error():
    pool = BlockPool(2, 2)
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a)


def test_reservation_freed_only_after_inflight_work_drains():
    pool = BlockPool(4, 2)
    res = Reservations(pool)
    r = res.open("x")
    r.blocks = pool.allocate(3)
    res.begin_work(r)
    res.close(r)                                   # cancelled while work is in flight
    assert pool.num_available() == 1               # not reusable yet
    assert not res.is_current("x", r.lifetime)
    r2 = res.open("x")                             # same rid, new lifetime
    assert r2.lifetime > r.lifetime
    res.end_work(r)                                # the submitted work drained
    assert pool.num_available() == 4


def test_duplicate_live_reservation_rejected():
    res = Reservations(BlockPool(2, 2))
    res.open("x")
    with pytest.raises(ValueError, match="already has a live reservation"):
        res.open("x")
