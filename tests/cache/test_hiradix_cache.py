"""The radix tree with a host tier (shared/cache/hiradix_cache.py) on the CPU: both pools in host memory, copies
synchronous, the same code paths as on CUDA otherwise."""
import numpy as np
import pytest
import torch

from shared.cache.allocator import SlotAllocator
from shared.cache.hiradix_cache import HiRadixCache
from shared.cache.host_pool import HostKVPool, HostTierError, host_pool_tokens
from shared.cache.kv_pool import KVPool

LAYERS = 2


def make(device_tokens=32, host_tokens=64, page_size=1, policy="write_through"):
    pool = KVPool(LAYERS, 1, 2, device_tokens // page_size, page_size, torch.float32, "cpu")
    alloc = SlotAllocator(device_tokens // page_size, page_size, "cpu")
    cache = HiRadixCache(alloc, page_size, HostKVPool(pool, host_tokens), policy)
    return pool, alloc, cache


def kv_of(token: int, layer: int, which: int) -> torch.Tensor:
    """What the 'model' writes for a token: a function of the token only (position-free, for checking)."""
    return torch.tensor([[token * 10.0 + layer, which]])


def compute(pool, alloc, cache, tokens):
    """A request: match, write KV for what is not cached, insert, release. Returns the match."""
    match = cache.match_prefix(tokens)
    if match.host is not None:
        op = cache.load_back(match)
        if op is not None:
            assert cache.load_ready(op)
            match = cache.match_prefix(tokens)
            cache.lock(match.node)
            cache.release_load(op)
            cache.unlock(match.node)
    n = match.length
    cache.evict(max(0, len(tokens) - n - alloc.available_size()))
    new = alloc.alloc(len(tokens) - n)
    assert new is not None
    for i, slot in enumerate(new.tolist()):
        for layer in range(LAYERS):
            pool.k_buffers[layer][slot] = kv_of(tokens[n + i], layer, 0)
            pool.v_buffers[layer][slot] = kv_of(tokens[n + i], layer, 1)
    slots = torch.cat([match.slots, new])
    done = cache.insert(tokens, slots)
    alloc.free(slots[match.length:done])
    return match


def check_kv(pool, cache, tokens):
    """The device KV the tree gives for `tokens` is what was computed for them."""
    match = cache.match_prefix(tokens, record=False)
    for tok, slot in zip(tokens, match.slots.tolist()):
        for layer in range(LAYERS):
            assert torch.equal(pool.k_buffers[layer][slot], kv_of(tok, layer, 0)), (tok, layer)
            assert torch.equal(pool.v_buffers[layer][slot], kv_of(tok, layer, 1)), (tok, layer)
    return match.length


def no_leak(alloc, cache):
    """Device and host slots all accounted for by the tree; after reset, every slot free."""
    device = sum(len(n.value) for n in cache.nodes() if n.value is not None)
    host = sum(len(n.host_value) for n in cache.nodes() if n.host_value is not None)
    assert alloc.used_size() == device
    assert cache.host_allocator.used_size() == host == cache.stats()["host_cached_tokens"]
    cache.reset()
    assert alloc.available_size() == alloc.total_size()
    assert cache.host_allocator.available_size() == cache.host_allocator.total_size()


def host_only():
    """A cache whose only prompt, 16 tokens, was evicted from the device to the host."""
    pool, alloc, cache = make()
    a = list(range(100, 116))
    compute(pool, alloc, cache, a)
    assert cache.evict(16) == 16
    return pool, alloc, cache, a


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_evicted_prefix_comes_back_from_host(policy):
    pool, alloc, cache = make(policy=policy)
    a = list(range(100, 120))
    compute(pool, alloc, cache, a)
    if policy == "write_through_selective":
        compute(pool, alloc, cache, a)  # reused once: now copied to the host
    compute(pool, alloc, cache, list(range(200, 220)))  # evicts most of a from the device
    match = cache.match_prefix(a, record=False)
    assert match.length < 20 and match.host_hit_length == 20 - match.length
    before = cache.stats()
    compute(pool, alloc, cache, a)
    after = cache.stats()
    assert after["host_hit_tokens"] - before["host_hit_tokens"] == 20 - match.length
    # One admission's query and hit, counted once although it matched before and after its load.
    assert after["query_tokens"] - before["query_tokens"] == 20 and after["hit_tokens"] - before["hit_tokens"] == 20
    assert check_kv(pool, cache, a) == 20
    no_leak(alloc, cache)


def test_both_resident_drops_device_only_and_splits_keep_tiers():
    pool, alloc, cache = make()
    compute(pool, alloc, cache, list(range(16)))
    node = cache.match_prefix(list(range(16)), record=False).node
    assert node.value is not None and node.host_value is not None  # write-through: on both
    written = cache.stats()["written_tokens"]
    cache.evict(16)
    assert node.value is None and node.host_value is not None and not node.evicted  # host-only, still in the tree
    assert cache.stats()["written_tokens"] == written  # no second copy
    # A longer prompt diverging inside the host-only edge splits it; both halves keep their host copies.
    compute(pool, alloc, cache, list(range(8)) + [99] * 8)
    assert check_kv(pool, cache, list(range(8))) == 8
    assert cache.match_prefix(list(range(16)), record=False).host_hit_length == 8
    compute(pool, alloc, cache, list(range(16)))
    assert check_kv(pool, cache, list(range(16))) == 16
    no_leak(alloc, cache)


def test_namespaces_keep_their_host_nodes_apart():
    pool, alloc, cache, a = host_only()
    assert cache.match_prefix(a, record=False).host_hit_length == 16
    assert cache.match_prefix(a, namespace="tenant", record=False).host is None
    no_leak(alloc, cache)


def test_host_lru_evicts_oldest_and_never_fails():
    pool, alloc, cache = make(device_tokens=16, host_tokens=24)
    prompts = [list(range(k * 100, k * 100 + 8)) for k in range(8)]
    for p in prompts:
        compute(pool, alloc, cache, p)  # 64 tokens through a 16-token device pool and a 24-token host pool
    assert cache.stats()["host_evicted_tokens"] > 0
    assert cache.host_allocator.used_size() <= 24
    first = cache.match_prefix(prompts[0], record=False)
    last = cache.match_prefix(prompts[-1], record=False)
    assert first.length + first.host_hit_length == 0  # the oldest left both tiers
    assert last.length + last.host_hit_length == 8
    no_leak(alloc, cache)


def test_host_full_of_locked_work_drops_instead():
    """With no host room at all, device eviction drops nodes as the plain tree does."""
    pool, alloc, cache = make(device_tokens=16, host_tokens=1, policy="write_back")
    for k in range(4):
        compute(pool, alloc, cache, list(range(k * 100, k * 100 + 8)))
    assert cache.stats()["evicted_tokens"] >= 16
    no_leak(alloc, cache)


def test_failed_load_falls_back_to_a_miss(monkeypatch):
    pool, alloc, cache, a = host_only()

    def broken(*args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(cache.host, "load", broken)
    match = cache.match_prefix(a)
    assert match.host_hit_length == 16
    assert cache.load_back(match) is None
    assert cache.stats()["load_failures"] == 1
    monkeypatch.undo()
    compute(pool, alloc, cache, a)  # recomputes over the host-only node: it is on the device again
    assert check_kv(pool, cache, a) == 16
    no_leak(alloc, cache)


class Pending:
    """A copy's event as on CUDA: complete once `done` is set."""
    done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def seconds(self):
        return 0.0


def test_slow_load_is_abandoned_and_its_slots_freed_when_the_copy_ends():
    pool, alloc, cache, a = host_only()

    event = Pending()  # a copy that has not completed
    real = cache.host.load
    monkey_calls = []

    def slow(h, d):
        real(h, d)
        monkey_calls.append(1)
        return event

    cache.host.load = slow
    cache.load_timeout = 0.0
    match = cache.match_prefix(a)
    op = cache.load_back(match)
    assert op is not None and op.state == "loading"
    # Another request's match stops before the loading nodes and waits on the same load.
    other = cache.match_prefix(a)
    assert other.length == 0 and other.host.loading is op
    assert cache.load_back(other) is op
    used = alloc.used_size()
    assert cache.load_ready(op) and op.state == "failed"  # past the timeout
    cache.release_load(op)
    cache.release_load(op)
    assert alloc.used_size() == used  # the copy may still write them: not freed yet
    event.done = True
    cache.poll()
    assert alloc.used_size() == used - 16
    assert cache.match_prefix(a, record=False).host_hit_length == 16  # host-only again
    no_leak(alloc, cache)


def test_host_size_is_capped_by_available_memory():
    assert host_pool_tokens(100, 1000, 2.0, 0, 10**9) == 200
    assert host_pool_tokens(100, 1000, 2.0, 0, 10**5) == 50  # the ratio's size, capped at half the memory
    assert host_pool_tokens(100, 1000, 2.0, 1, 10**10) == 10**6  # GB wins over the ratio
    with pytest.raises(HostTierError, match="available"):
        host_pool_tokens(100, 1000, 2.0, 1, 10**8)  # an explicit size the host cannot hold is refused
    # Tensor parallelism: the sizes are each rank's (its KV heads' bytes), the host's memory is shared by the ranks.
    assert host_pool_tokens(100, 1000, 2.0, 0, 10**5, ranks=2) == 25
    assert host_pool_tokens(100, 1000, 2.0, 1, 2 * 10**9) == 10**6
    with pytest.raises(HostTierError, match="a rank × 2 ranks"):
        host_pool_tokens(100, 1000, 2.0, 1, 2 * 10**9, ranks=2)


def test_paged_tree_load_back():
    pool, alloc, cache = make(device_tokens=32, host_tokens=64, page_size=4)
    a = list(range(100, 124))
    compute(pool, alloc, cache, a)
    compute(pool, alloc, cache, list(range(300, 324)))
    compute(pool, alloc, cache, a)
    assert cache.stats()["host_hit_tokens"] > 0 and check_kv(pool, cache, a) == 24
    no_leak(alloc, cache)


def test_failed_write_leaves_the_node_on_the_device_only(monkeypatch):
    pool, alloc, cache = make()

    def broken(*args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(cache.host, "write", broken)
    a = list(range(100, 116))
    compute(pool, alloc, cache, a)
    cache.poll()  # the queued copy is issued here, and fails
    node = cache.match_prefix(a, record=False).node
    assert node.host_value is None and cache.host_allocator.used_size() == 0
    monkeypatch.undo()
    assert cache.evict(16) == 16  # write-through: a node without a copy leaves the tree, as in the one-tier cache
    match = cache.match_prefix(a, record=False)
    assert match.length == 0 and match.host is None
    no_leak(alloc, cache)


def test_write_through_eviction_never_waits_for_a_copy():
    """A node evicted while its copy is still on the way is dropped (its host slots freed once the copy has landed)
    rather than waited for; write-back waits, which is its cost."""
    pool, alloc, cache = make()

    class Pending:
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("write-through eviction waited for a copy")

    event = Pending()
    real = cache.host.write
    cache.host.write = lambda d, h: real(d, h) or event
    a = list(range(100, 116))
    compute(pool, alloc, cache, a)
    assert cache.evict(16) == 16
    assert cache.match_prefix(a, record=False).host is None
    assert cache.host_allocator.used_size() == 16  # the copy may still write them
    event.done = True
    cache.poll()
    assert cache.host_allocator.used_size() == 0
    no_leak(alloc, cache)


def test_tp_copies_are_ordered_on_every_rank_and_waited_for_on_the_device(monkeypatch):
    """Rank 0's pool under tensor parallelism orders each copy on the other ranks (a write with the next command, a
    load at once) and, once it has seen a copy complete, orders them to queue what follows after theirs (once); a
    follower waits, on its device, only for a copy not already complete there."""
    from shared.cache.host_pool import FollowerHostTier, LeaderHostKVPool

    events = []

    def pending(self, direction, d, h):
        events.append(Pending())
        return events[-1]

    monkeypatch.setattr(HostKVPool, "_transfer", pending)
    pool = KVPool(LAYERS, 1, 2, 32, 1, torch.float32, "cpu")
    deferred, sent = [], []
    host = LeaderHostKVPool(pool, 64, deferred.append, sent.append)
    d, h = np.array([3, 4], np.int64), np.array([10, 11], np.int64)
    write = host.write(d, h)
    assert [o[:3] for o in deferred] == [("host_copy", "write", 1)] and not sent
    assert not write.query() and len(deferred) == 1
    events[0].done = True
    assert write.query() and write.query() and deferred[1:] == [("host_done", 1)]  # once
    load = host.load(h, np.array([7, 8], np.int64))
    assert [o[:3] for o in sent] == [("host_copy", "load", 2)] and np.array_equal(sent[0][3], [7, 8])
    load.synchronize()
    assert deferred[2:] == [("host_done", 2)]

    waited = []
    follower = FollowerHostTier(HostKVPool(pool, 64))
    monkeypatch.setattr(follower.pool, "after", waited.append)
    for order in deferred[:1] + sent:
        follower.copy(*order[1:])
    events[-2].done = True  # the follower's write completed before rank 0 saw its own: nothing to wait for
    follower.done(1)
    follower.done(2)
    assert waited == [events[-1]]


@pytest.fixture
def cuda_standin(monkeypatch):
    """host_pool.py's CUDA branches on the CPU: torch.cuda replaced by a recorder of the order the GPU would keep
    (tests/cache/_cuda_standin.py). Yields (the stand-in, a helper that builds a host pool of 3-token chunks over a
    'device' pool of `dtype` and `head_dim`, with its memory tracked)."""
    import shared.cache.host_pool as host_pool
    from shared.cache.kv_pool import as_bytes
    from tests.cache._cuda_standin import FakeCuda

    cuda = FakeCuda()
    monkeypatch.setattr(host_pool, "torch", cuda.torch_namespace())
    monkeypatch.setattr(host_pool, "to_device", cuda.to_device)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: cuda.is_pinned(t))

    def build(dtype, head_dim):
        pool = KVPool(LAYERS, 2, head_dim, 32, 1, dtype, "cpu")
        pool.device = torch.device("cuda", 1)
        cuda.mark_device(pool.kv_buffer)
        monkeypatch.setattr(host_pool, "STAGING_BYTES", 3 * HostKVPool.token_bytes(pool))
        host = HostKVPool(pool, 64)
        assert host.bytes_per_token == 2 * LAYERS * 2 * head_dim * dtype.itemsize
        cuda.track(host.buffer, "host", host.bytes_per_token)
        for k, stages in host._staging.items():
            for i, stage in enumerate(stages):
                assert stage.shape[0] == 3 and stage.dtype == host.buffer.dtype
                cuda.track(stage, f"{k} staging {i}", host.bytes_per_token)
        assert all(s.device == pool.device for s in cuda.streams[1:])  # the rank's own GPU
        return pool, as_bytes(pool.kv_buffer), host

    yield cuda, build
    import gc

    gc.collect()  # a pool left over is unpinned while the stand-in is in place


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float8_e4m3fn, 96)])
def test_cuda_copies_are_ordered_on_their_streams_and_pinned(cuda_standin, dtype, head_dim):
    """The CUDA path, on the stand-in: a write reads the KV the queued pass writes only after it (write-through of
    a leaf its pass is still computing), the staging buffers are refilled only once their previous chunk moved on,
    a load's slots are read by the next pass only after the load the host saw complete, every host-device copy is
    non_blocking from or into pinned memory, and a pool dropped with a copy in flight is unpinned only after it."""
    import gc

    from tests.cache._cuda_standin import Recorder

    cuda, build = cuda_standin
    pool, kv, host = build(dtype, head_dim)
    src = np.array([5, 9, 10, 11, 20, 2, 31], np.int64)  # 3 chunks: both staging buffers reused
    hslots = np.array([1, 2, 3, 20, 21, 50, 7], np.int64)  # runs and singles
    dst = np.array([30, 3, 4, 12, 13, 14, 15], np.int64)
    with Recorder(cuda, kv):
        kv.index_copy_(1, torch.from_numpy(src), torch.randint(0, 100, (2 * LAYERS, 7, 2, head_dim)).to(kv.dtype))
        # (a pass, queued on the compute stream)
        want = kv[:, src].clone()
        cuda.complete = False
        write = host.write(src, hslots)
        assert not write.query()
        cuda.complete = True
        assert write.query()  # the engine reuses the device slots once it sees the copy complete
        kv.index_copy_(1, torch.from_numpy(src), torch.zeros_like(want))
        load = host.load(hslots, dst)
        load.synchronize()
        assert load.seconds() == 0.0
        kv.index_select(1, torch.from_numpy(dst))  # the next pass's attention reads the loaded slots
        cuda.complete = False
        host.write(dst, hslots + 1)  # still in flight when the pool goes
    assert torch.equal(kv[:, dst], want)
    assert not cuda.races, cuda.races
    assert not cuda.bad_copies, cuda.bad_copies
    assert cuda.registered
    del host, write, load
    gc.collect()
    assert not cuda.registered and not cuda.unpinned_in_flight, cuda.unpinned_in_flight


def test_cuda_transfer_failing_midway_ends_its_queued_chunks_first(cuda_standin, monkeypatch):
    """A transfer that fails after queuing some chunks returns (raises) only once they ended: its caller frees its
    slots at once (load_back: the device slots, to the next request; a failed write: the host slots)."""
    import shared.cache.host_pool as host_pool
    from tests.cache._cuda_standin import Recorder

    cuda, build = cuda_standin
    pool, kv, host = build(torch.bfloat16, 64)
    runs, calls = host_pool._runs, []

    def failing(slots):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory")
        return runs(slots)

    monkeypatch.setattr(host_pool, "_runs", failing)
    cuda.complete = False
    with Recorder(cuda, kv), pytest.raises(RuntimeError):
        host.load(np.arange(1, 8, dtype=np.int64), np.arange(10, 17, dtype=np.int64))
    assert len(calls) == 2 and cuda.all_ended()


def test_tp_follower_copies_are_waited_for_on_the_device(cuda_standin):
    """A tensor-parallel follower's copies on the stand-in: once rank 0 saw a copy complete, what the follower queues
    next (on its compute stream) comes after its own copy of it, which it never waited for on the host."""
    from shared.cache.host_pool import FollowerHostTier
    from tests.cache._cuda_standin import Recorder

    cuda, build = cuda_standin
    pool, kv, host = build(torch.bfloat16, 64)
    follower = FollowerHostTier(host)
    src, hslots, dst = (np.array(x, np.int64) for x in ([5, 6, 7, 8], [1, 2, 3, 4], [20, 21, 22, 23]))
    cuda.complete = False
    with Recorder(cuda, kv):
        kv.index_copy_(1, torch.from_numpy(src), torch.ones(2 * LAYERS, 4, 2, 64, dtype=kv.dtype))
        follower.copy("write", 1, src, hslots)
        follower.done(1)
        kv.index_copy_(1, torch.from_numpy(src), torch.zeros(2 * LAYERS, 4, 2, 64, dtype=kv.dtype))  # slots reused
        follower.copy("load", 2, dst, hslots)
        follower.done(2)
        kv.index_select(1, torch.from_numpy(dst))
    assert not cuda.races, cuda.races
    assert torch.equal(kv[:, dst], torch.ones(2 * LAYERS, 4, 2, 64, dtype=kv.dtype))
    for pair in host._streams.values():
        for stream in pair:
            stream.synchronize()


@pytest.mark.gpu
def test_cuda_copies_round_trip_in_chunks(monkeypatch):
    import shared.cache.host_pool as host_pool

    monkeypatch.setattr(host_pool, "STAGING_BYTES", 3 * 2 * LAYERS * 8 * 64 * 2)  # 3 tokens a chunk
    pool = KVPool(LAYERS, 8, 64, 64, 1, torch.bfloat16, "cuda")
    host = HostKVPool(pool, 64)
    assert host.buffer.is_pinned()
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_()
    want = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    src = np.array([5, 9, 10, 11, 40, 2, 33], dtype=np.int64)
    hslots = np.array([1, 2, 3, 20, 21, 50, 7], dtype=np.int64)  # runs and singles
    event = host.write(src, hslots)
    assert event is not None
    event.synchronize()
    dst = np.array([60, 3, 4, 12, 13, 14, 15], dtype=np.int64)
    event = host.load(hslots, dst)
    event.synchronize()
    for got, ref in zip(pool.k_buffers + pool.v_buffers, want):
        assert torch.equal(got[torch.from_numpy(dst).cuda()], ref[torch.from_numpy(src).cuda()])


@pytest.mark.parametrize("policy,page_size", [("write_through", 1), ("write_back", 2),
                                              ("write_through_selective", 1)])
def test_random_workload_keeps_kv_right_and_leaks_nothing(policy, page_size):
    """Conversations that grow and branch through small pools: every device hit reads the KV computed for its
    tokens, and both pools' slots are the tree's and nothing else's."""
    import random

    rng = random.Random(7)
    pool, alloc, cache = make(device_tokens=48, host_tokens=96, page_size=page_size, policy=policy)
    roots = [[rng.randrange(1, 50) for _ in range(8)] for _ in range(4)]
    histories = [list(r) for r in roots]
    for _ in range(150):
        k = rng.randrange(len(histories))
        if rng.random() < 0.2:  # a branch off an earlier point of a history
            histories.append(histories[k][:rng.randrange(1, len(histories[k]) + 1)])
            k = len(histories) - 1
        h = histories[k]
        h.extend(rng.randrange(1, 50) for _ in range(rng.randrange(1, 8)))
        if len(h) > 40:
            histories[k] = h = list(roots[k % len(roots)])
        tokens = h[:len(h) - len(h) % page_size]
        if not tokens:
            continue
        compute(pool, alloc, cache, tokens)
        assert check_kv(pool, cache, tokens) == len(tokens)
    assert cache.stats()["host_hit_tokens"] > 0
    no_leak(alloc, cache)


class CompletesWhileAsked(Pending):
    """A copy that, once armed, completes right after a query has reported it pending (a CUDA event can, between
    two queries)."""
    armed = False

    def query(self):
        if self.armed and not self.done:
            self.done = True
            return False
        return self.done


def test_copy_completing_between_two_queries_frees_its_slots():
    """The slots a dropped write or an abandoned load still held come back once the copy is seen complete, even when
    it completes during the poll that frees another's (seen pending, then done): it was dropped from the list
    unfreed, a leak of host or device slots for good."""
    pool, alloc, cache = make()
    events = [Pending(), CompletesWhileAsked()]
    real_write = cache.host.write
    issued = iter(events)
    cache.host.write = lambda d, h: real_write(d, h) or next(issued)
    a, b = list(range(100, 108)), list(range(200, 208))
    compute(pool, alloc, cache, a)
    cache.poll()  # a's copy is issued: one transfer each
    compute(pool, alloc, cache, b)
    assert cache.evict(16) == 16  # write-through: copies still on the way are dropped, their host slots freed later
    events[0].done = events[1].armed = True
    cache.poll()
    cache.poll()
    assert cache.host_allocator.used_size() == 0
    no_leak(alloc, cache)

    pool, alloc, cache = make()
    compute(pool, alloc, cache, a)
    compute(pool, alloc, cache, b)
    assert cache.evict(16) == 16  # both host-only
    events = [Pending(), CompletesWhileAsked()]
    real_load = cache.host.load
    issued = iter(events)
    cache.host.load = lambda h, d: real_load(h, d) or next(issued)
    cache.load_timeout = 0.0
    for x in (a, b):
        op = cache.load_back(cache.match_prefix(x))
        assert cache.load_ready(op) and op.state == "failed"  # past the timeout: its device slots wait for the copy
        cache.release_load(op)
    events[0].done = events[1].armed = True
    cache.poll()
    cache.poll()
    assert alloc.used_size() == 0
    no_leak(alloc, cache)


def test_match_whose_load_cannot_start_stays_counted():
    """A match reaching host-only KV that cannot be loaded (no device room) is a miss of the host part: its query
    and device hit count once, as any match's (they were taken back as if a later match would count them)."""
    pool, alloc, cache, a = host_only()
    taken = alloc.alloc(alloc.available_size())  # every device slot in use elsewhere
    before = cache.stats()
    match = cache.match_prefix(a)
    assert match.host is not None and cache.load_back(match) is None
    after = cache.stats()
    assert after["query_tokens"] - before["query_tokens"] == len(a)
    assert after["hit_tokens"] == before["hit_tokens"]
    alloc.free(taken)
    no_leak(alloc, cache)
