"""The launcher's restart policy on a stand-in worker (no model): an exiting worker is restarted on
its port with backoff, and after --max-restarts exits within the window it stays down."""
from __future__ import annotations

import asyncio
import os
import sys

from services.supervisor import RestartPolicy, WorkerSlot

# Prints the ready line with the port it was given (a free one invented the first time), then exits 3.
FAKE = ("import sys; port = int(sys.argv[1]) or 40123; print(f'WORKER READY 127.0.0.1:{port} id=x', flush=True); "
        "sys.exit(3)")


def test_restarts_with_backoff_then_stays_down():
    async def main():
        seen: list[tuple[str, str, int]] = []
        ports: list[int] = []

        def cmd(port: int) -> list[str]:
            ports.append(port)
            return [sys.executable, "-c", FAKE, str(port)]

        slot = WorkerSlot("unified-0", cmd, RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.05))
        slot.on_change = lambda s, state: seen.append((state, s.address, s.restarts))
        assert await slot.start() == "127.0.0.1:40123"
        slot.watch()
        await asyncio.wait_for(slot._task, 20)
        return seen, ports, slot

    seen, ports, slot = asyncio.run(main())
    assert ports == [0, 40123, 40123]  # restarted on the same port: the gateway's connection comes back
    assert [s for s, _, _ in seen] == ["up", "restarting", "up", "restarting", "up", "down"]
    assert slot.state == "down" and slot.restarts == 2 and slot.last_exit == 3


def test_stop_ends_supervision():
    """And the worker ran in a process group of its own (out of the terminal's Ctrl-C) but in the launcher's
    session: a session of its own would be a CPU scheduling group of its own too (autogroup)."""
    async def main():
        slot = WorkerSlot("unified-0", lambda port: [sys.executable, "-c",
                                                     "print('WORKER READY 127.0.0.1:40999 id=x', flush=True); "
                                                     "import time; time.sleep(60)"])
        await slot.start()
        groups = os.getpgid(slot.proc.pid), os.getsid(slot.proc.pid)
        slot.watch()
        await slot.stop(10)
        return slot, groups

    slot, (group, session) = asyncio.run(main())
    assert slot.proc.returncode is not None and slot._task.done()
    assert group == slot.proc.pid != os.getpgid(0) and session == os.getsid(0)


def test_a_worker_that_cannot_start_again_ends_down():
    """Failed restarts (exit before the ready line, e.g. its port taken) count against the budget."""
    fails = "import sys; port = int(sys.argv[1]); print(f'WORKER READY 127.0.0.1:40124 id=x', flush=True) " \
            "if port == 0 else None; sys.exit(1)"

    async def main():
        slot = WorkerSlot("unified-0", lambda port: [sys.executable, "-c", fails, str(port)],
                          RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.01))
        states: list[str] = []
        slot.on_change = lambda s, state: states.append(state)
        await slot.start()
        slot.watch()
        await asyncio.wait_for(slot._task, 20)
        return states, slot

    states, slot = asyncio.run(main())
    assert states == ["up", "restarting", "restarting", "restarting", "down"] and slot.restarts == 0
