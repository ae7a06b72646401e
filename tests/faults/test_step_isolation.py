"""One request's error ends that request only: an engine step that raises because of one request is
retried without it, and the other requests (in the same batch or decoding next to it) finish exactly as
they would have alone."""
from __future__ import annotations

import pytest

from tests.support.engine_harness import Harness

GREEDY = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
BYSTANDER = list(range(10, 50))
CULPRIT = list(range(60, 80))


class Boom(RuntimeError):
    pass


def _inject(engine, where: str) -> None:
    """Make every step whose batch holds the request 'culprit' raise, at launch or at resolve."""
    runner = engine.runner
    launch = runner.launch

    def guarded_launch(batch):
        if where == "launch" and any(r.rid == "culprit" for r in batch.reqs):
            raise Boom("culprit at launch")
        handle = launch(batch)
        if where == "resolve" and any(r.rid == "culprit" for r in batch.reqs):
            def bad_resolve():
                raise Boom("culprit at resolve")
            handle.resolve = bad_resolve
        return handle

    runner.launch = guarded_launch


def _run(h: Harness, rids, max_steps=2000):
    for _ in range(max_steps):
        if all(h.done(r) for r in rids):
            return
        h.engine.safe_step()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["launch", "resolve"])
@pytest.mark.parametrize("together", [True, False])
def test_a_failing_request_ends_alone(where, together, overlap):
    ref = Harness(enable_overlap=overlap)
    rid = ref.submit(BYSTANDER, sampling=GREEDY)
    expected = ref.run([rid])[0]["ids"]

    h = Harness(enable_overlap=overlap)
    _inject(h.engine, where)
    by = h.submit(BYSTANDER, rid="bystander", sampling=GREEDY)
    if not together:  # the bystander is decoding when the culprit arrives
        for _ in range(5):
            h.engine.safe_step()
    h.submit(CULPRIT, rid="culprit", sampling=GREEDY)
    _run(h, [by, "culprit"])

    bad = h.outputs["culprit"][-1]
    assert bad.finished and "internal error" in (bad.error or "") and "Boom" in bad.error
    good = h.result(by)
    assert good["finish"] == {"type": "length", "length": 30}
    assert good["ids"] == expected  # the same tokens it produces alone, none lost or repeated
    assert not any(o.error for o in h.outputs[by])
    info = h.engine.info()
    assert info["failed_steps"] >= 1 and info["num_running"] == 0
    assert info["kv_usage"] == 0.0  # nothing leaked: every slot is free or evictable cache
    again = h.submit(BYSTANDER, sampling=GREEDY)
    _run(h, [again])
    assert h.result(again)["ids"] == expected
