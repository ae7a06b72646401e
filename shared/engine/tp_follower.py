"""One tensor-parallel rank > 0, a process of its own (shared/engine/tp.py says how the ranks work
together): its end of rank 0's pipe, and its main, which builds a ModelRunner on this rank's device and
replays rank 0's commands until told to stop. TPLeader starts it as `python -m shared.engine.tp_follower`.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

import torch

from shared.engine.config import EngineConfig
from shared.parent_death import die_with_parent
from shared.engine.tp import follower_device, join_process_group, leave_process_group, rendezvous_store

log = logging.getLogger(__name__)


class TPFollowerLink:
    """A follower's side of the pipe: reports its load, then receives rank 0's commands."""

    is_leader = False

    def __init__(self, conn):
        self.conn = conn
        self.orphaned = False  # rank 0 went away without saying stop: no group left to leave with it

    def ready(self) -> None:
        self.conn.send(("ready", None))

    def commands(self):
        while True:
            try:
                cmd = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.orphaned = True
                return  # rank 0 is gone
            if cmd[0] == "stop":
                return
            yield cmd

    def close(self) -> None:
        pass


def _follower_main(rank: int, port: int, conn: Connection, parent_pid: int) -> None:
    # SIGKILL when rank 0 dies: the ModelRunner is built on a thread that lives as long as the engine.
    die_with_parent(signal.SIGKILL, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's Ctrl-C is rank 0's to handle
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{rank} %(name)s %(levelname)s %(message)s")
    from shared.engine.model_runner import ModelRunner  # after the death signal is set

    link = TPFollowerLink(conn)
    try:
        config: EngineConfig = conn.recv()
        device = follower_device(config.device, rank)
        if device.type != "cuda":  # the ranks share the cores: N ranks x all-core thread pools thrash
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
        conn.send(("started", None))
        join_process_group(rank, config.tp_size, rendezvous_store(config.tp_size, port), device)
        runner = ModelRunner(config, tp=link, tp_rank=rank)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    try:
        with torch.no_grad():
            for cmd in link.commands():
                runner.follow(cmd)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # our part of rank 0's last collectives
    if not link.orphaned:
        runner.drop_graphs()
        leave_process_group()  # together with rank 0 (TPLeader.close)
    os._exit(0)  # nothing to flush; skips a slow interpreter teardown


if __name__ == "__main__":
    _p = argparse.ArgumentParser(description="one tensor-parallel rank > 0 (started by rank 0, never by hand)")
    for _flag in ("--rank", "--port", "--fd", "--parent"):
        _p.add_argument(_flag, type=int, required=True)
    _a = _p.parse_args()
    _follower_main(_a.rank, _a.port, Connection(_a.fd), _a.parent)
