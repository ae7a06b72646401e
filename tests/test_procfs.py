"""shared/procfs.py's CPU readings."""
import os
import subprocess
import sys
import threading
import time

from shared import procfs


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_run_seconds_counts_every_thread_finer_than_ticks():
    before = procfs.run_seconds(os.getpid())
    burnt, leave = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (_burn(0.05), burnt.set(), leave.wait()))
    t.start()
    _burn(0.05)
    burnt.wait()
    spent = procfs.run_seconds(os.getpid()) - before  # read while the other thread still lives
    leave.set()
    t.join()
    assert 0.095 <= spent < 0.5  # both threads' 50 ms
    a = procfs.run_seconds(os.getpid())
    _burn(0.003)  # below one 10 ms tick: still seen
    assert procfs.run_seconds(os.getpid()) - a >= 0.0025


def test_run_seconds_of_another_process_and_of_a_gone_one():
    p = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.2\n"
                          "while time.process_time() < end: pass\nimport sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while procfs.run_seconds(p.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procfs.run_seconds(p.pid) >= 0.2
        assert abs(procfs.run_seconds(p.pid) - procfs.cpu_seconds(p.pid)) < 0.05
    finally:
        p.communicate(b"")
    assert procfs.run_seconds(p.pid) == 0.0


def test_cpu_split_tells_kernel_time_from_user_time():
    """After start-up, a process summing ranges in Python spends user time (process_time() itself is a
    syscall, hence not called in a tight loop); one reading /dev/zero in 1 MiB reads
    spends system time (the kernel fills the buffers)."""
    work = {"user": "while time.process_time() < end: sum(range(20000))",
            "sys": "fd = os.open('/dev/zero', os.O_RDONLY)\nwhile time.process_time() < end: os.read(fd, 1 << 20)"}
    for kind, loop in work.items():
        code = f"import os, sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.4\n{loop}\nprint('done', flush=True)\nsys.stdin.readline()"
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)  # start-up (imports: system time of its own) is over before the first reading
            u0, s0 = procfs.cpu_split(p.pid)
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            u1, s1 = procfs.cpu_split(p.pid)
            assert abs(u1 + s1 - procfs.cpu_seconds(p.pid)) < 0.02
            user, system = u1 - u0, s1 - s0
            assert user + system >= 0.3, (kind, user, system)
            assert (user > 2 * system) if kind == "user" else (system > 2 * user), (kind, user, system)
        finally:
            p.communicate("\n")
    assert procfs.cpu_split(p.pid) == (0.0, 0.0)
