"""What every fault scenario needs: a supervised stack whose output is read in the background (a Proc), a load
of real HTTP clients that records how each accepted request ended, KV readings from /server_info, and
a clock for recovery times."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import requests

from shared import procfs

from tests.support.stack import Proc, free_port, wait_for  # noqa: F401 (the fault tests import them from here)

REQUEST_TIMEOUT_S = 40.0  # a request that takes longer counts as a hang


class FaultStack(Proc):
    """`services.launch` with fast fault flags; `workers` are the addresses from the READY line."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("services.launch", "--model-path", "tiny-random", "--port", str(self.port),
                         "--drain-grace", "0.5", "--drain-timeout", "10", "--log-level", "warning", *args,
                         ready="READY ", timeout=180.0)
        self.workers = self.ready_line.split("workers=")[1].strip().split(",")
        wait_for(lambda: health(self.url)[0] == 200, 60, "stack healthy")

    def worker_pid(self, name: str) -> int:
        """The pid of this stack's worker `name` (role-index, e.g. decode-1); it changes on a restart."""
        for pid in procfs.children(self.proc.pid):
            if procfs.flag_value(pid, "--worker-id") == name:
                return pid
        raise RuntimeError(f"no worker {name} under the launcher")

    def busiest(self, role: str) -> tuple[str, str]:
        """(slot name, address) of the `role` worker with the most requests in flight now: the victim
        whose death costs something."""
        loads = {w["address"]: w["load"] for w in requests.get(self.url + "/server_info", timeout=10).json()["workers"]
                 if w["role"] == role}
        address = max(loads, key=lambda a: loads[a])
        return f"{role}-{self.workers.index(address)}", address

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> float:
        os.kill(self.worker_pid(name), sig)
        return time.monotonic()


def health(url: str) -> tuple[int, str]:
    try:
        r = requests.get(url + "/health", timeout=5)
        return r.status_code, r.text
    except requests.RequestException as e:
        return 0, str(e)


def all_up(url: str) -> bool:
    """Healthy and no worker restarting, down, unresponsive or draining."""
    return health(url) == (200, "OK\n")


def worker_kv(url: str) -> dict[str, dict]:
    """address -> {kv_usage, num_running, num_waiting} of every connected worker, fresh from /server_info."""
    out = {}
    for w in requests.get(url + "/server_info", timeout=10).json()["workers"]:
        if w["connected"] and w["info"]:
            i = w["info"]
            out[w["address"]] = {"kv_usage": i["kv_usage"], "num_running": i["num_running"],
                                 "num_waiting": i["num_waiting"]}
    return out


def wait_kv_baseline(url: str, baseline: dict[str, dict], addresses=None, timeout: float = 30.0) -> float:
    """Wait until every listed worker (default: every one in `baseline`) is back at its idle KV usage
    with nothing running; returns how long that took."""
    t0 = time.monotonic()
    addresses = list(addresses or baseline)

    def settled():
        t = time.monotonic()
        now = worker_kv(url)
        if os.environ.get("FAULTS_DEBUG"):
            print(f"{time.monotonic() - t0:.2f} poll {time.monotonic() - t:.2f}s {now}", flush=True)
        return all(a in now and now[a]["num_running"] == 0 and now[a]["num_waiting"] == 0
                   and now[a]["kv_usage"] <= baseline[a]["kv_usage"] + 1e-9 for a in addresses)
    try:
        wait_for(settled, timeout, "KV usage back to the idle baseline")
    except AssertionError:
        raise AssertionError(f"KV not back to baseline {baseline}: {worker_kv(url)}") from None
    return time.monotonic() - t0


@dataclass
class Outcome:
    kind: str  # ok | error (a clear error answer) | refused (connection refused: not accepted) | bad
    detail: str = ""
    t_end: float = 0.0


@dataclass
class Load:
    """`clients` threads sending requests back to back (half streaming) until stopped."""
    url: str
    clients: int = 4
    max_new_tokens: int = 24
    prompt: str = "The fault suite keeps asking: what happens to request number"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 10)
            assert not t.is_alive(), "a client is stuck in a request"
        return self.outcomes

    def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.outcomes.append(one_request(self.url, f"{self.prompt} {i}-{n}?", self.max_new_tokens,
                                             stream=(n % 2 == 0)))
            if self.outcomes[-1].kind == "refused":
                time.sleep(0.1)

    def ok_after(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.kind == "ok" and o.t_end > t)

    def first_ok_after(self, t: float) -> float | None:
        ends = [o.t_end for o in self.outcomes if o.kind == "ok" and o.t_end > t]
        return min(ends) - t if ends else None


def one_request(url: str, text: str, max_new_tokens: int, stream: bool) -> Outcome:
    """Classify how one request ended. `bad` is what must never happen: a hang, a 5xx/4xx without an
    OpenAI-style error body, a stream that stops without [DONE] or an error event."""
    body = {"model": "tiny-random", "prompt": text, "max_tokens": max_new_tokens, "stream": stream,
            "temperature": 0.7}
    try:
        with requests.post(url + "/v1/completions", json=body, stream=stream, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                try:
                    msg = r.json()["error"]["message"]
                except Exception:
                    return Outcome("bad", f"{r.status_code} without an error body: {r.text[:200]}", time.monotonic())
                return Outcome("error", f"{r.status_code}: {msg}", time.monotonic())
            if not stream:
                data = r.json()
                ok = data["choices"][0]["finish_reason"] in ("length", "stop")
                return Outcome("ok" if ok else "bad", json.dumps(data)[:200], time.monotonic())
            last = None
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    last = line[6:]
                    if last != b"[DONE]" and b'"error"' in last:
                        return Outcome("error", last.decode()[:200], time.monotonic())
            if last == b"[DONE]":
                return Outcome("ok", "", time.monotonic())
            return Outcome("bad", f"stream ended without [DONE]: {last!r}", time.monotonic())
    except requests.exceptions.ConnectionError as e:
        if "refused" in str(e).lower():
            return Outcome("refused", str(e)[:200], time.monotonic())
        return Outcome("dropped", str(e)[:200], time.monotonic())  # the connection died mid-request
    except requests.exceptions.ChunkedEncodingError as e:
        return Outcome("dropped", str(e)[:200], time.monotonic())
    except requests.exceptions.Timeout as e:
        return Outcome("bad", f"hang: {e}", time.monotonic())
    except requests.RequestException as e:
        return Outcome("bad", f"{type(e).__name__}: {e}"[:200], time.monotonic())


def assert_no_bad(outcomes: list[Outcome], allow: tuple[str, ...] = ("ok", "error")) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    bad = [o for o in outcomes if o.kind not in allow]
    assert not bad, f"{len(bad)} requests ended badly, e.g. {bad[:3]}"
    return counts


def report(name: str, **numbers) -> None:
    """Measured numbers of a scenario, on one line (pytest -s shows it; the suite's summary quotes it)."""
    print(f"\nFAULT {name}: " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in numbers.items()), flush=True)
