"""Helper processes die with the process that started them, however it dies: a SIGKILL runs no shutdown
code, and a helper in a session of its own (or one blocked on a pipe it also holds the writing end of, as a
multiprocessing pool's child is) would otherwise run on forever. The kernel's parent-death signal
(Linux's PR_SET_PDEATHSIG) needs no cooperation from the dying parent."""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """In the child: receive `sig` when the parent dies. The kernel ties it to the parent's *thread*
    that started the child, so helpers are started from a thread that lives as long as their parent
    (the main thread or its event loop's). `parent_pid`: exit at once if the parent is already gone (it
    died before this call took effect). Outside Linux nothing is set: the parent's own shutdown stops
    its helpers."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)
