"""PD stage queues (shared/pd/sides.py) on the real engine (tiny-random model), without the transfer
glue: the hooks are recorded here. A request moves through its side's stages in order, and ending it at
any stage takes it out of its stage and gives back every slot it held."""
from __future__ import annotations

import time

import pytest
import torch

from shared.protocol import KvDone, Transfer
from shared.pd import kv_pages
from tests.support.engine_harness import Harness

PROMPT = list(range(5, 45))


class Hooks:
    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, name):
        return lambda *a: self.calls.append((name, *a))

    def names(self):
        return [c[0] for c in self.calls]


def decode_harness(**cfg):
    h = Harness(**cfg)
    hooks = Hooks()
    h.engine.decode_side.on_kv_expect = hooks("expect")
    h.engine.decode_side.on_kv_cancel = hooks("cancel")
    return h, hooks


def prefill_harness(**cfg):
    h = Harness(**cfg)
    hooks = Hooks()
    side = h.engine.prefill_side
    side.on_transfer_open = hooks("open")
    side.on_kv_gathered = hooks("gathered")
    side.on_kv_ready = hooks("ready")
    return h, hooks


def stage_of(stages, req):
    return [name for name in ("queued", "reserved", "awaiting") if req.transfer_id in getattr(stages, name)]


def full(h):
    return h.free_tokens() == h.engine.runner.max_total_tokens


def submit_decode(h, tid, prompt=PROMPT):
    rid = h.submit(prompt, transfer=Transfer(role="decode", id=tid),
                   sampling={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    h.engine.step()  # admitted: queued (not offered, so no slots)
    return rid, h.engine._reqs[rid]


def pages_for(h, req):
    pool = h.engine.runner.kv_pool
    n = len(req.input_ids) - req.kv_len
    return torch.zeros([n, *kv_pages.token_layout(pool)], dtype=pool.dtype)


def test_decode_request_moves_queued_reserved_awaiting_ready():
    h, hooks = decode_harness()
    e, stages = h.engine, h.engine.decode_side.stages
    rid, req = submit_decode(h, "d1")
    assert stage_of(stages, req) == ["queued"] and req in e.policy.waiting and not req.slots
    e.kv_offered("d1")
    e._drain_inbox(block=False)
    assert stage_of(stages, req) == ["queued"] and req.kv_offered
    e.policy.schedule()  # the round alone: slots reserved, the receiver not told yet
    assert stage_of(stages, req) == ["reserved"] and e.policy.decode_stages.holding() == [req]
    assert len(req.slots) == len(PROMPT) and e.policy.num_running() == 1
    e.decode_side.announce()
    assert stage_of(stages, req) == ["awaiting"] and hooks.calls == [("expect", "d1", 0, len(PROMPT))]
    e.kv_arrived("d1", KvDone(transfer_id="d1", first_token=7), pages_for(h, req))
    h.run([rid])
    assert stage_of(stages, req) == [] and req.transfer is None
    out = h.result(rid)
    assert out["ids"][0] == 7 and len(out["ids"]) == 4 and out["error"] is None
    assert "cancel" not in hooks.names() and e.policy.is_idle() and full(h)


@pytest.mark.parametrize("stage", ["queued", "reserved", "awaiting"])
def test_decode_abort_at_each_stage_frees_its_slots(stage):
    h, hooks = decode_harness()
    e, stages = h.engine, h.engine.decode_side.stages
    rid, req = submit_decode(h, "d2")
    if stage != "queued":
        e.kv_offered("d2")
        e._drain_inbox(block=False)
        e.policy.schedule()
        if stage == "awaiting":
            e.decode_side.announce()
    assert stage_of(stages, req) == [stage]
    e.end_request(req, "aborted by the test")
    assert h.result(rid)["error"] == "aborted by the test"
    assert stage_of(stages, req) == [] and ("cancel", "d2") in hooks.calls
    assert e.policy.is_idle() and e.policy.num_running() == 0 and full(h)
    # Pages that come after the end are dropped.
    e.kv_arrived("d2", KvDone(transfer_id="d2", first_token=7), torch.zeros(0))
    e._drain_inbox(block=False)
    assert full(h) and not e.policy.running


@pytest.mark.parametrize("stage", ["queued", "awaiting"])
def test_decode_timeout_at_each_stage_frees_its_slots(stage):
    h, hooks = decode_harness(kv_transfer_timeout=0.05)
    e, stages = h.engine, h.engine.decode_side.stages
    rid, req = submit_decode(h, "d3")
    if stage == "awaiting":
        e.kv_offered("d3")
        e.step()
    assert stage_of(stages, req) == [stage]
    time.sleep(0.1)
    e.step()  # the announce after the round times it out
    assert "did not arrive" in h.result(rid)["error"]
    assert stage_of(stages, req) == [] and ("cancel", "d3") in hooks.calls
    assert e.policy.is_idle() and full(h)


def submit_prefill(h, tid, max_new=4):
    rid = h.submit(PROMPT, transfer=Transfer(role="prefill", id=tid, host="127.0.0.1", port=1),
                   sampling={"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
    return rid


def test_prefill_request_moves_admitted_computing_transferring_done():
    h, hooks = prefill_harness()
    e, stages = h.engine, h.engine.prefill_side.stages
    rid = submit_prefill(h, "p1")
    e._drain_inbox(block=False)
    req = e._reqs[rid]
    e.policy.schedule()  # the round alone: admitted, its last (only) chunk scheduled
    assert stages.admitted == [req] and stages.prefilled == [req] and not stages.computing
    e.prefill_side.open_new()
    assert stages.admitted == [] and stages.computing == {"p1": req} and hooks.names() == ["open"]
    e.policy.requeue(req, 0)  # back to the queue: its KV is released, the request runs again
    assert stages.prefilled == [] and req in e.policy.waiting
    for _ in range(20):
        e.step()
        if stages.transferring:
            break
    assert stages.transferring == {"p1": req} and not stages.computing and stages.prefilled == [req]
    assert hooks.names() == ["open", "gathered", "ready"] and hooks.calls[-1][2].done.first_token is not None
    assert e.prefill_side.busy and not e.is_idle() and not full(h)
    e.prefill_side.end_transfer("p1", None)
    assert h.result(rid)["finish"]["type"] == "transferred"
    assert not stages.transferring and not stages.prefilled and e.is_idle() and full(h)


@pytest.mark.parametrize("stage", ["admitted", "computing", "transferring"])
def test_prefill_abort_at_each_stage_frees_its_kv(stage):
    h, hooks = prefill_harness()
    e, stages = h.engine, h.engine.prefill_side.stages
    rid = submit_prefill(h, "p2")
    e._drain_inbox(block=False)
    req = e._reqs[rid]
    if stage == "transferring":
        for _ in range(20):
            e.step()
            if stages.transferring:
                break
        assert "p2" in stages.transferring
    else:
        e.policy.schedule()  # the round alone: admitted (its pass is not launched)
        if stage == "computing":
            e.prefill_side.open_new()
        assert (stages.admitted == [req]) == (stage == "admitted")
        assert ("p2" in stages.computing) == (stage == "computing")
    e.end_request(req, "aborted by the test")
    assert h.result(rid)["error"] == "aborted by the test"
    assert not (stages.admitted or stages.computing or stages.transferring or stages.prefilled)
    # A transfer opened but not handed off is dropped by the glue (ready with None).
    assert (("ready", "p2", None) in hooks.calls) == (stage == "computing")
    while e._pending is not None or e._inflight:
        e.step()  # the launched pass, if any, runs out (its results are moot)
    assert e.is_idle() and full(h)
