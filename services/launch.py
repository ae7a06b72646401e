"""Start a whole stack on this machine: worker processes, then the gateway in this process.

    python -m services.launch --model-path tiny-random [--topology unified] [--workers N] [--port 30000]
    python -m services.launch --model-path tiny-random --topology pd [--prefill N] [--decode N]

PD topology: prefill workers compute prompts and push their KV over UCX to decode workers, which decode
(services/prefill, services/decode); the gateway pairs them per request. `--worker-gpus 0,1` pins worker i
to GPU i mod 2 (prefill workers first; every worker still sees every GPU, so UCX can move KV pages
between them with cuda_ipc); workers sharing one GPU need a smaller --mem-fraction-static.

Prints `READY http://HOST:PORT workers=...` once the gateway answers and every worker is up. A worker
that exits is restarted on its port with backoff (services/supervisor.py); after --max-restarts in a
minute it stays down and the gateway's /health names it. Only SIGINT/SIGTERM stop the stack: the gateway
drains first (not ready, grace, in-flight requests finish), then the workers do the same.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import secrets
import sys

from services.gateway.cli import add_gateway_args, gateway_args_to_argv
from services.gateway.pool import GatewayPool
from services.supervisor import RestartPolicy, WorkerSlot
from shared import event_loop
from shared.cli_config import HelpFormatter, add_config_arg, parse_with_config
from shared.engine.cli import add_engine_args, engine_args_to_argv, engine_config_from_args, engine_flag_error, tp_size_arg
from shared.engine.spec import spec_config_error
from shared.wire import INTERNAL_KEY_ENV

log = logging.getLogger("services.launch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.launch", description=__doc__, formatter_class=HelpFormatter)
    add_config_arg(p)
    p.add_argument("--topology", default="unified", choices=["unified", "pd"],
                   help="unified: workers compute whole requests; pd: prefill and decode workers (UCX)")
    p.add_argument("--workers", type=int, default=1, help="unified workers to start")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (pd topology)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (pd topology)")
    p.add_argument("--prefill-tp-size", type=tp_size_arg, default=None,
                   help="pd topology: tensor-parallel ranks of each prefill worker (default: --tp-size); KV "
                        "moves whole-model, so the two pools may be sharded differently")
    p.add_argument("--decode-tp-size", type=tp_size_arg, default=None,
                   help="pd topology: tensor-parallel ranks of each decode worker (default: --tp-size)")
    p.add_argument("--worker-gpus", default=None,
                   help="comma-separated GPU ids, handed out to the workers in order, as many per worker as "
                        "its tensor-parallel ranks (a worker's ranks run on cuda:K and the GPUs after it); "
                        "the list wraps around")
    p.add_argument("--redis-url", default=None, help="routing metadata in Redis (default: in memory)")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=int, default=30000, help="the gateway's HTTP port")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before stopping")
    p.add_argument("--drain-grace", type=float, default=1.0,
                   help="on SIGTERM, seconds a service keeps serving while saying not ready, so routers notice")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one worker per minute; one more exit and it stays down")
    p.add_argument("--restart-backoff", type=float, default=0.5,
                   help="seconds before the first restart of a worker; doubles per restart in the minute")
    p.add_argument("--log-level", default="warning", help="debug | info | warning | error")
    add_gateway_args(p, forward_only=True)
    add_engine_args(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_config(p, argv)
    if args.workers < 1 or args.prefill < 1 or args.decode < 1:
        p.error("--workers, --prefill and --decode must be >= 1")
    if args.worker_gpus is not None and not all(x.strip().isdigit() for x in args.worker_gpus.split(",")):
        p.error("--worker-gpus must be comma-separated GPU ids, e.g. 0,1")
    if (args.prefill_tp_size is not None or args.decode_tp_size is not None) and args.topology != "pd":
        p.error("--prefill-tp-size and --decode-tp-size apply to the pd topology")
    error = engine_flag_error(args)
    if error:
        p.error(error)
    spec_error = spec_config_error(engine_config_from_args(args))
    if spec_error:
        p.error(spec_error)
    if args.topology == "pd":
        from shared.pd import require_ucx

        try:
            require_ucx("--topology pd")
        except RuntimeError as e:
            p.error(str(e))
    return args


def worker_roles(args: argparse.Namespace) -> list[str]:
    if args.topology == "pd":
        return ["prefill"] * args.prefill + ["decode"] * args.decode
    return ["unified"] * args.workers


def worker_tp_size(args: argparse.Namespace, role: str) -> int:
    """Tensor-parallel ranks of a worker of this role."""
    own = {"prefill": args.prefill_tp_size, "decode": args.decode_tp_size}.get(role)
    return own if own is not None else args.tp_size


def _worker_cmd(args: argparse.Namespace, index: int, role: str, first_gpu: int = 0):
    """`first_gpu`: this worker's place in --worker-gpus (the ranks of the workers before it come first)."""
    tp = worker_tp_size(args, role)

    def cmd(port: int) -> list[str]:
        argv = [sys.executable, "-m", "services.worker", "--role", role, "--host", "127.0.0.1",
                "--port", str(port), "--worker-id", f"{role}-{index}", "--log-level", args.log_level,
                "--drain-timeout", str(args.drain_timeout), "--drain-grace", str(args.drain_grace),
                *engine_args_to_argv(args)]
        if tp != args.tp_size:
            argv += ["--tp-size", str(tp)]  # the last one given wins
        if args.redis_url:
            argv += ["--redis-url", args.redis_url]
        if args.worker_gpus:
            gpus = [g.strip() for g in args.worker_gpus.split(",")]
            # A tensor-parallel worker's ranks take the GPUs after its first (cuda:N .. N+tp-1).
            argv += ["--device", f"cuda:{gpus[first_gpu % len(gpus)]}"]
        return argv
    return cmd


def worker_cmds(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(slot name, command builder) of every worker, GPUs handed out in order, tp_size ranks each."""
    out, first_gpu = [], 0
    for i, role in enumerate(worker_roles(args)):
        out.append((f"{role}-{i}", _worker_cmd(args, i, role, first_gpu)))
        first_gpu += worker_tp_size(args, role)
    return out


def _gateway_argv(args: argparse.Namespace, addrs: list[str]) -> list[str]:
    argv = ["--model-path", args.model_path, "--workers", ",".join(addrs), "--host", args.host,
            "--port", str(args.port), "--log-level", args.log_level]
    argv += ["--drain-timeout", str(args.drain_timeout), "--drain-grace", str(args.drain_grace)]
    if args.redis_url:
        argv += ["--redis-url", args.redis_url]
    return argv + gateway_args_to_argv(args)


async def run(args: argparse.Namespace) -> int:
    from shared.gc_freeze import freeze_startup_heap, space_young_collections

    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=60.0, backoff_s=args.restart_backoff)
    slots = [WorkerSlot(name, cmd, policy) for name, cmd in worker_cmds(args)]
    stop = event_loop.stop_on_signals()
    runner, state, pool = None, None, None
    processes = getattr(args, "gateway_processes", None) or 1
    try:
        starting = [asyncio.ensure_future(s.start()) for s in slots]
        if processes == 1:
            # The gateway's modules (~2.7 s of imports on a 2-core box: xgrammar, chat templates) load in
            # this process while the workers start, not before them.
            try:
                gateway_main = await asyncio.to_thread(importlib.import_module, "services.gateway.__main__")
            except BaseException:
                for t in starting:  # a starting worker is killed when its start is cancelled
                    t.cancel()
                await asyncio.gather(*starting, return_exceptions=True)
                raise
        started = await asyncio.gather(*starting, return_exceptions=True)
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            print(f"launch failed: {errors[0]}", file=sys.stderr, flush=True)
            return 1
        addrs = list(started)
        if processes > 1:
            # A pool of gateway processes on the port (services/gateway/pool.py); each is told of
            # workers going down and coming back through its control pipe.
            pool = GatewayPool(_gateway_argv(args, addrs), processes, args.host, args.port, policy)
            try:
                await pool.start()
            except (OSError, RuntimeError) as e:
                print(f"launch failed: {e}", file=sys.stderr, flush=True)
                return 1

            async def on_change(slot: WorkerSlot, what: str) -> None:
                pool.worker_status(slot.address, what if what != "up" else None, restarts=slot.restarts,
                                   last_exit=slot.last_exit)
        else:
            runner, state = await gateway_main.start_gateway(
                gateway_main.build_parser().parse_args(_gateway_argv(args, addrs)))
            freeze_startup_heap()
            space_young_collections()  # this process is the gateway's

            async def on_change(slot: WorkerSlot, what: str) -> None:
                # The gateway hears from the supervisor at once: /health names a worker that is down, and
                # a restarted one is dialled now rather than after the client's reconnect backoff.
                state.health.supervisor_says(slot.address, what if what != "up" else None,
                                      restarts=slot.restarts, last_exit=slot.last_exit)

            for w in state.router.workers:
                w.start()
            await state.router.wait_connected(30)  # ready means routable
        for slot in slots:
            slot.on_change = on_change
            slot.watch()
        print(f"READY http://{args.host}:{args.port} workers={','.join(addrs)}", flush=True)
        await stop.wait()
        log.warning("stopping: draining the gateway, then the workers")
    finally:
        if runner is not None:
            # The gateway says not ready, then lets requests in flight finish (workers are still up).
            await gateway_main.stop_gateway(runner, state)
        if pool is not None:
            await pool.stop(args.drain_timeout + args.drain_grace + 10)
        await asyncio.gather(*(s.stop(args.drain_timeout + args.drain_grace + 15) for s in slots))
        log.warning("stopped")
    return 0


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Worker ports are private to this stack: one random key, handed to every process through the
    # environment (never argv, which `ps` shows); an operator's own $RADIXSERVE_INTERNAL_KEY wins.
    if not os.environ.get(INTERNAL_KEY_ENV):
        os.environ[INTERNAL_KEY_ENV] = secrets.token_urlsafe(32)
    sys.exit(event_loop.run(run(args)))


if __name__ == "__main__":
    main()
