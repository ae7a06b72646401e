"""Profiling a running stack's processes under load, for the benchmarks' --profile flags.

`profile_process` (in a background thread, `delay` s into the load): three py-spy dumps, a py-spy record of
every thread (wall-clock samples, `--gil` optional) in py-spy's raw collapsed format, and each thread's CPU
over the same window from /proc. `summarize_raw` turns a raw record into the few lines that matter: per
thread, its share of samples and the functions that hold them (self time) and contain them (inclusive).
"""
from __future__ import annotations

import collections
import os
import shutil
import subprocess
import threading
import time

from bench.common import log
from shared import procfs


_PLUMBING = ("runners.py", "base_events.py", "events.py", "threading.py", "<frozen runpy>", "module.py")


def summarize_raw(path: str, top: int = 12, expected: int = 0, idle: tuple[str, ...] = ("select", "epoll", "poll", "wait",
                                                                        "_wait", "sleep", "acquire")) -> str:
    """Per thread: samples (py-spy records a thread only while it is active; `expected`, the samples of the
    whole window, gives the share), then the top self-time and inclusive functions of its non-idle samples
    (as shares of the thread's samples; event-loop and threading plumbing left out of the inclusive list).
    A raw py-spy line is `thread (tid): name;frame;frame;... count` with frames `func (file:line)`."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    idle_n: collections.Counter = collections.Counter()
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        return f"(no profile: {e})"
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        if frames[0].startswith("process "):
            frames = frames[1:]
        if not frames[0].startswith("thread "):
            frames = ["thread (?)"] + frames
        thread, frames = frames[0], [_short(fr) for fr in frames[1:]]
        total[thread] += n
        if not frames:
            continue
        leaf = frames[-1]
        if any(leaf.split(" ")[0].endswith(w) for w in idle):
            idle_n[thread] += n
            continue
        threads[thread][leaf] += n
        for fr in set(frames):
            if not fr.partition(" (")[2].startswith(_PLUMBING) and not fr.startswith("<module>"):
                incl[thread][fr] += n
    out = []
    for thread, n in total.most_common():
        busy = n - idle_n[thread]
        share = f", {busy / expected:.0%} of the window" if expected else ""
        out.append(f"--- {thread}: {n} samples, {busy} not idle{share}")
        if busy == 0:
            continue
        out.append("  self:")
        out += [f"    {c / n:6.1%}  {fr}" for fr, c in threads[thread].most_common(top)]
        out.append("  inclusive:")
        out += [f"    {c / n:6.1%}  {fr}" for fr, c in incl[thread].most_common(top)]
    return "\n".join(out)


def _short(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py:123)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where)}" if where else name


def profile_process(pid: int, out_prefix: str, delay: float = 8.0, seconds: float = 6.0,
                    gil: bool = False) -> threading.Thread:
    """In the background: wait `delay` s, then py-spy dumps, a `seconds`-long py-spy record (raw format, every
    thread) and per-thread CPU of pid, written to `out_prefix`.txt (dumps, CPU, summary) and `out_prefix`.raw."""
    def run():
        time.sleep(delay)
        if shutil.which("py-spy") is None:
            log("profile skipped: py-spy is not installed (pip install -e \".[bench]\")")
            return
        raw = out_prefix + ".raw"
        with open(out_prefix + ".txt", "w") as f:
            for i in range(2):
                r = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True)
                f.write(f"=== py-spy dump {i} ===\n{r.stdout}{r.stderr}\n")
                time.sleep(0.3)
            a = procfs.thread_run_seconds(pid)
            cmd = ["py-spy", "record", "--pid", str(pid), "--threads", "--nonblocking", "-r", "200",
                   "-d", str(int(seconds)), "-f", "raw", "-o", raw] + (["--gil"] if gil else [])
            rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            time.sleep(seconds)
            b = procfs.thread_run_seconds(pid)
            try:
                rec.wait(30)
            except subprocess.TimeoutExpired:
                rec.kill()
            f.write(f"=== thread CPU over {seconds:g} s (cores) ===\n")
            for k in sorted(b, key=lambda k: a.get(k, 0.0) - b[k]):
                if b[k] - a.get(k, 0.0) > 0.005 * seconds:
                    f.write(f"{(b[k] - a.get(k, 0.0)) / seconds:6.2f}  {k}\n")
            f.write(f"=== py-spy record summary ({'GIL holder only' if gil else 'wall clock'}) ===\n")
            f.write(summarize_raw(raw, expected=int(200 * seconds)) + "\n")
        log(f"profile of pid {pid} written to {out_prefix}.txt")
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
