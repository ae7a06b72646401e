"""The engine with the host KV tier (--enable-hierarchical-cache) on the tiny model, on the CPU."""
import random

import pytest
import torch

from shared.cache.host_pool import HostTierError
from shared.engine.cli import engine_flag_error
from shared.engine.config import EngineConfig
from shared.engine.engine_loop import Engine
from tests.support.engine_harness import Harness, tokenizer

POOL = 128  # device tokens: two of the prompts below do not fit at once


def prompts(seed=0, n=3, length=100):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(n)]


def test_resent_prompt_after_eviction_is_served_from_host():
    resent_prompt_is_served_from_host()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_resent_prompt_is_served_from_host_on_cuda(policy):
    """The CUDA path: pinned host pool, copies on their own streams, loads polled by event."""
    resent_prompt_is_served_from_host(device="cuda", hicache_write_policy=policy)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tp_ranks_each_serve_their_shard_from_host(policy):
    """Tensor parallelism (2 ranks over gloo): each rank keeps its KV heads in a host pool of its own and makes rank
    0's copies at the same slots (write-back's at eviction, before the pass that reuses the slots); the output is
    the single-rank, tier-off engine's."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on the GPU needs 2 GPUs")
    resent_prompt_is_served_from_host(tp_size=2, hicache_write_policy=policy)
    if policy != "write_through":
        return
    with pytest.raises(HostTierError, match="a rank × 2 ranks"):  # the sizes are per rank: the ranks' sum is checked
        Engine(EngineConfig(dtype="float32", max_total_tokens=POOL, enable_hierarchical_cache=True, tp_size=2,
                            hicache_size=10**6), tokenizer(), lambda outs: None)
    from shared.models import parallel

    assert parallel.tp_size() == 1  # the refused engine's other rank was stopped with it


def resent_prompt_is_served_from_host(**cfg):
    ps = prompts()
    greedy = {"sampling": {"max_new_tokens": 4, "temperature": 0.0}}
    ref = Harness(max_total_tokens=POOL, **{k: v for k, v in cfg.items() if k == "device"})
    want = [ref.generate(p, **greedy)["ids"] for p in ps + ps[:1]]

    h = Harness(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=4.0, **cfg)
    try:
        check_served_from_host(h, ps, greedy, want, h.engine.runner.device.type == "cuda")
    finally:
        h.engine.stop()


def check_served_from_host(h, ps, greedy, want, cuda):
    got = [h.generate(p, **greedy) for p in ps]  # the first prompt's KV is evicted from the device to the host
    stats = h.engine.cache.stats()
    assert stats["host_hit_tokens"] == 0
    again = h.generate(ps[0], **greedy)
    stats = h.engine.cache.stats()
    assert stats["host_hit_tokens"] >= 90 and stats["bytes_h2d"] > 0 and stats["bytes_d2h"] > 0
    assert again["cached"] >= 90  # counted as a prefix hit at admission
    assert [r["ids"] for r in got] + [again["ids"]] == want
    if not cuda:
        load_in_flight(h, ps, greedy, want[-1])
    info = h.engine.info()["hicache"]
    assert info["host_total_tokens"] == 4 * POOL and info["device_total_tokens"] == POOL
    assert 0 < info["host_used_tokens"] <= 4 * POOL
    # Nothing leaks: the tree holds every used slot of both pools; a flush frees them all.
    assert h.engine.policy.is_idle()
    cache = h.engine.cache
    assert h.engine.allocator.used_size() == sum(len(n.value) for n in cache.nodes() if n.value is not None)
    assert cache.host_allocator.used_size() == stats["host_cached_tokens"]
    assert h.engine.flush_cache()[0]
    assert h.engine.allocator.available_size() == POOL
    assert cache.host_allocator.available_size() == cache.host_allocator.total_size()


class SlowCopy:
    """A copy event (as on CUDA) that completes after some polls."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = -1

    def seconds(self) -> float:
        return 0.001


def load_in_flight(h, ps, greedy, want):
    """On the CPU a load is done at once; with a load that takes a few scheduling rounds the request waits for it
    (other work goes on) and is then served from the host tier all the same."""
    cache = h.engine.cache
    [h.generate(p, **greedy) for p in ps[1:]]  # the first prompt leaves the device again
    real = cache.host.load
    cache.host.load = lambda hs, ds: real(hs, ds) or SlowCopy(3)
    try:
        before = cache.stats()["host_hit_tokens"]
        rid = h.submit(ps[0], **greedy)
        waited = 0
        for _ in range(1000):
            if h.done(rid):
                break
            h.engine.step()
            waited += cache.stats()["loads_in_flight"]
        assert h.result(rid)["ids"] == want
        assert waited >= 2 and cache.stats()["host_hit_tokens"] - before >= 90
    finally:
        cache.host.load = real


def test_flags_that_cannot_work_are_refused():
    bad = EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    assert "disable-radix-cache" in engine_flag_error(bad)
    assert engine_flag_error(EngineConfig(enable_hierarchical_cache=True, tp_size=2)) is None
    assert engine_flag_error(EngineConfig(enable_hierarchical_cache=True, hicache_ratio=0)) is not None
    assert engine_flag_error(EngineConfig(enable_hierarchical_cache=True)) is None
    with pytest.raises(HostTierError, match="disable-radix-cache"):
        Engine(EngineConfig(dtype="float32", max_total_tokens=POOL, enable_hierarchical_cache=True,
                            disable_radix_cache=True), tokenizer(), lambda outs: None)
    with pytest.raises(HostTierError, match="available"):  # a petabyte of host memory
        Engine(EngineConfig(dtype="float32", max_total_tokens=POOL, enable_hierarchical_cache=True,
                            hicache_size=10**6), tokenizer(), lambda outs: None)


def test_load_past_the_timeout_in_a_full_pool_is_recomputed():
    """A load that outlives --hicache-load-timeout keeps its device slots until its copy ends. In a pool too small
    to admit the request beside them, the request waits for them (it is not failed as larger than the pool), and
    then recomputes its prefix rather than loading it again (a load past the timeout once would mostly be again)."""
    ps = prompts()
    greedy = {"sampling": {"max_new_tokens": 4, "temperature": 0.0}}
    want = Harness(max_total_tokens=POOL).generate(ps[0], **greedy)["ids"]
    h = Harness(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_load_timeout=1e-4)
    cache = h.engine.cache
    [h.generate(p, **greedy) for p in ps]  # the first prompt's KV is on the host only
    real = cache.host.load
    cache.host.load = lambda hs, ds: real(hs, ds) or SlowCopy(20)
    try:
        got = h.generate(ps[0], **greedy)
    finally:
        cache.host.load = real
    assert got["error"] is None and got["ids"] == want
    stats = cache.stats()
    assert stats["load_failures"] == 1 and stats["host_hit_tokens"] == 0 and got["cached"] == 0
    assert h.engine.allocator.used_size() == sum(len(n.value) for n in cache.nodes() if n.value is not None)
    assert cache.host_allocator.used_size() == stats["host_cached_tokens"]
    h.engine.stop()


def test_prefix_loaded_for_a_queued_request_does_not_crowd_out_another():
    """A prefix the host tier brought back stays locked until its request is admitted. A request ordered before
    that one (a longer device prefix) that does not fit beside it is not failed as larger than the pool: the
    loaded prefix is let go (evictable) and both run, with the outputs of a pool without the tier."""
    rng = random.Random(3)
    w, filler, shared = ([rng.randrange(5, 500) for _ in range(n)] for n in (40, 50, 60))
    b = shared + [rng.randrange(5, 500) for _ in range(50)]
    greedy = {"sampling": {"max_new_tokens": 4, "temperature": 0.0}}
    ref = Harness(max_total_tokens=POOL)
    want = [ref.generate(p, **greedy)["ids"] for p in (w, b)]
    h = Harness(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=4.0)
    cache = h.engine.cache
    for p in (w, filler, shared):  # w's KV is evicted to the host
        h.generate(p, **greedy)
    copy = SlowCopy(10**9)
    real = cache.host.load
    cache.host.load = lambda hs, ds: real(hs, ds) or copy
    try:
        rids = [h.submit(w, **greedy)]
        h.engine.step()  # w's prefix is on the way back (the filler's KV made room)
        rids.append(h.submit(b, **greedy))
        h.engine.step()  # b waits for the load's slots
        assert cache.stats()["loads_in_flight"] == 1 and len(h.engine.policy.waiting) == 2
        copy.synchronize()
        got = h.run(rids)
    finally:
        cache.host.load = real
    assert [r["error"] for r in got] == [None, None] and [r["ids"] for r in got] == want
    assert h.engine.allocator.used_size() == sum(len(n.value) for n in cache.nodes() if n.value is not None)
    h.engine.stop()


def conversations(seed=0, n=5, turns=4):
    """Each conversation's user turns (token ids): a first message, then shorter follow-ups."""
    rng = random.Random(seed)
    return [[[rng.randrange(5, 400) for _ in range(60 if t == 0 else 25)] for t in range(turns)] for _ in range(n)]


def chat(h, convs, sampling):
    """Every conversation's turns, the turns of all conversations at once; each prompt is the history so far
    (earlier prompts and answers) and the next user turn. Returns every answer."""
    history, answers = [[] for _ in convs], []
    for t in range(len(convs[0])):
        sent = [history[i] + c[t] for i, c in enumerate(convs)]
        for i, r in enumerate(h.run([h.submit(p, sampling=sampling) for p in sent])):
            assert r["error"] is None, r["error"]
            history[i] = sent[i] + r["ids"]
            answers.append(r["ids"])
    return answers


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_conversations_outgrowing_the_pool_with_copies_as_slow_as_on_cuda(policy):
    """Multi-turn conversations whose histories together outgrow a small device pool, each host copy (load or
    write) completing a few scheduling rounds after it starts, as on CUDA, and some loads past a tiny timeout:
    the answers are those of a pool without the tier; prefixes come back from the host; no slot of either pool
    is leaked (the tree holds every used one, a flush frees them all)."""
    convs, sampling = conversations(), {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    want = chat(Harness(max_total_tokens=256), convs, sampling)
    h = Harness(max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=1.5, hicache_write_policy=policy)
    cache, rng = h.engine.cache, random.Random(1)
    real_load, real_write = cache.host.load, cache.host.write
    cache.host.load = lambda hs, ds: real_load(hs, ds) or SlowCopy(rng.randrange(8))
    cache.host.write = lambda ds, hs: real_write(ds, hs) or SlowCopy(rng.randrange(8))
    assert chat(h, convs, sampling) == want
    assert cache.stats()["host_hit_tokens"] > 0
    cache.load_timeout = 0.0  # every load from now on is abandoned: the prefixes are recomputed
    assert chat(h, conversations(seed=2, n=3, turns=3), sampling) == chat(Harness(max_total_tokens=256),
                                                                         conversations(seed=2, n=3, turns=3), sampling)
    for _ in range(20):  # the last copies end
        cache.poll()
    assert h.engine.allocator.used_size() == sum(len(n.value) for n in cache.nodes() if n.value is not None)
    assert cache.host_allocator.used_size() == cache.stats()["host_cached_tokens"]
    assert not any(n.lock_ref for n in cache.nodes())
    assert h.engine.flush_cache()[0]
    assert h.engine.allocator.available_size() == 256
    assert cache.host_allocator.available_size() == cache.host_allocator.total_size()
    h.engine.stop()


def test_requests_leaving_while_their_prefix_loads():
    """Two requests wait on one load (the second joins the first's); both are aborted before it completes, then a
    third matches the same prefix once it has: it is served from the device, and nothing stays locked or leaks."""
    ps, greedy = prompts(), {"sampling": {"max_new_tokens": 4, "temperature": 0.0}}
    want = Harness(max_total_tokens=POOL).generate(ps[0], **greedy)["ids"]
    h = Harness(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=4.0)
    cache = h.engine.cache
    [h.generate(p, **greedy) for p in ps]  # the first prompt's KV is on the host only
    copy = SlowCopy(10**9)
    real = cache.host.load
    cache.host.load = lambda hs, ds: real(hs, ds) or copy
    try:
        waiting = [h.submit(ps[0], **greedy) for _ in range(2)]
        h.engine.step()
        assert cache.stats()["loads_in_flight"] == 1 and cache._loads[0].holders == 2
        for rid in waiting:
            h.engine.abort(rid)
        h.engine.step()
        assert h.engine.policy.is_idle() and [h.result(r)["finish"]["type"] for r in waiting] == ["abort"] * 2
        copy.synchronize()
        got = h.generate(ps[0], **greedy)
    finally:
        cache.host.load = real
    assert got["ids"] == want and got["cached"] >= 90 and cache.stats()["load_failures"] == 0
    assert not any(n.lock_ref for n in cache.nodes())
    assert h.engine.allocator.used_size() == sum(len(n.value) for n in cache.nodes() if n.value is not None)
    assert h.engine.flush_cache()[0] and h.engine.allocator.available_size() == POOL
    h.engine.stop()
