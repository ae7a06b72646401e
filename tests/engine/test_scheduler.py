"""SchedulePolicy behaviour without a model: a simulated engine drives schedule() and releases."""
from __future__ import annotations

import itertools
import random

import pytest

from shared.cache.allocator import SlotAllocator
from shared.cache.kv_pool import ReqToTokenPool
from shared.cache.no_cache import NoPrefixCache
from shared.cache.radix_cache import RadixCache
from shared.engine.config import EngineConfig
from shared.models.forward_batch import ForwardMode
from shared.engine.prefill_adder import MAX_SIBLING_DEFERRALS
from shared.engine.request import Req
from shared.engine.schedule_policy import SchedulePolicy
from shared.engine.sizing import CPU_SIZES, Sizes, fill
from shared.protocol import Transfer
from shared.sampling_params import SamplingParams

_ids = itertools.count()


def make_sched(pool_tokens=4096, page_size=1, radix=True, **cfg):
    config = fill(EngineConfig(page_size=page_size, **cfg), Sizes(*CPU_SIZES))  # unset sizes: the CPU's
    alloc = SlotAllocator(pool_tokens // page_size, page_size)
    cache = (RadixCache if radix else NoPrefixCache)(alloc, page_size)
    req_pool = ReqToTokenPool(config.max_running_requests, 2048, "cpu")
    return SchedulePolicy(config, cache, alloc, req_pool, max_context_len=2048)


def make_req(tokens, max_new=4, t=None):
    r = Req(rid=f"r{next(_ids)}", input_ids=list(tokens), params=SamplingParams(max_new_tokens=max_new), seed=0)
    if t is not None:
        r.arrival_time = t
    return r


def step(s: SchedulePolicy, finished: list):
    """One engine step with a fake model: token = position, finish at max_new_tokens."""
    batch = s.schedule()
    if batch is None:
        return None
    assert len(batch.out_cache_loc) == sum(batch.extend_lens)
    for i, req in enumerate(batch.reqs):
        assert batch.prefix_lens[i] == req.kv_len
        assert len(req.slots) == req.kv_len + batch.extend_lens[i]
        req.kv_len += batch.extend_lens[i]
        if batch.sample[i]:
            req.output_ids.append(1000 + req.seq_len)
            if len(req.output_ids) >= req.params.max_new_tokens:
                req.finish_reason = {"type": "length"}
                s.remove(req)
                finished.append(req)
    return batch


def warm_shared_prefix(s: SchedulePolicy, shared: list[int], tail: int = 500) -> list:
    """Run one request of `shared` + [tail] (one new token) to completion, so `shared` is in the tree;
    returns the list of finished requests (the warm one) for the test's later steps."""
    done = []
    s.add(make_req(shared + [tail], max_new=1))
    while not done:
        step(s, done)
    return done


def accounted(s: SchedulePolicy) -> int:
    # A running request owns its slots beyond the locked cached prefix (those belong to the tree).
    # Pages are the unit of allocation: a partly filled last page is held whole.
    P = s.page_size
    held = sum(len({x // P for x in r.slots[r.cached_len:]}) * P
               for r in s.running + ([s.chunked] if s.chunked else []))
    c = s.cache
    return s.allocator.available_size() + c.evictable_size() + c.protected_size() + held


def test_prefill_then_decode_and_cache_hit():
    s = make_sched()
    total = s.allocator.available_size()
    prompt = list(range(1, 41))
    done = []
    a = make_req(prompt)
    s.add(a)
    b1 = step(s, done)
    assert b1.mode == ForwardMode.EXTEND and b1.extend_lens == [40]
    while not done:
        assert step(s, done).mode == ForwardMode.DECODE
    assert a.num_cached_tokens == 0
    b = make_req(prompt)
    s.add(b)
    batch = step(s, done)
    # The same prompt again: everything but the last token comes from the cache.
    assert b.num_cached_tokens == 39 and batch.extend_lens == [1]
    while len(done) < 2:
        step(s, done)
    assert accounted(s) == total


def test_chunked_prefill_respects_budget():
    s = make_sched(chunked_prefill_size=16, max_prefill_tokens=16)
    done = []
    r = make_req(list(range(1, 101)), max_new=3)
    s.add(r)
    exts = []
    while not done:
        b = step(s, done)
        if b.mode == ForwardMode.EXTEND:
            exts.append(b.extend_lens[0])
            assert b.sample[0] == (sum(exts) == 100)
    assert exts == [16] * 6 + [4]
    assert r.output_ids and len(r.output_ids) == 3


def test_lpm_admits_longest_prefix_first():
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64)
    shared = list(range(1, 61))
    done = warm_shared_prefix(s, shared)
    cold = make_req(list(range(2000, 2060)), t=0.0)  # arrived first, no match
    hot = make_req(shared + [600, 601], t=1.0)
    s.add(cold)
    s.add(hot)
    b = step(s, done)
    assert b.reqs[0] is hot


def test_fcfs_policy_keeps_arrival_order():
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64, schedule_policy="fcfs")
    shared = list(range(1, 61))
    done = warm_shared_prefix(s, shared)
    cold = make_req(list(range(2000, 2060)), t=0.0)
    hot = make_req(shared + [600, 601], t=1.0)
    s.add(cold)
    s.add(hot)
    assert step(s, done).reqs[0] is cold


def test_aging_bounds_starvation():
    """A request with no cache match must not wait forever behind a stream of better-matching ones."""
    bound = 5
    s = make_sched(max_prefill_tokens=40, chunked_prefill_size=40, max_skipped_rounds=bound,
                   max_running_requests=64)
    shared = list(range(1, 33))
    done = warm_shared_prefix(s, shared, tail=7)
    loner = make_req(list(range(3000, 3038)), max_new=2, t=-1.0)
    s.add(loner)
    rounds = 0
    admitted_at = None
    for i in range(200):
        # Keep the queue full of requests that match 32 cached tokens (cheap to admit, LPM prefers them).
        for _ in range(3):
            s.add(make_req(shared + [10_000 + i, 20_000 + i], max_new=2))
        b = step(s, done)
        if b is not None and b.mode == ForwardMode.EXTEND:
            rounds += 1
            if loner in b.reqs:
                admitted_at = rounds
                break
    assert admitted_at is not None, "starved"
    assert admitted_at <= bound + 2


def test_retraction_under_tiny_pool_completes_everything_without_leaks():
    s = make_sched(pool_tokens=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    total = s.allocator.available_size()
    done = []
    reqs = [make_req(list(range(100 * k, 100 * k + 8)), max_new=30, t=float(k)) for k in range(4)]
    for r in reqs:
        s.add(r)
    for _ in range(2000):
        if len(done) == len(reqs):
            break
        step(s, done)
        assert accounted(s) == total
    assert len(done) == 4
    assert all(len(r.output_ids) == 30 for r in reqs)
    assert s.stats.retractions > 0
    # Token stream of a retracted request is unaffected: outputs follow positions.
    for r in reqs:
        assert r.output_ids == [1000 + len(r.input_ids) + i for i in range(30)]
    assert accounted(s) == total and not s.failed


def test_request_larger_than_pool_fails_cleanly():
    s = make_sched(pool_tokens=32)
    done = []
    r = make_req(list(range(1, 60)), max_new=2)
    s.add(r)
    assert step(s, done) is None
    assert s.failed == [r]
    assert s.allocator.available_size() == 32


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("page_size,radix", [(1, True), (4, True), (1, False), (4, False)])
def test_random_workload_never_leaks(page_size, radix, mixed):
    rng = random.Random(page_size * 10 + radix)
    s = make_sched(pool_tokens=256, page_size=page_size, radix=radix, max_prefill_tokens=64,
                   chunked_prefill_size=32, enable_mixed_chunk=mixed)
    total = s.allocator.available_size()
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    done, live = [], []
    for it in range(600):
        if rng.random() < 0.3 and len(live) < 12:
            p = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            r = make_req(p, max_new=rng.randrange(1, 12))
            live.append(r)
            s.add(r)
        if rng.random() < 0.05 and live:
            victim = rng.choice(live)
            if not victim.finished:
                victim.finish_reason = {"type": "abort"}
                s.remove(victim)
                done.append(victim)
        step(s, done)
        live = [r for r in live if not r.finished]
        assert accounted(s) == total
    while not s.is_idle():
        step(s, done)
    assert accounted(s) == total
    if radix:
        s.cache.reset()
        assert s.allocator.available_size() == total


def test_max_running_requests_is_reached_not_undershot():
    s = make_sched(max_running_requests=4)
    done = []
    for k in range(10):
        s.add(make_req(list(range(100 * k + 1, 100 * k + 9)), max_new=50, t=float(k)))
    b = step(s, done)
    assert len(b.reqs) == 4 and s.num_running() == 4
    for _ in range(5):
        assert step(s, done).mode == ForwardMode.DECODE  # full: nothing more is admitted
    assert s.num_running() == 4


# ---------------------------------------------------------------- PD roles
def test_decode_side_reserves_only_offered_requests_and_only_what_its_tree_lacks():
    s = make_sched(pool_tokens=512)
    shared = list(range(10, 110))
    done = []
    local = make_req(shared + [1, 2], max_new=1)
    s.add(local)
    while step(s, done) is not None:
        pass  # the shared head is now in the tree
    a = make_req(shared + [7, 8, 9])
    a.transfer = Transfer(role="decode", id="ta")
    b = make_req(list(range(300, 340)))
    b.transfer = Transfer(role="decode", id="tb")
    s.add(a)
    s.add(b)
    assert s.schedule() is None  # neither prefill side has committed yet: nothing reserved
    assert s.decode_stages.holding() == [] and len(s.waiting) == 2
    a.kv_offered = True
    assert s.schedule() is None  # a reservation computes nothing
    assert s.decode_stages.holding() == [a] and list(s.decode_stages.reserved.values()) == [a]
    assert s.waiting == [b]
    assert a.kv_len == len(shared) and len(a.slots) == len(a.input_ids)  # cached head + reserved rest
    s.decode_stages.expect(a, deadline=0.0)
    assert s.decode_stages.arrived("ta") is a
    s.kv_arrived(a)
    assert a.kv_len == len(a.input_ids) and a in s.running and not s.decode_stages.holding()


def test_prefill_side_parks_computed_prompts_and_a_full_pool_waits_instead_of_failing():
    s = make_sched(pool_tokens=128)
    first = make_req(list(range(10, 110)))  # 100 tokens of a 128-token pool
    first.transfer = Transfer(role="prefill", id="t1")
    second = make_req(list(range(200, 260)))  # fits only once `first` is released
    s.add(first)
    s.add(second)
    batch = s.schedule()
    assert batch.reqs == [first] and s.prefill_stages.admitted == [first]
    first.kv_len += batch.extend_lens[0]
    assert s.prefill_stages.prefilled == [first] and first not in s.running  # never decoded here
    assert s.schedule() is None and s.failed == []  # waits: the parked KV will come back
    s.remove(first)  # the transfer ended
    batch = s.schedule()
    assert batch is not None and batch.reqs == [second]


# ---------------------------------------------------------------- insert at prefill end
def run_until(s, done, cond, limit=500):
    for _ in range(limit):
        if cond():
            return
        step(s, done)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_enters_tree_at_prefill_end_and_siblings_hit_while_it_decodes(page_size):
    s = make_sched(page_size=page_size)
    total = s.allocator.available_size()
    system = list(range(1, 65))
    done = []
    a = make_req(system + [900, 901, 902], max_new=40)
    s.add(a)
    assert step(s, done).reqs == [a]
    step(s, done)  # a decodes; its prompt KV is in the tree, locked by it
    aligned = (len(a.input_ids)) // page_size * page_size
    assert a.cached_len == aligned and s.cache.protected_size() == aligned
    assert s.cache.evictable_size() == 0
    assert accounted(s) == total
    b = make_req(system + [800, 801], max_new=3)
    s.add(b)
    run_until(s, done, lambda: b.num_cached_tokens is not None)
    assert b.num_cached_tokens == len(system) // page_size * page_size
    assert not a.finished  # the hit came while a was still decoding
    run_until(s, done, lambda: a.finished and b.finished)
    assert b.output_ids == [1000 + len(b.input_ids) + i for i in range(3)]
    assert accounted(s) == total and s.cache.protected_size() == 0


def test_in_batch_dedupe_first_computes_siblings_wait_a_round_and_hit():
    s = make_sched()
    system = list(range(1, 101))
    done = []
    group = [make_req(system + [500 + k, 600 + k], max_new=5, t=float(k)) for k in range(4)]
    for r in group:
        s.add(r)
    first = step(s, done)
    assert first.reqs == [group[0]] and first.extend_lens == [102]
    run_until(s, done, lambda: all(r.num_cached_tokens is not None for r in group))
    assert [r.num_cached_tokens for r in group] == [0, 100, 100, 100]
    assert s.stats.cached_tokens == 300 and s.stats.prompt_tokens == 4 * 102
    run_until(s, done, lambda: all(r.finished for r in group))


def computed_tokens(s: SchedulePolicy) -> int:
    return s.stats.prompt_tokens - s.stats.cached_tokens


def test_aged_siblings_still_compute_their_shared_prompt_once():
    """Aging puts long-waiting requests first; it must not make a whole group of them recompute their
    system prompt (on the H200 that cost 3% of the hits with LPM over a 1,024-request queue)."""
    s = make_sched(max_skipped_rounds=0)  # every request counts as aged
    system = list(range(1, 101))
    done = []
    group = [make_req(system + [500 + k, 600 + k], max_new=3, t=float(k)) for k in range(4)]
    for r in group:
        s.add(r)
    assert step(s, done).reqs == [group[0]]
    run_until(s, done, lambda: all(r.finished for r in group))
    assert [r.num_cached_tokens for r in group] == [0, 100, 100, 100]


def test_siblings_of_a_chunked_prompt_wait_for_its_chunks_instead_of_computing_its_rest():
    """A long shared prompt prefilled in chunks: a sibling admitted while it is half done would match
    the first chunk and compute the rest itself. It waits for the chunks instead."""
    s = make_sched(chunked_prefill_size=64, max_prefill_tokens=64)
    system = list(range(1, 257))
    done = []
    first = make_req(system + [900, 901], max_new=2, t=0.0)
    s.add(first)
    step(s, done)  # chunk 1 of 4
    sibs = [make_req(system + [700 + k, 800 + k], max_new=2, t=1.0 + k) for k in range(3)]
    for r in sibs:
        s.add(r)
    run_until(s, done, lambda: all(r.finished for r in [first] + sibs))
    assert [r.num_cached_tokens for r in sibs] == [256, 256, 256]
    assert computed_tokens(s) == 258 + 3 * 2


def test_requests_sharing_uncached_tokens_after_a_cached_prefix_compute_them_once():
    """The dedupe is not only for prompts the tree lacks entirely: two requests on one cached prefix
    whose next 70 tokens are the same (a shared few-shot block) compute those once."""
    s = make_sched()
    system = list(range(1, 61))
    done = warm_shared_prefix(s, system)
    block = list(range(3000, 3070))
    a = make_req(system + block + [11, 12], max_new=2, t=1.0)
    b = make_req(system + block + [21, 22], max_new=2, t=2.0)
    s.add(a)
    s.add(b)
    assert step(s, done).reqs == [a]
    run_until(s, done, lambda: a.finished and b.finished)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (60, 130)


def test_a_request_waits_for_siblings_a_bounded_number_of_rounds():
    s = make_sched()
    system = list(range(1, 101))
    done = []
    a, b = make_req(system + [1, 2], max_new=2, t=0.0), make_req(system + [3, 4], max_new=2, t=1.0)
    b.sibling_deferrals = MAX_SIBLING_DEFERRALS  # it has waited its share
    s.add(a)
    s.add(b)
    assert step(s, done).reqs == [a, b]
    run_until(s, done, lambda: a.finished and b.finished)


def test_without_a_prefix_cache_nobody_waits_for_a_sibling():
    s = make_sched(radix=False)
    system = list(range(1, 101))
    done = []
    group = [make_req(system + [500 + k], max_new=2, t=float(k)) for k in range(3)]
    for r in group:
        s.add(r)
    assert step(s, done).reqs == group


def test_chunked_prefill_inserts_each_chunk():
    s = make_sched(chunked_prefill_size=16, max_prefill_tokens=16)
    done = []
    r = make_req(list(range(1, 61)), max_new=2)
    s.add(r)
    step(s, done)
    step(s, done)  # second chunk scheduled: the first is in the tree now
    assert r.cached_len == 16 and s.cache.protected_size() == 16
    step(s, done)
    assert r.cached_len == 32
    run_until(s, done, lambda: r.finished)
    assert s.cache.protected_size() == 0 and s.cache.evictable_size() >= 60


def test_duplicate_computation_switches_to_the_tree_slots():
    """Two requests computing the same prefix in one pass (too short to dedupe): the second one's copy
    is freed and its rows point at the tree's slots."""
    s = make_sched(max_skipped_rounds=0)
    total = s.allocator.available_size()
    system = list(range(1, 41))
    done = []
    a, b = make_req(system + [1], max_new=6), make_req(system + [2], max_new=6)
    s.add(a)
    s.add(b)
    batch = step(s, done)
    assert batch.reqs == [a, b]
    own_b = list(b.slots[:40])
    step(s, done)
    assert a.slots[:40] == b.slots[:40] != own_b
    row = s.req_pool.req_to_token[b.req_pool_idx, :40].tolist()
    assert row == b.slots[:40]
    assert sum(s.allocator.is_page_free(x) for x in own_b) >= 38  # freed (the decode step took 2)
    assert accounted(s) == total
    run_until(s, done, lambda: a.finished and b.finished)
    assert accounted(s) == total


def test_retraction_keeps_a_sharing_request_s_lock_and_readmission_hits():
    s = make_sched(pool_tokens=128, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    total = s.allocator.available_size()
    system = list(range(1, 61))
    done = []
    a = make_req(system + [1, 2], max_new=40, t=0.0)
    b = make_req(system + [3, 4], max_new=40, t=1.0)
    s.add(a)
    run_until(s, done, lambda: a.cached_len > 0)
    s.add(b)
    run_until(s, done, lambda: b.kv_len > 0 and b.status.value == "running")
    assert b.num_cached_tokens == 60
    for _ in range(400):
        if a.finished and b.finished:
            break
        step(s, done)
        assert accounted(s) == total
    assert s.stats.retractions > 0
    for r in (a, b):
        assert r.output_ids == [1000 + len(r.input_ids) + i for i in range(40)]
    assert accounted(s) == total and s.cache.protected_size() == 0


def test_jump_forward_proposals_stay_out_of_the_tree_and_rollback_frees_only_own_slots():
    s = make_sched()
    total = s.allocator.available_size()
    done = []
    r = make_req(list(range(1, 21)), max_new=50)
    s.add(r)
    step(s, done)
    step(s, done)
    # The grammar proposed 5 forced tokens: the next pass extends them all.
    r.output_ids.extend([7, 7, 7, 7, 7])
    r.proposed = 5
    b = step(s, done)
    assert b.mode == ForwardMode.EXTEND and b.extend_lens == [6]
    s._cache_extended()
    assert r.cached_len == r.seq_len - 5  # confirmed tokens only
    # Two proposals accepted, the rest rejected: their KV goes, the tree's part stays.
    r.proposed = 0
    del r.output_ids[-3:]
    s.truncate_kv(r, r.seq_len)
    assert r.kv_len == r.seq_len and accounted(s) == total
    run_until(s, done, lambda: r.finished)
    assert accounted(s) == total


def test_cache_salts_isolate_inserted_prefixes_and_dedupe():
    s = make_sched()
    system = list(range(1, 65))
    done = []
    a = make_req(system + [1], max_new=30)
    a.cache_salt = "tenant-a"
    s.add(a)
    step(s, done)
    step(s, done)
    other = make_req(system + [2], max_new=2)
    other.cache_salt = "tenant-b"
    same = make_req(system + [3], max_new=2)
    same.cache_salt = "tenant-a"
    s.add(other)
    s.add(same)
    b = step(s, done)
    assert set(b.reqs) == {other, same}  # a different salt is not a sibling: not deferred
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 64
    run_until(s, done, lambda: a.finished and other.finished and same.finished)


def test_no_prefix_cache_is_never_handed_running_kv():
    s = make_sched(radix=False)
    total = s.allocator.available_size()
    done = []
    r = make_req(list(range(1, 41)), max_new=5)
    s.add(r)
    step(s, done)
    step(s, done)
    assert r.cached_len == 0 and not any(s.allocator.is_page_free(x) for x in r.slots)
    run_until(s, done, lambda: r.finished)
    assert s.allocator.available_size() == total


def test_prefill_side_parks_with_its_prompt_in_the_tree():
    s = make_sched(pool_tokens=512)
    system = list(range(10, 74))
    done = []
    p = make_req(system + [1, 2])
    p.transfer = Transfer(role="prefill", id="t1")
    s.add(p)
    batch = s.schedule()
    p.kv_len += batch.extend_lens[0]
    assert s.prefill_stages.prefilled == [p]
    assert s.schedule() is None  # parked: nothing to decode; its prompt entered the tree
    assert p.cached_len == 66 and s.cache.protected_size() == 66
    local = make_req(system + [3, 4], max_new=2)
    s.add(local)
    run_until(s, done, lambda: local.finished)
    assert local.num_cached_tokens == 64
    slots_before = list(p.slots[:66])
    s.remove(p)  # the transfer ended: the prompt stays cached, unlocked
    assert s.cache.protected_size() == 0
    assert s.cache.match_prefix(system + [1, 2]).slots.tolist() == slots_before


def test_decode_side_inserts_received_prompt_so_a_sibling_reserves_only_its_tail():
    s = make_sched(pool_tokens=512)
    system = list(range(10, 74))
    a = make_req(system + [7, 8])
    a.transfer, a.kv_offered = Transfer(role="decode", id="ta"), True
    s.add(a)
    assert s.schedule() is None and s.decode_stages.holding() == [a]
    s.decode_stages.remove(a)  # its pages came
    s.kv_arrived(a)
    assert a.cached_len == 66 and s.cache.protected_size() == 66
    b = make_req(system + [9, 9, 9])
    b.transfer, b.kv_offered = Transfer(role="decode", id="tb"), True
    s.add(b)
    s.schedule()
    assert b in s.decode_stages.holding() and b.kv_len == 64  # the prefill side sends only positions 64..


# ---------------------------------------------------------------- LPM on long queues
@pytest.mark.parametrize("page_size", [1, 4])
def test_lpm_order_with_kept_match_lengths_equals_a_full_rematch(page_size):
    rng = random.Random(5 + page_size)
    s = make_sched(pool_tokens=512, page_size=page_size, max_prefill_tokens=48, chunked_prefill_size=48,
                   max_running_requests=6, lpm_queue_limit=0)  # LPM over the whole queue
    systems = [[rng.randrange(1, 30) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    done, compared = [], 0
    for it in range(300):
        for _ in range(rng.randrange(0, 3)):
            r = make_req(rng.choice(systems) + [rng.randrange(1, 30) for _ in range(rng.randrange(1, 12))],
                         max_new=rng.randrange(1, 8), t=float(it))
            r.cache_salt = rng.choice([None, None, "x"])
            s.add(r)
        ready = list(s.waiting)
        aged = [r for r in ready if r.skipped_rounds >= s.config.max_skipped_rounds]
        rest = [r for r in ready if r not in aged]
        full = {id(r): s.cache.match_prefix(s._match_key(r), r.cache_salt, record=False).length for r in rest}
        want = aged + sorted(rest, key=lambda r: (-full[id(r)], r.arrival_time))
        got = s._order_waiting()
        assert [id(r) for r in got] == [id(r) for r in want]
        compared += len(got)
        step(s, done)
    assert compared > 300


def test_lpm_stays_on_for_a_long_queue():
    """With the queue limit off (lpm_queue_limit=0), LPM orders a 300-request queue; with the default
    limit (128) such a queue is served first come, first served."""
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64, max_running_requests=1024, lpm_queue_limit=0)
    shared = list(range(1, 61))
    done = warm_shared_prefix(s, shared)
    for k in range(300):
        s.add(make_req(list(range(2000 + 100 * k, 2060 + 100 * k)), t=float(k)))
    hot = make_req(shared + [600, 601], t=1e9)  # arrived last, 300 requests ahead of it
    s.add(hot)
    assert step(s, done).reqs[0] is hot


def test_default_queue_limit_serves_long_queues_in_arrival_order():
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64, max_running_requests=1024)
    assert s.config.lpm_queue_limit == 128
    shared = list(range(1, 61))
    done = warm_shared_prefix(s, shared)
    first = make_req(list(range(2000, 2060)), t=0.0)
    s.add(first)
    for k in range(1, 300):
        s.add(make_req(list(range(2000 + 100 * k, 2060 + 100 * k)), t=float(k)))
    s.add(make_req(shared + [600, 601], t=1e9))
    assert step(s, done).reqs[0] is first


@pytest.mark.parametrize("page_size,pool", [(1, 4096), (4, 4096), (1, 600), (4, 640)])
def test_catch_up_rows_taken_at_once_equal_taken_one_by_one(page_size, pool, monkeypatch):
    """Jump-forward catch-up passes take all rows with one allocation (PrefillAdder._take_all); the
    batches, slots and pool are exactly those of one _take per row, also when the pool runs short."""
    from shared.engine.prefill_adder import PrefillAdder

    runs = []
    for at_once in (True, False):
        if not at_once:
            monkeypatch.setattr(PrefillAdder, "_take_all", lambda self, reqs, exts: False)
        rng = random.Random(page_size + pool)
        s = make_sched(pool_tokens=pool, page_size=page_size)
        for i in range(12):
            s.add(make_req([1 + i] + list(range(2, 2 + rng.randint(3, 40))), max_new=60, t=i))
        done, log = [], []
        while len(done) < 12 and len(log) < 400:
            b = step(s, done)
            if b is not None:
                log.append(([r.input_ids[0] for r in b.reqs], b.prefix_lens, b.extend_lens, b.out_cache_loc.tolist()))
            for r in s.running:  # forced runs appended after a sampled token: the next pass catches up
                if rng.random() < 0.3 and len(r.output_ids) + 8 < r.params.max_new_tokens:
                    r.output_ids.extend([7] * rng.randint(2, 8))
        runs.append((log, len(done), s.stats.retractions, s.allocator.free_pages().tolist()))
    assert runs[0] == runs[1] and runs[0][1] == 12


def test_mixed_chunks_running_requests_ride_in_prefill_passes():
    """--enable-mixed-chunk: while prompts are being prefilled, every running request gains its token in
    the prefill pass itself (at the batch's end, one token each, counted against the budget): no decode
    pass between prefill passes. Without it a decode pass follows every prefill pass."""
    for mixed in (False, True):
        s = make_sched(pool_tokens=4096, max_prefill_tokens=64, chunked_prefill_size=64, enable_mixed_chunk=mixed)
        reqs = [make_req(range(100 * i + 1, 100 * i + 41), max_new=6) for i in range(6)]
        for r in reqs:
            s.add(r)
        done, modes = [], []
        while not s.is_idle():
            b = step(s, done)
            modes.append((b.mode, [(r.rid, e) for r, e in zip(b.reqs, b.extend_lens)]))
        assert len(done) == 6 and all(len(r.output_ids) == 6 for r in done)
        kinds = "".join("E" if m is ForwardMode.EXTEND else "D" for m, _ in modes)
        # Each request's passes from its prompt's last chunk on: one token each, none skipped with mixed chunks.
        token_passes = {}
        for i, (_, rows) in enumerate(modes):
            for rid, e in rows:
                if e == 1 or rid in token_passes:
                    token_passes.setdefault(rid, []).append(i)
        gapless = all(p == list(range(p[0], p[0] + len(p))) for p in token_passes.values())
        assert gapless == mixed
        if not mixed:
            assert "EE" not in kinds  # a decode pass after each prefill pass
            continue
        # 6 prompts of 40 tokens through a 64-token budget: prefill passes back to back, then decode.
        assert kinds.startswith("EEEE") and "DE" not in kinds, kinds
        for mode, rows in modes[1:]:
            if mode is ForwardMode.EXTEND:
                ones = [e == 1 for _, e in rows]
                # the riders come last, after every prompt row
                assert ones == sorted(ones) and sum(e for _, e in rows) <= 64


def test_mixed_chunks_never_ride_alone_nor_with_a_solo_request():
    """Riders alone are a decode pass (the CUDA graph's), and a request suspected of failing a step runs
    alone: nobody rides with it."""
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64, enable_mixed_chunk=True)
    a = make_req(range(1, 11), max_new=8)
    s.add(a)
    done = []
    step(s, done)
    b = step(s, done)
    assert b.mode is ForwardMode.DECODE and b.reqs == [a]
    solo = make_req(range(1, 21), max_new=2)
    solo.solo = True
    s.add(solo)
    b = step(s, done)
    assert b.mode is ForwardMode.EXTEND and b.reqs == [solo]
    b = step(s, done)
    assert b.mode is ForwardMode.DECODE and set(map(id, b.reqs)) == {id(a), id(solo)}


def test_a_rider_retracted_during_the_round_does_not_ride():
    """A catch-up pass short of memory retracts running requests during the admission round: a request
    set aside as a rider before that must not be taken (its KV is gone, it waits to be readmitted)."""
    from shared.engine.prefill_adder import PrefillAdder
    s = make_sched(max_prefill_tokens=64, chunked_prefill_size=64, enable_mixed_chunk=True)
    a, b = make_req(range(1, 11), max_new=8), make_req(range(20, 31), max_new=8)
    s.add(a)
    s.add(b)
    done = []
    step(s, done)  # both prefilled, running
    adder = PrefillAdder(s)
    riders = adder.reserve_riders(list(s.running))
    assert riders == [a, b]
    s.add(c := make_req(range(40, 51), max_new=2))
    assert adder.add_waiting(c)
    s._retract(b)
    assert adder.add_riders(riders) == [a]
    batch = adder.batch()
    assert [r.rid for r in batch.reqs] == [c.rid, a.rid] and batch.extend_lens == [11, 1]
