import random

import numpy as np
import pytest
import torch

from shared.cache.allocator import SlotAllocator


def test_alloc_page_size_1_skips_reserved_slot_and_counts():
    a = SlotAllocator(num_pages=8, page_size=1, device="cpu")
    assert a.available_size() == 8 and a.total_size() == 8
    s = a.alloc(3)
    assert s.dtype == torch.int64 and s.tolist() == [1, 2, 3]
    assert a.available_size() == 5 and a.used_size() == 3
    a.free(s)
    assert a.available_size() == 8
    got = a.alloc(8)
    assert sorted(got.tolist()) == list(range(1, 9))  # slot 0 never handed out
    assert a.alloc(1) is None
    st = a.stats()
    assert st["failed_allocs"] == 1 and st["peak_used_tokens"] == 8 and st["frees"] == 1


def test_alloc_zero_and_refusal_takes_nothing():
    a = SlotAllocator(num_pages=2, page_size=4)
    assert a.alloc(0).shape == (0,)
    assert a.alloc(9) is None  # needs 3 pages
    assert a.available_size() == 8
    assert a.alloc(8).shape == (8,)


def test_alloc_page_size_4_whole_pages_and_continuation():
    a = SlotAllocator(num_pages=6, page_size=4)
    s = a.alloc(6)
    assert s.tolist() == [4, 5, 6, 7, 8, 9]  # pages 1 and 2, the second one half used
    assert a.available_size() == 16
    # The request continues its half-filled page before taking a fresh one.
    t = a.alloc(3, last_slot=9)
    assert t.tolist() == [10, 11, 12]
    assert a.available_size() == 12
    # Fits entirely in the rest of the own page: no page taken.
    u = a.alloc(2, last_slot=12)
    assert u.tolist() == [13, 14] and a.available_size() == 12
    # last_slot at the end of its page: fresh pages only.
    v = a.alloc(1, last_slot=15)
    assert v.tolist() == [16] and a.available_size() == 8
    # Refused continuation allocates nothing, not even the head of the own page.
    assert a.alloc(20, last_slot=16) is None and a.available_size() == 8


def test_continuation_of_a_free_page_is_a_bug():
    a = SlotAllocator(num_pages=4, page_size=4)
    with pytest.raises(AssertionError):
        a.alloc(2, last_slot=5)


def test_free_frees_whole_pages_and_detects_misuse():
    a = SlotAllocator(num_pages=4, page_size=4)
    s = a.alloc(6)
    a.free(s[4:])  # one slot of page 2 frees the whole page
    assert a.available_size() == 12 and a.is_page_free(2)
    with pytest.raises(AssertionError):
        a.free(s[5:6])  # page 2 again
    with pytest.raises(AssertionError):
        a.free(torch.tensor([0]))  # reserved page
    with pytest.raises(AssertionError):
        a.free(torch.tensor([20]))  # past the pool
    with pytest.raises(AssertionError):
        a.free(torch.tensor([4, 4]))  # same slot twice in one call
    a.free(np.array([4, 5, 6, 7]))  # numpy accepted
    assert a.available_size() == 16
    a.free(torch.empty(0, dtype=torch.int64))


def test_double_free_page_size_1():
    a = SlotAllocator(num_pages=4, page_size=1)
    s = a.alloc(2)
    a.free(s)
    with pytest.raises(AssertionError):
        a.free(s[:1])
    assert a.available_size() == 4


def test_freed_pages_come_back_ascending():
    a = SlotAllocator(num_pages=8, page_size=2)
    s = a.alloc(16)
    a.free(s[4:10])  # pages 3, 4, 5
    assert a.alloc(6).tolist() == [6, 7, 8, 9, 10, 11]


def test_reset():
    a = SlotAllocator(num_pages=5, page_size=2)
    a.alloc(7)
    a.reset()
    assert a.available_size() == 10
    assert a.alloc(2).tolist() == [2, 3]


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_alloc_free_never_hands_out_a_page_twice(page_size):
    rng = random.Random(1234 + page_size)
    a = SlotAllocator(num_pages=40, page_size=page_size)
    live: list[list[int]] = []  # each a request's slots
    for _ in range(2000):
        if live and rng.random() < 0.4:
            a.free(torch.tensor(live.pop(rng.randrange(len(live)))))
        elif live and rng.random() < 0.3:
            req = live[rng.randrange(len(live))]
            more = a.alloc(rng.randint(1, 6), last_slot=req[-1])
            if more is not None:
                if (req[-1] + 1) % page_size:
                    assert more[0].item() == req[-1] + 1
                req.extend(more.tolist())
        else:
            s = a.alloc(rng.randint(1, 12))
            if s is not None:
                live.append(s.tolist())
        pages = [p for req in live for p in sorted({x // page_size for x in req})]
        assert len(pages) == len(set(pages)), "a page is owned twice"
        assert 0 not in pages
        free = a.free_pages().tolist()
        assert sorted(free + pages) == list(range(1, 41))
        assert a.available_size() == len(free) * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_next_equals_one_alloc_per_request(page_size):
    """A decode step's slots in one call are the slots one alloc(1, last) per request would give, in
    order, with the same allocator state after; a step that does not fit takes nothing."""
    rng = random.Random(page_size)
    twins = [SlotAllocator(num_pages=64, page_size=page_size) for _ in range(2)]
    lasts = []
    for a in twins:  # requests with partly filled pages, on both allocators alike
        for n in (3, 5, 8, 1):
            lasts.append(int(a.alloc(n)[-1]))
    lasts = lasts[:4] + [-1]
    for _ in range(6):
        order = rng.sample(lasts, len(lasts))
        one = twins[0].alloc_next(order)
        seq = torch.cat([twins[1].alloc(1, last) for last in order])
        assert one.dtype == torch.int64 and one.tolist() == seq.tolist()
        assert twins[0].available_size() == twins[1].available_size()
        assert np.array_equal(twins[0].free_pages(), twins[1].free_pages())
        lasts = one.tolist()
    big = SlotAllocator(num_pages=2, page_size=page_size)
    free = big.available_size()
    assert big.alloc_next([-1, -1, -1]) is None and big.available_size() == free


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_runs_equals_one_alloc_per_request(page_size):
    """A catch-up pass's slots in one call are those one alloc(n, last) per request would give, in
    order, with the same allocator state and counters after; runs that do not all fit take nothing."""
    rng = random.Random(page_size)
    twins = [SlotAllocator(num_pages=256, page_size=page_size) for _ in range(2)]
    lasts = []
    for a in twins:
        for n in (3, 5, 8, 1):
            lasts.append(int(a.alloc(n)[-1]))
    lasts = lasts[:4] + [-1]
    for _ in range(6):
        order = rng.sample(lasts, len(lasts))
        counts = [rng.choice([1, 2, 7, 13]) for _ in order]
        one = twins[0].alloc_runs(counts, order)
        seq = torch.cat([twins[1].alloc(n, last) for n, last in zip(counts, order)])
        assert one.dtype == torch.int64 and one.tolist() == seq.tolist()
        assert np.array_equal(twins[0].free_pages(), twins[1].free_pages())
        assert twins[0].stats() == twins[1].stats()
        ends = np.cumsum(counts) - 1
        lasts = [int(one[e]) for e in ends]
    small = SlotAllocator(num_pages=3, page_size=page_size)
    free = small.available_size()
    assert small.alloc_runs([page_size, 2 * page_size, 1], [-1, -1, -1]) is None
    assert small.available_size() == free and small.alloc_runs([], []).tolist() == []


def test_req_to_token_rows_refuse_a_double_free_and_row_zero():
    """Request rows: every row once, lowest first; a row freed twice, never handed out, or the padding row
    0 is a bug caught at the free (O(1) bookkeeping, not a scan of the free list)."""
    from shared.cache.kv_pool import ReqToTokenPool
    pool = ReqToTokenPool(3, 8, "cpu")
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [1, 2, 3] and pool.alloc() is None and pool.available() == 0
    pool.free(2)
    with pytest.raises(AssertionError):
        pool.free(2)
    with pytest.raises(AssertionError):
        pool.free(0)
    assert pool.alloc() == 2 and pool.available() == 0
    for r in (1, 2, 3):
        pool.free(r)
    assert pool.available() == 3
    with pytest.raises(AssertionError):
        pool.free(3)
