"""The UCX KV transfer in one process (real ucxx over loopback): pages arrive intact over a kept endpoint,
and kept endpoints cost nothing while idle.

The idle check is the guard for the PD decode regression of 2026-11-30: ucxx without Python futures
awaits each operation by polling with asyncio.sleep(0), so the header receive pending on every kept
endpoint kept the decode worker's event loop spinning (a full core, the GIL taken from the engine
thread at every step). Counting event-loop iterations is independent of how loaded the machine is."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import torch

from shared.protocol import KvDone, KvHeader
from shared.pd.ucx import KvReceiver, KvSender

LAYOUT = [2, 2, 1, 4]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def count_loop_iterations(loop: asyncio.AbstractEventLoop) -> list[int]:
    counter = [0]
    run_once = loop._run_once

    def counted():
        counter[0] += 1
        run_once()

    loop._run_once = counted  # run_forever looks it up on the instance each iteration
    return counter


async def _scenario() -> None:
    arrived: dict[str, torch.Tensor] = {}
    receiver = KvReceiver(LAYOUT, "float32", alloc=lambda n: torch.empty([n, *LAYOUT]),
                          on_arrival=lambda tid, done, buf: arrived.__setitem__(tid, buf),
                          on_failure=lambda tid, reason: None)
    receiver.on_offer = lambda tid: receiver.expect(tid, 0, 8)
    port = await receiver.start(0)
    sender = KvSender()
    try:
        for i in range(3):
            tid = f"t{i}"
            t = await sender.open("127.0.0.1", port, KvHeader(transfer_id=tid, prompt_len=8, layout=LAYOUT,
                                                              dtype="float32"))
            pages = torch.randn([8, *LAYOUT])
            await sender.finish(t, pages, KvDone(transfer_id=tid, first_token=7))
            assert torch.equal(arrived[tid], pages)
        assert sender.connects == 1 and sender.reuses == 2  # one endpoint, kept and reused

        counter = count_loop_iterations(asyncio.get_running_loop())
        await asyncio.sleep(1.0)
        # Idle with a receive pending on the kept endpoint: a handful of wake-ups, not a busy loop
        # (polling awaits ran ~10^4-10^5 iterations per second here).
        assert counter[0] < 50, f"event loop ran {counter[0]} iterations in 1 s of idle"
    finally:
        receiver.close()
        for eps in sender._idle.values():
            for ep in eps:
                ep.abort()
        import ucxx

        ucxx.stop_notifier_thread()  # before asyncio.run closes the loop it posts to


def _run_scenario() -> None:
    import ucxx

    try:
        asyncio.run(asyncio.wait_for(_scenario(), 60))
    finally:
        # Aborted endpoints are released when the last reference (the scenario's frames, the loop's
        # callbacks) is collected, which can lag the loop's close: collect, then reset, a few times.
        import gc
        import time

        for attempt in range(20):
            gc.collect()
            try:
                ucxx.reset()
                break
            except Exception:
                if attempt == 19:
                    raise
                time.sleep(0.1)


def test_kept_endpoint_carries_transfers_and_idles_without_spinning():
    """In a child process: UCX's threads and context must not share the test runner's process (in the
    full suite the runner died with SIGSEGV after this test had run in it)."""
    proc = subprocess.run([sys.executable, "-m", "tests.pd.test_kv_transfer"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "scenario passed" in proc.stdout


if __name__ == "__main__":
    _run_scenario()
    print("scenario passed", flush=True)


def test_a_process_that_used_ucx_exits():
    """ucxx's notifier thread (Python futures) is not a daemon: without stopping it before the interpreter
    joins its threads, every PD worker hung on exit after SIGTERM (and so did pytest itself)."""
    code = ("import asyncio\nfrom shared.pd.ucx import _ucxx\n"
            "async def main():\n    _ucxx()\nasyncio.run(main())\nprint('done', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
