"""Soak: mixed routes against one stack for a long time, with the resident memory of every process of the
stack sampled, then the KV checked back at idle. What must hold: no request fails, no process grows more
than --max-growth after the warm-up, and every worker ends with nothing running and no KV held.

    python loadtest/soak.py --duration 600                  # starts its own tiny-random stack
    python loadtest/soak.py --url http://H:P --pid PID      # a running stack (PID: its launcher)

Routes, round-robin per client: chat (streamed), completions, /generate with a regex, a program (gen +
select) and a chat with tools (tool_choice "required"). Prints one line per process and a verdict; exits
1 when a check fails. Target only servers you run yourself.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shared import procfs  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_temperature", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}]
PROGRAM = {"version": 1, "name": "soak", "args": [], "nodes": [
    {"op": "text", "text": "Question: is the sky green? Think first:"},
    {"op": "gen", "name": "thought", "sampling_params": {"max_new_tokens": 8}},
    {"op": "text", "text": " Answer:"},
    {"op": "select", "name": "answer", "choices": ["yes", "no", "maybe"], "temperature": 0.0}]}


def _chat_stream(url: str, n: int) -> None:
    body = {"model": "tiny-random", "stream": True, "max_tokens": 12, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "You answer briefly. " * 8},
                         {"role": "user", "content": f"Question {n}?"}]}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        _ok(r)
        last = None
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                last = line[6:]
                if b'"error"' in last and last != b"[DONE]":
                    raise RuntimeError(last.decode()[:300])
        if last != b"[DONE]":
            raise RuntimeError(f"stream ended without [DONE]: {last!r}")


def _completion(url: str, n: int) -> None:
    body = {"model": "tiny-random", "prompt": f"Once upon a time, number {n}", "max_tokens": 12, "temperature": 0.8}
    with requests.post(url + "/v1/completions", json=body, timeout=120) as r:
        _ok(r)
        if r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
            raise RuntimeError(r.text[:300])


def _generate_regex(url: str, n: int) -> None:
    body = {"text": f"Phone number {n}:", "sampling_params": {"max_new_tokens": 16, "regex": r"\d{3}-\d{4}"}}
    with requests.post(url + "/generate", json=body, timeout=120) as r:
        _ok(r)
        text = r.json()["text"]
        if len(text) != 8 or text[3] != "-":
            raise RuntimeError(f"regex output {text!r}")


def _program(url: str, n: int) -> None:
    with requests.post(url + "/v1/programs", json={"program": PROGRAM}, timeout=120) as r:
        _ok(r)
        if r.json()["variables"]["answer"] not in ("yes", "no", "maybe"):
            raise RuntimeError(r.text[:300])


def _tools(url: str, n: int) -> None:
    body = {"model": "tiny-random", "max_tokens": 128, "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": f"How warm is it in town {n}?"}]}
    with requests.post(url + "/v1/chat/completions", json=body, timeout=120) as r:
        _ok(r)
        calls = r.json()["choices"][0]["message"].get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != "get_temperature":
            raise RuntimeError(f"no tool call: {r.text[:300]}")
        json.loads(calls[0]["function"]["arguments"])


ROUTES = {"chat_stream": _chat_stream, "completions": _completion, "generate_regex": _generate_regex,
          "program": _program, "tools": _tools}


def _ok(r: requests.Response) -> None:
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")


class Clients:
    def __init__(self, url: str, count: int):
        self.url, self.count = url, count
        self.done = {name: 0 for name in ROUTES}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def _run(self, i: int) -> None:
        names = list(ROUTES)
        n = i
        while not self._stop.is_set():
            name = names[n % len(names)]
            try:
                ROUTES[name](self.url, n)
                with self._lock:
                    self.done[name] += 1
            except Exception as e:  # every failure counts; the first few are shown
                with self._lock:
                    self.errors.append(f"{name}: {type(e).__name__}: {e}"[:400])
            n += self.count


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def label(pid: int) -> str:
    args = procfs.argv(pid)
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            role = procfs.flag_value(pid, "--role") or procfs.flag_value(pid, "--worker-id")
            return args[i + 1] + (f"[{role}]" if role else "")
    return " ".join(args[1:3])[:60]


def kv_idle(url: str) -> tuple[bool, list]:
    workers = requests.get(url + "/server_info", timeout=10).json()["workers"]
    rows = [(w["address"], (w.get("info") or {}).get("num_running"), (w.get("info") or {}).get("num_waiting"),
             (w.get("info") or {}).get("kv_usage")) for w in workers]
    return all(r[1] == 0 and r[2] == 0 and r[3] == 0.0 for r in rows) and bool(rows), rows


def start_stack(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.launch", "--model-path", "tiny-random", "--port",
                             str(port), "--log-level", "warning", "--tool-call-parser", "hermes", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("READY "):
            break
    else:
        raise SystemExit(f"the stack did not start (exit {proc.wait()})")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit("the stack never became healthy")


def soak(url: str, root_pid: int, duration: float, warmup: float, clients: int, every: float,
         max_growth: float) -> dict:
    pids = [root_pid, *procfs.descendants(root_pid)]
    samples: dict[int, list[tuple[float, float]]] = {p: [] for p in pids}
    load = Clients(url, clients)
    t0 = time.monotonic()
    load.start()
    while (now := time.monotonic() - t0) < duration:
        for p in list(samples):
            mb = rss_mb(p)
            if mb is not None:
                samples[p].append((now, mb))
        for p in procfs.descendants(root_pid):  # started later (a pool's process): sampled from then on
            samples.setdefault(p, [])
        time.sleep(every)
    load.stop()
    deadline = time.monotonic() + 30
    idle, rows = kv_idle(url)
    while not idle and time.monotonic() < deadline:
        time.sleep(0.5)
        idle, rows = kv_idle(url)
    window = max(every * 3, (duration - warmup) * 0.15)  # the first and last stretch after the warm-up
    procs = []
    for p, xs in samples.items():
        base = [mb for t, mb in xs if warmup <= t < warmup + window]
        end = [mb for t, mb in xs if t >= duration - window]
        if not base or not end:
            procs.append({"pid": p, "name": label(p) or "?", "base_mb": None, "end_mb": None, "growth": None,
                          "alive": rss_mb(p) is not None})
            continue
        b, e = statistics.median(base), statistics.median(end)
        procs.append({"pid": p, "name": label(p), "base_mb": round(b, 1), "end_mb": round(e, 1),
                      "growth": round((e - b) / b, 4), "alive": rss_mb(p) is not None})
    tracked = [p for p in procs if p["growth"] is not None]
    ok = (not load.errors and idle and bool(tracked) and all(p["growth"] <= max_growth for p in tracked)
          and all(p["alive"] for p in procs if p["pid"] in pids))
    return {"ok": ok, "seconds": round(time.monotonic() - t0, 1), "requests": load.done,
            "errors": len(load.errors), "first_errors": load.errors[:5], "kv_idle": idle, "workers": rows,
            "processes": procs, "max_growth": max_growth}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default 15%%)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--every", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--max-growth", type=float, default=0.05, help="largest RSS growth after the warm-up")
    p.add_argument("--url", default=None, help="a running stack (else one is started)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the stack's root process, for RSS")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("stack_args", nargs="*", help="extra services.launch flags (after --)")
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else 0.15 * args.duration
    proc = None
    if args.url:
        if args.pid is None:
            p.error("--url needs --pid")
        url, root = args.url, args.pid
    else:
        proc, url = start_stack(args.stack_args)
        root = proc.pid
    try:
        result = soak(url, root, args.duration, warmup, args.clients, args.every, args.max_growth)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    for row in result["processes"]:
        growth = "-" if row["growth"] is None else f"{100 * row['growth']:+.2f}%"
        print(f"{row['pid']:>8} {row['name'][:40]:<40} {row['base_mb']!s:>8} MB -> {row['end_mb']!s:>8} MB {growth}")
    print(f"requests {result['requests']} errors {result['errors']} kv_idle {result['kv_idle']} "
          f"in {result['seconds']} s")
    for e in result["first_errors"]:
        print("  error:", e)
    print("SOAK", "PASS" if result["ok"] else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
