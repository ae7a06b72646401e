"""UCX's progress thread makes this worker's GPU current, not GPU 0 (ucxx's own start hook): on a machine of
several GPUs a worker of GPU 1 otherwise made a CUDA context on GPU 0, memory out of that GPU's worker's sizing.
On the CPU the hook is watched in a fresh process: torch.cuda.set_device stands in for the GPU."""
import subprocess
import sys

import pytest

from shared.pd import ucx_available
from tests.support.stack import ROOT

pytestmark = pytest.mark.skipif(not ucx_available(), reason="needs ucxx")

CHILD = r"""
import asyncio, threading, torch
calls = []
torch.cuda.set_device = lambda d: calls.append((threading.current_thread() is threading.main_thread(), str(d)))
from shared.pd import ucx

async def main():
    ucx.use_device(torch.device("cuda", 1))
    listener = ucx._ucxx().create_listener(lambda ep: None, 0)
    for _ in range(200):
        if calls:
            break
        await asyncio.sleep(0.01)
    listener.close()

asyncio.run(main())
print("CALLS", calls)
"""


def test_the_progress_thread_makes_the_workers_device_current():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "CALLS [(False, 'cuda:1')]" in out.stdout, out.stdout + out.stderr
