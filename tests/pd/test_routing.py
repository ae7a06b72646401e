"""PD routing decisions at the gateway, without processes: N prefill : M decode pairing by each side's
cache hit and load, the short-suffix bypass (a decode worker that holds all but a short suffix of the
prompt computes it itself), and replacement picks after a failure."""
from __future__ import annotations

from services.gateway.cache_aware import CacheAwarePolicy
from services.gateway.router import Router
from tests.gateway.test_worker_client import StubWorker


def fleet(bypass: int = 8):
    ps = [StubWorker(f"p{i}:1", role="prefill") for i in range(2)]
    ds = [StubWorker(f"d{i}:1", role="decode") for i in range(2)]
    return ps, ds, Router([*ps, *ds], CacheAwarePolicy(block_tokens=4, slack=2), pd_bypass_tokens=bypass)


def test_pairs_follow_each_sides_cache_hit_until_load_says_otherwise():
    ps, ds, router = fleet()
    a = list(range(100, 164))
    p, d = router.pick_pair(a)
    # A prompt sharing a's head (a long new tail: no bypass) goes to the same pair: both trees hit.
    assert router.pick_pair(a[:48] + list(range(500, 540))) == (p, d)
    # The decode side that holds it is now far busier than the other: load wins on that side only.
    d.load = 10
    p2, d2 = router.pick_pair(a[:48] + list(range(600, 640)))
    assert p2 is p and d2 is not d


def test_short_suffix_goes_to_the_decode_worker_alone():
    ps, ds, router = fleet(bypass=8)
    turn1 = list(range(10, 74))
    p, d = router.pick_pair(turn1)
    assert p is not None
    output = list(range(300, 320))
    router.remember(d, turn1 + output[:-1])  # what the decode worker's tree holds after turn 1
    turn2 = turn1 + output + [7, 8, 9]
    assert router.pick_pair(turn2) == (None, d)  # all but a few tokens held there: no prefill worker
    # A long new suffix still goes through a prefill worker (to the same decode worker).
    p3, d3 = router.pick_pair(turn1 + output + list(range(900, 940)))
    assert p3 is not None and d3 is d
    # Never for a prompt nobody has seen, however short, nor with the bypass off.
    assert router.pick_pair([1, 2, 3])[0] is not None
    _, _, off = fleet(bypass=0)
    off.pick_pair(turn1)
    assert off.pick_pair(turn1)[0] is not None


def test_replacement_picks_skip_failed_and_disconnected_workers():
    ps, ds, router = fleet()
    assert router.pick_side("decode", [1, 2, 3, 4], exclude={"d0:1"}) is ds[1]
    ds[1].connected = False
    assert router.pick_side("decode", [1, 2, 3, 4], exclude={"d0:1"}) is None
    assert router.pick_side("prefill", [1, 2, 3, 4], exclude={"p1:1"}) is ps[0]
    assert router.pick_side("prefill", [1, 2, 3, 4], exclude={"p0:1", "p1:1"}) is None


def test_pairs_only_workers_whose_kv_pages_fit(caplog):
    """A prefill worker is paired only with decode workers of its KV format (layout and --kv-cache-dtype); a decode
    worker no prefill worker fits computes its requests whole (one warning a pair of formats); replacement picks
    keep to the other side's format, and a worker that does not say its format fits any."""
    bf, f8 = "2x2x2x16 float32", "2x2x2x16 float8_e4m3fn"
    ps = [StubWorker("p0:1", role="prefill", kv_format=bf), StubWorker("p1:1", role="prefill", kv_format=f8)]
    ds = [StubWorker("d0:1", role="decode", kv_format=bf), StubWorker("d1:1", role="decode", kv_format=f8)]
    router = Router([*ps, *ds], CacheAwarePolicy(block_tokens=4, slack=2))
    for i in range(40):
        p, d = router.pick_pair(list(range(i, i + 20)))
        assert p.kv_format == d.kv_format
    assert router.pick_side("prefill", [1, 2], peer=ds[1]) is ps[1]
    assert router.pick_side("decode", [1, 2], peer=ps[0]) is ds[0]
    assert router.pick_side("decode", [1, 2], exclude={"d0:1"}, peer=ps[0]) is None
    only = Router([ps[0], ds[1]], CacheAwarePolicy(block_tokens=4, slack=2))
    with caplog.at_level("WARNING", logger="services.gateway.router"):
        assert only.pick_pair([5, 6, 7]) == (None, ds[1])
        assert only.pick_pair([8, 9, 10]) == (None, ds[1])
    assert sum("--kv-cache-dtype" in r.getMessage() for r in caplog.records) == 1
    unknown = StubWorker("p2:1", role="prefill")
    assert Router([unknown, ds[1]]).pick_pair([5, 6, 7]) == (unknown, ds[1])


def test_remember_reuses_the_prompt_chain_and_matches_a_full_hash():
    """At a request's end the routing index takes prompt + output; the prompt's block names, computed
    when it was routed, are reused and only the output's blocks hashed: the same names as hashing it all."""
    from services.gateway.cache_aware import CacheAwarePolicy, block_chain

    class W:
        address, load = "w:1", 0

    policy = CacheAwarePolicy(block_tokens=4)
    prompt = list(range(10, 31))  # 5 full blocks and a partial one
    output = list(range(500, 511))
    w = W()
    policy.pick([w], prompt, "salt")
    assert id(prompt) in policy._in_flight
    policy.remember(w, prompt + output, "salt", prompt=prompt)
    assert id(prompt) not in policy._in_flight  # taken back at the end
    full = block_chain(prompt + output, 4, "salt")
    assert len(full) == 8 and policy._index_of(w).match(full) == len(full)
    assert block_chain(prompt + output, 4, "salt", known=block_chain(prompt, 4, "salt")) == full
    # Another tenant's salt never reuses this prompt's names.
    assert block_chain(prompt + output, 4, "other", known=None) != full
