"""Tensor parallelism across processes: one process per rank, rank 0 in charge.

Rank 0 is the worker process itself: it owns the network side, the scheduler, the radix cache and
sampling, exactly as with one device. Ranks 1..N-1 are followers it spawns (shared/engine/tp_follower.py):
each holds its shard of the weights and of the KV heads, and repeats rank 0's device work. For every
forward pass rank 0 sends them one small command over a pipe (the batch's inputs and slot writes), then
one per logits computation and one before the sampled tokens are broadcast (and the host KV tier's copies,
shared/cache/host_pool.py, mostly riding along with the next of these); so every rank launches the
same kernels and collectives in the same order, and every rank feeds the same token into the next step
whatever the sampling needed (grammar masks, penalties, per-request seeds live on rank 0 only).

Why not run the same scheduler on every rank: what it decides depends on host state that differs
between processes (grammars finishing their compile on threads, timeouts, admin calls), and one
divergent decision would deadlock the collectives. One scheduler cannot diverge from itself.

Followers die with rank 0: their pipe reads end at EOF, the kernel sends them SIGKILL when the worker
dies (PR_SET_PDEATHSIG), and rank 0 exits if a follower dies (its ranks' collectives would hang), or if its
own work for a command it sent them fails part-way (TPLeader.lockstep).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from shared.engine.config import EngineConfig
from shared.models.parallel import set_tp

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 1800.0  # a 70B shard loading from a slow disk
_TEARDOWN_TIMEOUT_S = 20.0  # leaving the process group at shutdown
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th GPU after the worker's own (cuda:N -> cuda:N+r); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def follower_device(base: str, rank: int) -> torch.device:
    """Rank r's device, made current, from the base device rank 0 resolved ("cpu" or "cuda:N"), without
    making the base GPU current on the way: since CUDA 12 that creates a context there (~0.5 GB of rank 0's
    GPU a follower, taken before rank 0 sizes its KV pool from what is free)."""
    device = rank_device(torch.device(base), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def rendezvous_store(size: int, port: int = 0):
    """The group's rendezvous store. Rank 0 (`port` 0) listens on a port the kernel picks while binding:
    a port picked free and bound later can be taken in between (CI saw EADDRINUSE). Followers connect
    to the port rank 0 passes them."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size=size, is_master=port == 0, timeout=_COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def join_process_group(rank: int, size: int, store, device: torch.device) -> None:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT,
                            **kwargs)
    set_tp(rank, size)


class TPLeader:
    """Rank 0's handle on its followers: spawn, wait until loaded, send commands, stop."""

    is_leader = True

    def __init__(self, config: EngineConfig, device: torch.device):
        self.size = config.tp_size
        store = rendezvous_store(self.size)
        port = store.port
        # Plain subprocesses rather than multiprocessing's spawn: that would re-import the caller's main
        # module in every rank (a script without a __main__ guard would recurse).
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "shared.engine.tp_follower", "--rank", str(rank), "--port", str(port),
                 "--fd", str(theirs.fileno()), "--parent", str(os.getpid())],
                pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            # The base device, resolved here: "auto"/"cuda" resolved in a rank would name the GPU that
            # rank already made current, and the rank offset would be added twice.
            conn.send(dataclasses.replace(config, device=str(device)))
            self.procs.append(proc)
            self.conns.append(conn)
        self._closed = False
        self._deferred: list[tuple] = []  # commands that go with the next one sent (defer)
        self._watchdog: threading.Thread | None = None
        try:
            # A rank that fails before the rendezvous would leave this one waiting: hear from each first.
            self._await("started")
            join_process_group(0, self.size, store, device)
        except BaseException:
            self.close()
            raise

    def _await(self, status: str) -> None:
        """Wait for every follower to report `status` (a failure comes with its traceback)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) before "
                                       f"it was {status}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} was not {status} within {_READY_TIMEOUT_S:.0f} s")
            got, detail = conn.recv()
            if got != status:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")

    def ready(self) -> None:
        """Wait for every follower to have loaded its shard; from here on a dead follower ends the worker."""
        self._await("ready")
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def send(self, cmd: tuple) -> None:
        """Send a command to every follower, after the deferred ones (in the same message)."""
        if self._deferred:
            cmd, self._deferred = ("batch", [*self._deferred, cmd]), []
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def defer(self, cmd: tuple) -> None:
        """Send a command with the next one (one message): for work the followers need only before whatever device
        work rank 0 sends them next (the host KV tier's writes and the completions rank 0 saw; host_pool.py)."""
        self._deferred.append(cmd)

    def _watch(self) -> None:
        """A dead follower leaves rank 0's next collective waiting forever: end the worker instead, so
        its supervisor restarts the whole group."""
        while not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self._closed:
                    log.critical("tensor-parallel rank %d died (exit code %s); stopping the worker%s", rank,
                                 proc.returncode, self._last_words(rank))
                    self._end_group()
            time.sleep(0.5)

    def _last_words(self, rank: int) -> str:
        """The traceback a follower sent before it exited, if any: one that fails building its runner after
        ready() (its KV pool sizing, say, with less memory free on its GPU than rank 0's) reports it only here."""
        conn = self.conns[rank - 1]
        try:
            if conn.poll(0):
                return ":\n" + str(conn.recv()[1])
        except (EOFError, OSError, ValueError, TypeError, IndexError, pickle.UnpicklingError):
            pass
        return ""

    def _end_group(self) -> None:
        self._closed = True  # (the watchdog's work is done)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        os._exit(70)

    @contextlib.contextmanager
    def lockstep(self):
        """Rank 0's device work for a command just sent. If it raises part-way, the other ranks are left in
        collectives rank 0 never joins, or that its next ones would pair with (another shape: a hang, or
        garbage): the group cannot go on, so the worker ends, as when a follower dies. (With one device the
        engine recovers from a failed step: shared/engine/engine_loop.py `_recover`.)"""
        try:
            yield
        except BaseException:
            log.critical("tensor-parallel rank 0 failed between a command and its collectives; stopping the "
                         "worker", exc_info=True)
            self._end_group()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        everyone = all(proc.poll() is None for proc in self.procs)
        if everyone and torch.cuda.is_available() and torch.cuda.is_initialized():
            # The last pass's collectives complete before the ranks go (with a rank dead they never would).
            torch.cuda.synchronize()
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except (OSError, ValueError):
                pass
        # Every rank leaves the group together (the followers do on "stop"): NCCL's teardown waits for
        # its peers, so destroying it here after they exited hung the worker's shutdown on the H200.
        leave_process_group(graceful=everyone)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for conn in self.conns:
            conn.close()


def leave_process_group(graceful: bool = True) -> None:
    """Leave the process group: every rank at once when all are alive (`graceful`); otherwise (a rank
    died) NCCL's communicators are aborted, which waits for no peer. Either way torch's group registry
    is cleared, so a later engine in this process can form a new group."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        if not graceful and dist.get_backend() == "nccl" and hasattr(c10d, "_abort_process_group"):
            teardown = c10d._abort_process_group
        else:
            teardown = dist.destroy_process_group
        # Bounded: a teardown stuck in NCCL (seen on the H200 before the graphs were dropped first) must
        # not hang the worker's shutdown; the process is leaving anyway.
        done = threading.Thread(target=teardown, name="tp-teardown", daemon=True)
        done.start()
        done.join(_TEARDOWN_TIMEOUT_S)
        if done.is_alive():
            global _teardown_stuck
            _teardown_stuck = True
            log.warning("tensor-parallel group teardown did not finish in %.0f s; left behind (the process "
                        "exits without interpreter teardown)", _TEARDOWN_TIMEOUT_S)
    set_tp(0, 1)


_teardown_stuck = False


def teardown_stuck() -> bool:
    """A group teardown was left behind in this process: its exit must skip the interpreter's teardown,
    where the backend's destructor would wait on it again (services/worker/__main__.py does)."""
    return _teardown_stuck
