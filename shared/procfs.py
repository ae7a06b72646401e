"""Reading processes from Linux's /proc: children of a pid, a process's argv, state and CPU seconds.
Used by the benchmarks (CPU per token, finding a stack's workers) and the fault tests (which worker to
kill, whether workers outlived their launcher)."""
from __future__ import annotations

import os


def _stat_fields(path: str) -> list[str] | None:
    """The fields after the command name of a /proc stat file (field 0 is the state), None if gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """Direct child processes of pid."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(f"/proc/{entry}/stat")
            if fields is not None and int(fields[1]) == pid:
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def flag_value(pid: int, flag: str) -> str | None:
    """The value after `flag` on pid's command line (e.g. --role), None when absent."""
    args = argv(pid)
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] != "Z"


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (or one of its threads); 0 when it is gone."""
    return sum(cpu_split(pid, tid))


def cpu_split(pid: int, tid: int | None = None) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (or one of its threads); zeros when it is gone. The
    system part is the kernel working for it: for a server, mostly its sockets."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = _stat_fields(path)
    if fields is None:
        return 0.0, 0.0
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def run_seconds(pid: int) -> float:
    """CPU time of pid's live threads to the nanosecond (schedstat), for windows too short for the
    10 ms ticks of cpu_seconds (a 0.2 s gateway window read in ticks is +-5%). A thread that ended inside
    a window takes its time with it. A thread's figure is brought up to date when it leaves the CPU: for
    a server's threads, which block between events, that is current; a thread spinning on a CPU (this
    process's own, while it reads) can read behind by its whole current slice. cpu_seconds where the
    kernel keeps no schedstat."""
    if not os.path.exists("/proc/self/schedstat"):
        return cpu_seconds(pid)
    return sum(thread_run_seconds(pid).values())


def thread_run_seconds(pid: int) -> dict[str, float]:
    """run_seconds by live thread, keyed "name/tid" (the thread's comm; "main" for the process's first
    thread, since Python before 3.14 names no OS thread): which of a process's threads spends its CPU
    (the event loop, a log relay, an executor). In ticks (cpu_seconds) where the kernel keeps no
    schedstat."""
    schedstat = os.path.exists("/proc/self/schedstat")
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            if schedstat:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            else:
                seconds = cpu_seconds(pid, int(tid))
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[f"{'main' if tid == str(pid) else name}/{tid}"] = seconds
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 when it is gone): a server whose RSS grows with requests served
    keeps state it should not."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return int(fields[21]) * os.sysconf("SC_PAGE_SIZE") if fields is not None else 0
