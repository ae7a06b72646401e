"""PD backpressure: each side bounds the bytes of KV buffers its transfers hold outside the pool
(--kv-transfer-max-bytes; shared/pd/stages.py's TransferBudget). Without it a prefill worker whose decode side
accepted slowly kept admitting and gathering prompts (1 GiB per 8k tokens of an 8B model) until its GPU ran out
of memory, and a decode worker allocated a receive buffer for every reservation at once. A transfer beyond the
budget waits in the queue in order; one larger than the whole budget goes alone; none is refused or lost."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from shared.pd.stages import TransferBudget
from shared.protocol import Transfer
from tests.engine.test_scheduler import make_sched
from tests.pd.test_pd_admission import arrive, decode_side_req
from tests.pd.test_pd import assert_no_kv_held, worker_infos
from tests.pd.test_stages import prefill_harness
from tests.support.stack import Stack


def test_budget_accounting():
    b = TransferBudget(max_bytes=100, token_bytes=10)
    assert b.fits("a", 50)  # nothing charged: a transfer larger than the budget goes alone
    b.take("a", 50)
    b.take("a", 50)  # (charged once per transfer)
    assert b.in_flight == 500 and not b.fits("b", 1) and b.fits("a", 50)  # already charged: it may continue
    b.give("a")
    b.give("a")  # idempotent
    assert b.in_flight == 0 and b.fits("b", 6) and b.fits("b", 10)
    b.take("b", 6)
    assert b.fits("c", 4) and not b.fits("c", 5)
    b.take("c", 4)
    assert b.in_flight == 100 and b.peak == 500 and b.waits == 2
    b.give("b")
    b.give("c")
    b.take("d", 8)
    b.shrink("d", 3)  # the decode side wants the last 3 positions only
    b.shrink("d", 5)  # (never grows)
    b.shrink("none", 1)  # (uncharged: nothing)
    assert b.in_flight == 30 and b.peak == 500 and b.fits("e", 7) and not b.fits("e", 8)
    b.give("d")
    assert b.in_flight == 0
    unbounded = TransferBudget(0, 10)
    unbounded.take("x", 1000)
    assert unbounded.fits("y", 1000) and unbounded.stats()["in_flight_bytes"] == 10_000


def prompt(i: int) -> list[int]:
    return [(i * 7 + k) % 200 + 10 for k in range(40)]


def test_prefill_side_admits_transfers_within_its_budget_in_order():
    """A budget of one prompt's pages: the prefill engine admits the next PD prompt only once the previous
    one's push has ended (end_transfer), never computes prompts whose pages would pile up; all complete."""
    probe, _ = prefill_harness()
    token_bytes = probe.engine.runner.kv_transfer_token_bytes()
    h, hooks = prefill_harness(kv_transfer_max_bytes=40 * token_bytes)
    e, stages = h.engine, h.engine.prefill_side.stages
    rids = [h.submit(prompt(i), transfer=Transfer(role="prefill", id=f"p{i}", host="127.0.0.1", port=1),
                     sampling={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}) for i in range(3)]
    order = []
    for _ in range(200):
        e.step()
        for tid in list(stages.transferring):
            # A push ends: at most this one transfer was in flight while it was out.
            assert len(stages.computing) + len(stages.transferring) == 1 and stages.budget.in_flight == 40 * token_bytes
            order.append(tid)
            e.prefill_side.end_transfer(tid, None)
        if all(h.done(r) for r in rids):
            break
    assert order == ["p0", "p1", "p2"]
    assert [h.result(r)["finish"]["type"] for r in rids] == ["transferred"] * 3
    assert stages.budget.peak == 40 * token_bytes and stages.budget.waits > 0 and stages.budget.in_flight == 0
    assert [c[0] for c in hooks.calls].count("gathered") == 3 and e.is_idle()


def test_prefill_side_charges_only_what_the_decode_side_wants_once_gathered():
    """The decode side holds the first 30 of p0's 40 positions (the handshake's start): the whole prompt is
    charged at admission (the start is not known then), only the 10 gathered positions from the gather on, and
    p1 (40) fits beside them in a budget of 50 while p0's push is out."""
    probe, _ = prefill_harness()
    token_bytes = probe.engine.runner.kv_transfer_token_bytes()
    h, hooks = prefill_harness(kv_transfer_max_bytes=50 * token_bytes)
    e, stages = h.engine, h.engine.prefill_side.stages
    e.prefill_side.starts["p0"] = 30
    rids = [h.submit(prompt(i), transfer=Transfer(role="prefill", id=f"p{i}", host="127.0.0.1", port=1),
                     sampling={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}) for i in range(2)]
    together = False
    for _ in range(200):
        e.step()
        if "p0" in stages.transferring or "p0" in stages.computing:
            gathered = [c for c in hooks.calls if c[0] == "gathered"]
            if gathered and "p1" not in stages.computing and "p1" not in stages.transferring:
                assert stages.budget.in_flight == 10 * token_bytes  # p0's gathered pages alone
            together |= "p1" in stages.computing or "p1" in stages.transferring
        for tid in list(stages.transferring):
            if tid == "p1" or together:
                e.prefill_side.end_transfer(tid, None)
        if all(h.done(r) for r in rids):
            break
    assert together and stages.budget.peak == 50 * token_bytes and stages.budget.in_flight == 0
    assert [h.result(r)["finish"]["type"] for r in rids] == ["transferred"] * 2


def test_decode_side_reserves_receive_buffers_within_its_budget_in_order():
    """Offered transfers beyond the budget wait for the pages in flight to arrive, in order; a transfer larger
    than the whole budget goes alone; requests without a transfer are not held behind them."""
    s = make_sched(pool_tokens=4096)
    s.decode_stages.budget = TransferBudget(max_bytes=150, token_bytes=1)
    a, b, c = (decode_side_req(list(range(1000 * k, 1000 * k + 100)), f"t{k}", max_new=4) for k in (1, 2, 3))
    big = decode_side_req(list(range(5000, 5300)), "big", max_new=4)
    for r in (a, b, c, big):
        s.add(r)
    assert s.schedule() is None and s.decode_stages.holding() == [a] and s.waiting == [b, c, big]
    for r, following in ((a, b), (b, c), (c, big)):
        tid = r.transfer_id
        arrive(s, r)
        assert s.schedule() is not None and s.decode_stages.holding() == []  # r decodes; the next still waits
        s.decode_stages.budget.give(tid)  # the side's part: the buffer was scattered
        s.schedule()
        assert s.decode_stages.holding() == [following]
    assert s.decode_stages.holding() == [big]  # 300 positions: alone
    assert s.decode_stages.budget.peak == 300 and s.decode_stages.budget.waits > 0


GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.e2e
def test_pd_under_a_tiny_transfer_budget_serves_every_request_like_unified(stack):
    """A 1-byte budget (less than any prompt): each side holds one transfer's buffer at a time; 16 concurrent
    requests all complete with the unified stack's output, and neither side's peak exceeded its largest prompt."""
    s = Stack("--topology", "pd", "--kv-transfer-max-bytes", "1")
    texts = [f"Backpressure {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(16)]

    def one(url: str, t: str) -> dict:
        r = requests.post(url + "/generate", json={"text": t, "sampling_params": GREEDY}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        with cf.ThreadPoolExecutor(16) as ex:
            got = list(ex.map(lambda t: one(s.url, t), texts))
        want = [one(stack.url, t) for t in texts]
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        longest = max(g["meta_info"]["prompt_tokens"] for g in got)
        infos = worker_infos(s.url)
        for role in ("prefill", "decode"):
            budget = infos[role]["kv_transfer"]["budget"]
            assert budget["max_bytes"] == 1
            assert 0 < budget["peak_bytes"] <= longest * budget["token_bytes"], (role, budget)
        assert infos["prefill"]["kv_transfer"]["budget"]["waits"] > 0  # the prompts did queue for room
        assert_no_kv_held(s.url)
        assert all(i["kv_transfer"]["budget"]["in_flight_bytes"] == 0 for i in worker_infos(s.url).values())
    finally:
        s.stop()
