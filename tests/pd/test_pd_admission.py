"""The decode side of PD never refuses a request that fits its pool alone. Slots reserved for prompts
whose pages are on the way are held only for a moment: admission counts what those requests will decode
(as it counts running ones), and a running request short of a decode slot while such slots are held
waits in the queue (retracted, its work kept in the tree) instead of ending with "does not fit"."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from shared.protocol import Transfer
from tests.engine.test_scheduler import make_req, make_sched, step
from tests.pd.test_pd import assert_no_kv_held
from tests.support.stack import Stack


def decode_side_req(tokens, tid, max_new=200):
    r = make_req(tokens, max_new=max_new)
    r.transfer = Transfer(role="decode", id=tid)
    r.kv_offered = True  # its prefill worker has committed
    return r


def arrive(s, req):
    """The pages came (DecodeSide.arrived, without the model): it decodes from here on."""
    assert s.decode_stages.arrived(req.transfer_id) is req or s.decode_stages.reserved.pop(req.transfer_id)
    req.transfer = None
    s.kv_arrived(req)
    req.output_ids.append(1000 + req.seq_len)  # the first token, sampled by the prefill side


def test_running_request_short_of_a_slot_while_transfers_hold_the_pool_waits_and_finishes():
    # Optimistic reservation (ratio 0): admission alone cannot keep the pool from running dry.
    s = make_sched(pool_tokens=512, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    done = []
    local = make_req(list(range(1000, 1100)), max_new=200)
    s.add(local)
    step(s, done)
    a, b = decode_side_req(list(range(2000, 2200)), "ta"), decode_side_req(list(range(3000, 3200)), "tb")
    s.add(a)
    s.add(b)
    for _ in range(400):
        if not s.waiting or s.failed or local not in s.running:
            break
        step(s, done)
    assert s.decode_stages.holding() == [a, b]  # both reserved: the pool is now held by their transfers
    for _ in range(40):  # `local` decodes until the pool runs dry under it
        step(s, done)
    assert s.failed == [], "a request that fits the pool alone was refused"
    assert local in s.waiting and s.stats.retractions >= 1
    arrive(s, a)
    arrive(s, b)
    for _ in range(5000):
        if len(done) == 3:
            break
        step(s, done)
    assert sorted(len(r.output_ids) for r in done) == [200, 200, 200] and not s.failed
    assert s.allocator.available_size() + s.cache.evictable_size() == 512


def test_admission_counts_the_decode_tokens_of_requests_whose_pages_are_on_the_way():
    s = make_sched(pool_tokens=512, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    a, b = decode_side_req(list(range(2000, 2100)), "ta"), decode_side_req(list(range(3000, 3100)), "tb")
    s.add(a)
    assert s.schedule() is None and s.decode_stages.holding() == [a]
    s.add(b)
    # 100 + 200 for `a` and 100 + 200 for `b` do not fit 512: `b` waits until `a` is done.
    assert s.schedule() is None and s.waiting == [b] and s.decode_stages.holding() == [a]


@pytest.mark.e2e
def test_pd_with_a_512_token_pool_refuses_no_fitting_request():
    """64 concurrent requests of 100 prompt + 100 output tokens, two rounds (the second over a tree full
    of the first's pages, so admission evicts), on a 512-token pool, with the reservation ratio where a
    long run decays it to (so admission is as optimistic as after warm-up): every one queues and
    completes, none is refused, no KV is held after. The scheduler's fix itself is pinned by the two
    tests above (both fail without it); this stack run passed ten rounds on the unfixed scheduler too,
    so it was cut from ten rounds to two."""
    s = Stack("--topology", "pd", "--max-total-tokens", "512", "--init-new-token-ratio", "0.1",
              "--min-new-token-ratio", "0.1")

    def one(i: int, r: int) -> tuple[int, str]:
        ids = [(7 * i + 13 * r + k) % 200 + 10 for k in range(100)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0.7}}
        resp = requests.post(s.url + "/generate", json=body, timeout=240)
        return resp.status_code, resp.text[:200]

    try:
        failed = []
        for r in range(2):
            with cf.ThreadPoolExecutor(64) as ex:
                failed += [x for x in ex.map(lambda i: one(i, r), range(64)) if x[0] != 200]
        assert not failed, f"{len(failed)} of 128 requests failed, e.g. {failed[:2]}"
        assert_no_kv_held(s.url)
    finally:
        s.stop()
