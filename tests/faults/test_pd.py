"""Faults on supervised PD stacks (KV pages over real UCX): a decode worker SIGKILLed under load (1P+2D),
a decode worker stopped (SIGSTOP) for longer than the KV transfer timeout and then continued, and a
prefill worker SIGKILLed under load (2P+1D). Every accepted request completes or gets a clear error,
every surviving worker's KV returns to its idle baseline, the killed worker is restarted and taken back."""
from __future__ import annotations

import signal
import time

import pytest

from tests.faults.harness import (FaultStack, Load, all_up, assert_no_bad, health, one_request, report, wait_for,
                                  wait_kv_baseline, worker_kv)

pytestmark = pytest.mark.e2e

TRANSFER_TIMEOUT_S = 3.0


def pd_stack(prefill: int, decode: int) -> FaultStack:
    return FaultStack("--topology", "pd", "--prefill", str(prefill), "--decode", str(decode),
                      "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S), "--restart-backoff", "0.2")


@pytest.fixture(scope="module")
def one_p_two_d():
    s = pd_stack(1, 2)  # prefill-0, decode-1, decode-2
    one_request(s.url, "warm up", 4, stream=False)
    yield s, worker_kv(s.url)
    s.stop(signal.SIGKILL)


def kill_under_load(stack: FaultStack, baseline: dict, role: str, label: str) -> None:
    load = Load(stack.url, clients=4).start()
    time.sleep(1.5)
    name, victim = stack.busiest(role)
    t_kill = stack.kill_worker(name)
    wait_for(lambda: not all_up(stack.url), 10, "the gateway to see the worker gone")
    noticed = time.monotonic() - t_kill
    wait_for(lambda: load.ok_after(t_kill) >= 4, 20, "requests served without the killed worker")
    serving = load.first_ok_after(t_kill)
    wait_for(lambda: all_up(stack.url), 90, "the killed worker restarted and taken back")
    recovered = time.monotonic() - t_kill
    time.sleep(1.0)
    counts = assert_no_bad(load.stop())
    assert counts.get("error", 0) <= load.clients, counts
    survivors = [a for a in baseline if a != victim]
    kv = wait_kv_baseline(stack.url, baseline, survivors)
    wait_kv_baseline(stack.url, baseline)  # the restarted one too
    report(label, noticed_s=noticed, first_ok_after_kill_s=serving, full_recovery_s=recovered, kv_settle_s=kv, **counts)
    assert recovered < 90  # a restart loads the model again: seconds on a quiet machine, more on a busy one


def test_pd_1p2d_decode_sigkill_under_load(one_p_two_d):
    stack, baseline = one_p_two_d
    kill_under_load(stack, baseline, "decode", "PD 1P+2D decode SIGKILL")


def test_pd_decode_sigstop_longer_than_transfer_timeout(one_p_two_d):
    stack, baseline = one_p_two_d
    load = Load(stack.url, clients=4).start()
    time.sleep(1.5)
    name, _ = stack.busiest("decode")
    t_stop = stack.kill_worker(name, signal.SIGSTOP)
    try:
        wait_for(lambda: load.ok_after(t_stop + 1.0) >= 4, 30, "requests served by the other decode worker")
        time.sleep(max(0.0, t_stop + 2.5 * TRANSFER_TIMEOUT_S - time.monotonic()))
        assert health(stack.url)[0] == 200  # degraded, still serving
    finally:
        stack.kill_worker(name, signal.SIGCONT)
    t_cont = time.monotonic()
    wait_for(lambda: all_up(stack.url), 60, "the stopped worker taken back")
    recovered = time.monotonic() - t_cont
    time.sleep(1.0)
    counts = assert_no_bad(load.stop())
    kv = wait_kv_baseline(stack.url, baseline)
    report("PD 1P+2D decode SIGSTOP>transfer timeout", stopped_s=t_cont - t_stop, recovery_after_cont_s=recovered,
           kv_settle_s=kv, **counts)
    assert recovered < 30


def test_pd_2p1d_prefill_sigkill_under_load():
    stack = pd_stack(2, 1)  # prefill-0, prefill-1, decode-2
    try:
        one_request(stack.url, "warm up", 4, stream=False)
        kill_under_load(stack, worker_kv(stack.url), "prefill", "PD 2P+1D prefill SIGKILL")
    finally:
        stack.stop(signal.SIGKILL)
