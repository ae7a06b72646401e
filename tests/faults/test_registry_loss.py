"""The registry loses its data while the fleet serves: FLUSHALL, Redis restarted empty, and a failover to
an empty Redis (every client's connection dropped, the data gone). The gateway finds its workers through
Redis only (as docker-compose runs it); every worker stays up and connected, so no request may fail:
liveness of a connected worker comes from its connection, and each worker re-creates its entry on its
next beat."""
from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import redis

from tests.faults.harness import Load, assert_no_bad, report, wait_for
from tests.faults.procs import Proc, wait_healthy, worker
from tests.support.stack import RedisServer, free_port

pytestmark = pytest.mark.e2e

KEYS = "radixserve:worker:*"


@pytest.fixture
def fleet():
    server = RedisServer()
    procs: list[Proc] = []
    try:
        port = free_port()
        # The gateway finds the workers through Redis: all three start side by side.
        with cf.ThreadPoolExecutor(3) as ex:
            starts = [ex.submit(lambda wid=wid: worker("--redis-url", server.url, "--worker-id", wid)[0])
                      for wid in ("w1", "w2")]
            starts.append(ex.submit(Proc, "services.gateway", "--model-path", "tiny-random", "--redis-url",
                                    server.url, "--port", str(port), "--log-level", "warning", ready="gateway ready"))
        procs += [f.result() for f in starts if f.exception() is None]
        for f in starts:
            f.result()  # one that did not start fails the fixture; the others are stopped below
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield server, url
    finally:
        for p in procs:
            p.stop()
        server.stop()


def entries(server: RedisServer) -> int:
    try:
        return len(redis.Redis.from_url(server.url).keys(KEYS))
    except redis.RedisError:
        return 0


def lose_data(server: RedisServer, how: str) -> None:
    r = redis.Redis.from_url(server.url)
    if how == "flushall":
        r.flushall()
    elif how == "restart":  # stopped and started again, empty, faster than a discovery poll
        server.stop()
        server.start()
    elif how == "failover":  # a replica without the data takes over: connections drop, the keys are gone
        r.flushall()
        r.client_kill_filter(_type="normal", skipme=True)


def test_registry_data_loss_under_load_fails_no_request(fleet):
    server, url = fleet
    assert entries(server) == 2
    load = Load(url, clients=4, max_new_tokens=8).start()
    try:
        time.sleep(1.5)
        for how in ("flushall", "restart", "failover"):
            lose_data(server, how)
            # Each worker's next beat (a third of the 10 s TTL) writes its entry again.
            wait_for(lambda: entries(server) == 2, 10, f"the workers to re-register after {how}")
            time.sleep(1.5)  # and a few discovery polls with the entries back
    finally:
        outcomes = load.stop()
    counts = assert_no_bad(outcomes)
    errors = [o.detail for o in outcomes if o.kind == "error"]
    report("registry_data_loss", **counts)
    assert counts.get("ok", 0) > 20 and not errors, f"{len(errors)} failed requests, e.g. {errors[:3]}"
