"""A worker process: unified (prefill + decode), or one half of a PD pair (--role prefill | decode).

Request life: the gateway sends token ids over a persistent msgpack connection; the engine thread
matches the radix cache, schedules, runs the model and streams TokenOutput frames back. In PD mode a
prefill worker computes the prompt and pushes its KV over UCX to the decode worker the gateway paired it
with, which reserves slots, takes the pages in and decodes (shared/pd/: kv_push.py, kv_receive.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import uuid

from services.worker.server import WorkerServer
from shared import event_loop
from shared.cli_config import HelpFormatter, add_config_arg, parse_with_config
from shared.engine.cli import add_engine_args, engine_config_from_args, engine_flag_error
from shared.engine.config import EngineConfig
from shared.engine.spec import SpecConfigError, spec_config_error
from shared.engine.engine_loop import Engine
from shared.gc_freeze import freeze_startup_heap
from shared.metadata.kv_events import KvEventPublisher, WorkerLoad
from shared.metadata.registration import Registration
from shared.metadata.store import WORKER_TTL_S, create_store
from shared.tokenizer import Tokenizer
from shared.wire import INTERNAL_KEY_ENV, WORKER_MAX_FRAME, internal_key

log = logging.getLogger("services.worker")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__, formatter_class=HelpFormatter)
    add_config_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on: loopback by default (worker ports are private; widen with "
                        "e.g. 0.0.0.0 only on a private network, with --internal-key)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--advertise-host", default=None,
                   help="address gateways should dial (default: --host, or this host's name if --host is a wildcard)")
    p.add_argument("--role", default="unified", choices=["unified", "prefill", "decode"],
                   help="unified computes whole requests; prefill/decode are the halves of a PD pair")
    p.add_argument("--transfer-port", type=int, default=0,
                   help="decode role: UCX port of the KV receiver (0 picks a free one)")
    p.add_argument("--worker-id", default=None, help="name in the registry and logs (default: host-pid-random)")
    p.add_argument("--redis-url", default=None, help="register in this Redis for gateway discovery")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")
    p.add_argument("--internal-key", default=None,
                   help=f"shared secret every connection (gateway, KV transfer) must present; default "
                        f"${INTERNAL_KEY_ENV} (unset: no key, loopback-only use)")
    p.add_argument("--max-frame-bytes", type=int, default=WORKER_MAX_FRAME,
                   help="largest frame accepted from the gateway")
    p.add_argument("--drain-grace", type=float, default=1.0,
                   help="on SIGTERM, seconds between saying not ready and waiting for running requests")
    p.add_argument("--log-level", default="warning", help="debug | info | warning | error")
    add_engine_args(p)
    args = parse_with_config(p, argv)
    error = engine_flag_error(args) or spec_config_error(engine_config_from_args(args))
    if error:
        p.error(error)
    return args


def worker_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config for this worker's role. A unified worker moves no KV between workers, so its pool
    leaves no room for a transfer budget (--kv-transfer-max-bytes' derived default is a PD worker's)."""
    config = engine_config_from_args(args)
    if args.role == "unified" and config.kv_transfer_max_bytes is None:
        config = dataclasses.replace(config, kv_transfer_max_bytes=0)
    return config


async def serve(args: argparse.Namespace) -> None:
    if args.role in ("prefill", "decode"):
        from shared.pd import require_ucx

        try:
            require_ucx(f"a {args.role} worker")
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
    config = worker_engine_config(args)
    tokenizer = Tokenizer.load(config.model_path)
    engine = Engine(config, tokenizer, on_output=lambda outs: None)
    loop = asyncio.get_running_loop()
    key = internal_key(args.internal_key)
    if not key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning(
            "listening on %s without --internal-key: anyone who can reach this port can use the worker",
            args.host)
    advertise = args.advertise_host or (socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host)
    transfer, transfer_addr = None, None
    if args.role == "prefill":
        from shared.pd.kv_push import KvPush

        transfer = KvPush(engine, loop, key=key)
    elif args.role == "decode":
        from shared.pd.kv_receive import KvReceive

        transfer = KvReceive(engine, loop, key=key)
        transfer_addr = (advertise, await transfer.start(args.transfer_port))
    server = WorkerServer(engine, args.role, transfer, transfer_addr, internal_key=key,
                          max_frame=args.max_frame_bytes)
    port = await server.start(args.host, args.port)
    engine.start()
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = create_store(args.redis_url) if args.redis_url else None
    stop = event_loop.stop_on_signals()

    kv_events = kv_task = None
    if args.redis_url:
        kv_events = start_kv_events(args.redis_url, worker_id, key, engine)
        if kv_events is not None:
            server.kv_events = kv_events
            kv_task = loop.create_task(kv_events.run(), name="kv-events")

    def entry() -> dict:
        load = worker_load(engine)
        e = {"host": advertise, "port": port, "role": args.role, "model_path": config.model_path,
             "num_running": load.running, "num_waiting": load.waiting, "kv_usage": load.kv_usage,
             "kv_events": kv_events is not None}
        if transfer_addr is not None:
            e["transfer_host"], e["transfer_port"] = transfer_addr
        return e

    registry = Registration(store, worker_id, entry) if store is not None else None
    if registry is not None:
        await registry.beat()  # discoverable before anyone is told it is ready (if Redis is up)
    freeze_startup_heap()
    print(f"WORKER READY {args.host}:{port} id={worker_id} role={args.role}", flush=True)
    try:
        while not stop.is_set():
            delay = await registry.beat() if registry is not None else WORKER_TTL_S / 3
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
    finally:
        # Drain: not ready first (gateways stop routing here, the registry entry goes), a short grace
        # for routers to notice, then accepted requests finish (bounded), then stop.
        log.warning("draining: %d requests running", engine.policy.num_running())
        server.start_draining()
        if registry is not None:
            await registry.leave()
        await asyncio.sleep(args.drain_grace)
        deadline = loop.time() + args.drain_timeout
        while not engine.is_idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not engine.is_idle():
            log.warning("drain timeout: stopping with requests still running")
        await server.close()
        if kv_task is not None:
            kv_events.stop()
            kv_task.cancel()
        engine.stop()
        if args.role == "decode":
            transfer.close()


def worker_load(engine: Engine) -> WorkerLoad:
    """What the worker runs and queues, and the share of its KV pool in use (read off the engine thread:
    a moment's figures, for routing)."""
    total = engine.runner.max_total_tokens
    free = engine.allocator.available_size() + engine.cache.evictable_size()
    return WorkerLoad(running=engine.policy.num_running(), waiting=len(engine.policy.waiting),
                      kv_usage=round(1.0 - free / total, 4) if total else 0.0)


def start_kv_events(redis_url: str, worker_id: str, key: str, engine: Engine) -> KvEventPublisher | None:
    """Publish the radix tree's blocks to Redis for the gateways' exact index (None: no tree to publish)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
    publisher = KvEventPublisher(client, worker_id, key, engine.call, load=lambda: worker_load(engine))
    return publisher if publisher.attach(engine.cache) else None


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from shared.models.parallel import TPConfigError
    from shared.models.quantization import UnsupportedQuantization
    from shared.cache.host_pool import HostTierError

    try:
        event_loop.run(serve(args))
    except (UnsupportedQuantization, TPConfigError, SpecConfigError, HostTierError) as e:  # a model we cannot run this way: say so, no traceback
        raise SystemExit(f"error: {e}") from None
    from shared.engine.tp import teardown_stuck

    if teardown_stuck():
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
