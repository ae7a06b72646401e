"""`python -m services.gateway --model-path P --workers host:port[,...]`: tokenize, validate, route to
workers, translate their streams into the OpenAI and SGLang-native APIs."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys

from aiohttp import web

from services.gateway.app import create_app
from services.gateway.cli import add_gateway_args
from services.gateway.limits import Limits
from services.gateway.programs.limits import ProgramBudget
from services.gateway.routing.router import Router
from services.gateway.api import reasoning
from services.gateway.state import GatewayState
from services.gateway.api.tool_parsers import resolve_parser
from services.gateway.routing.worker_client import WorkerClient, parse_worker_list
from shared import event_loop
from shared.cli_config import HelpFormatter, add_config_arg, parse_with_config
from shared.gc_freeze import freeze_startup_heap, space_young_collections
from shared.tokenizer import Tokenizer

log = logging.getLogger("services.gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__, formatter_class=HelpFormatter)
    add_config_arg(p)
    p.add_argument("--model-path", required=True, help="the workers' model: hub id or directory (tokenizer, name)")
    p.add_argument("--workers", default="", help="host:port[,host:port...] (static; may be empty with --redis-url)")
    p.add_argument("--redis-url", default=None, help="discover workers registered in this Redis")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument("--context-length", type=int, default=None, help="defaults to what the workers report")
    p.add_argument("--internal-key", default=None,
                   help="the workers' shared secret, sent when connecting to them (default $RADIXSERVE_INTERNAL_KEY)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")
    p.add_argument("--drain-grace", type=float, default=1.0,
                   help="on SIGTERM, seconds /health says 503 before the listener closes (routers notice)")
    add_gateway_args(p)
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")
    # One process of a --gateway-processes pool (services/gateway/pool.py starts it, never a user):
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


async def start_gateway(args: argparse.Namespace) -> tuple[web.AppRunner, GatewayState]:
    """Start the gateway inside the caller's event loop (a launcher runs several services in one); `args`
    as build_parser parses them."""
    from services.gateway.routing.affinity import PrefixAffinityPolicy
    from services.gateway.routing.cache_aware import CacheAwarePolicy

    tokenizer_path = args.tokenizer_path or args.model_path
    tokenizer = await asyncio.to_thread(Tokenizer.load, tokenizer_path)
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                tokenizer.set_chat_template(f.read())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--chat-template {args.chat_template}: {e}") from None
    workers = [WorkerClient(host, port, internal_key=args.internal_key)
               for host, port in parse_worker_list(args.workers)] if args.workers else []
    if not workers and not args.redis_url:
        raise SystemExit("give --workers host:port[,...] or --redis-url to discover workers")
    tool_parser = resolve_parser(args.tool_call_parser, tokenizer.chat_template)
    reasoning_parser = reasoning.ALIASES.get(args.reasoning_parser)  # a flag's choice, or None
    policy = PrefixAffinityPolicy() if args.routing_policy == "prefix-affinity" else CacheAwarePolicy()
    state = GatewayState(tokenizer=tokenizer, served_model_name=args.served_model_name or args.model_path,
                         model_path=args.model_path, router=Router(workers, policy, args.pd_bypass_tokens),
                         context_length=args.context_length, api_key=args.api_key, admin_api_key=args.admin_api_key,
                         limits=Limits(max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                                       strict_sampling_params=args.strict),
                         tokenizer_path=tokenizer_path, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                         program_budget=ProgramBudget(max_running_per_key=args.max_programs_per_key),
                         fork_hint=not args.disable_fork_hint, process=(args.process_index, args.gateway_processes),
                         drain_grace=args.drain_grace)
    app = create_app(state)
    if args.redis_url:
        from services.gateway.routing.discovery import WorkerDiscovery
        from shared.metadata.store import RedisStore
        from shared.wire import internal_key

        discovery = WorkerDiscovery(RedisStore(args.redis_url), state.router, internal_key=args.internal_key)
        await discovery.refresh_once()  # Redis down: serve the --workers list, pick up the registry later
        discovery.start()
        state.router.follow_kv_events(args.redis_url, internal_key(args.internal_key))

        async def _stop_discovery(_app):
            await state.router.close()
            await discovery.close()
        app.on_cleanup.append(_stop_discovery)
    # handler_cancellation: a client that hangs up cancels its handler, whose cleanup aborts the request on
    # the worker; shutdown_timeout: on stop, requests in flight get this long to finish first.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=args.drain_timeout)
    await runner.setup()
    if args.listen_fd is not None:  # the pool's socket, shared with the other gateway processes
        await web.SockSite(runner, socket.socket(fileno=args.listen_fd)).start()
    else:
        await web.TCPSite(runner, args.host, args.port).start()
    return runner, state


async def stop_gateway(runner: web.AppRunner, state: GatewayState) -> None:
    """Drain: /health says 503 at once, new requests are still served for the grace period (a load
    balancer needs a moment to notice), then the listener closes and requests in flight finish
    (up to --drain-timeout) before their handlers are cancelled."""
    state.draining = True
    log.warning("draining: not ready; %d requests in flight", len(state.dispatcher.inflight))
    await asyncio.sleep(state.drain_grace)
    await runner.cleanup()


async def _main(args: argparse.Namespace) -> None:
    runner, state = await start_gateway(args)
    workers = ",".join(w.address for w in state.router.workers)
    freeze_startup_heap()
    space_young_collections()
    stop = event_loop.stop_on_signals()
    follower = None
    if args.listen_fd is not None:
        from services.gateway.pool import READY_PREFIX

        await state.router.wait_connected(30)  # ready means routable, as the launcher's READY
        follower = asyncio.get_running_loop().create_task(_follow_pool(state), name="pool-control")
        print(f"{READY_PREFIX}{args.host}:{args.port} process {args.process_index} of {args.gateway_processes}",
              flush=True)
    else:
        print(f"gateway ready on http://{args.host}:{args.port} (model {state.served_model_name}, "
              f"workers {workers})", flush=True)
    await stop.wait()
    if follower is not None:
        follower.cancel()
    await stop_gateway(runner, state)


async def _follow_pool(state: GatewayState) -> None:
    """A pool process's stdin: what the stack's supervisor says about workers, one JSON line each."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            msg = json.loads(line)
            state.health.supervisor_says(msg["worker"], msg.get("status"), restarts=msg.get("restarts"),
                                  last_exit=msg.get("last_exit"))
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed pool control line: %r", line[:200])


def main() -> None:
    args = parse_with_config(build_parser())
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.gateway_processes < 1:
        raise SystemExit("--gateway-processes must be >= 1")
    if args.gateway_processes > 1 and args.listen_fd is None:
        from services.gateway.pool import serve

        sys.exit(event_loop.run(serve(args, sys.argv[1:])))
    event_loop.run(_main(args))


if __name__ == "__main__":
    main()
