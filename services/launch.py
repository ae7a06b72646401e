"""Start a whole stack on this machine: worker processes, then the gateway in this process.

    python -m services.launch --model-path tiny-random [--topology unified] [--workers N] [--port 30000]
    python -m services.launch --model-path tiny-random --topology pd [--prefill N] [--decode N]

PD topology: prefill workers compute prompts and push their KV over UCX to decode workers, which decode
(services/prefill, services/decode); the gateway pairs them per request. `--worker-gpus 0,1` pins worker i
to GPU i mod 2 (prefill workers first; every worker still sees every GPU, so UCX can move KV pages
between them with cuda_ipc); workers sharing one GPU need a smaller --mem-fraction-static.

Prints `READY http://HOST:PORT` once the gateway answers and every worker is up; stops everything
cleanly on SIGINT/SIGTERM. A worker that dies takes the stack down with a clear message rather than
leaving a gateway that routes into nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys

from shared.engine.cli import add_engine_args, engine_args_to_argv
from shared.wire import INTERNAL_KEY_ENV

_WORKER_START_TIMEOUT_S = 600


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="unified", choices=["unified", "pd"])
    p.add_argument("--workers", type=int, default=1, help="unified workers to start")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (pd topology)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (pd topology)")
    p.add_argument("--worker-gpus", default=None,
                   help="comma-separated GPU ids; worker i runs on --device cuda:ids[i %% len(ids)]")
    p.add_argument("--redis-url", default=None, help="routing metadata in Redis (default: in memory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--routing-policy", default="cache-aware", choices=["cache-aware", "prefix-affinity"])
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before stopping")
    p.add_argument("--chat-template", default=None, help="a .jinja chat template file instead of the tokenizer's")
    p.add_argument("--tool-call-parser", default=None,
                   help="hermes or llama3 (default: detected from the chat template)")
    p.add_argument("--reasoning-parser", default=None, help="qwen3, qwen3-thinking or deepseek-r1")
    p.add_argument("--log-level", default="warning")
    add_engine_args(p)
    args = p.parse_args(argv)
    if args.workers < 1 or args.prefill < 1 or args.decode < 1:
        p.error("--workers, --prefill and --decode must be >= 1")
    if args.worker_gpus is not None and not all(x.strip().isdigit() for x in args.worker_gpus.split(",")):
        p.error("--worker-gpus must be comma-separated GPU ids, e.g. 0,1")
    return args


def worker_roles(args: argparse.Namespace) -> list[str]:
    if args.topology == "pd":
        return ["prefill"] * args.prefill + ["decode"] * args.decode
    return ["unified"] * args.workers


async def _start_worker(args: argparse.Namespace, index: int, role: str
                        ) -> tuple[asyncio.subprocess.Process, str]:
    cmd = [sys.executable, "-m", "services.worker", "--role", role, "--host", "127.0.0.1", "--port", "0",
           "--worker-id", f"{role}-{index}", "--log-level", args.log_level, *engine_args_to_argv(args)]
    if args.redis_url:
        cmd += ["--redis-url", args.redis_url]
    if args.worker_gpus:
        gpus = [g.strip() for g in args.worker_gpus.split(",")]
        cmd += ["--device", f"cuda:{gpus[index % len(gpus)]}"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=None,
                                                start_new_session=True)

    async def ready_line() -> str:
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {index} exited before it was ready (code {await proc.wait()})")
            text = line.decode(errors="replace").strip()
            if text.startswith("WORKER READY "):
                return text.split()[2]

    addr = await asyncio.wait_for(ready_line(), _WORKER_START_TIMEOUT_S)
    asyncio.create_task(_drain(proc.stdout))
    return proc, addr


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def _gateway_argv(args: argparse.Namespace, addrs: list[str]) -> list[str]:
    argv = ["--model-path", args.model_path, "--workers", ",".join(addrs), "--host", args.host,
            "--port", str(args.port), "--log-level", args.log_level]
    argv += ["--drain-timeout", str(args.drain_timeout)]
    for flag in ("served_model_name", "api_key", "admin_api_key", "redis_url", "routing_policy",
                 "chat_template", "tool_call_parser", "reasoning_parser"):
        value = getattr(args, flag)
        if value:
            argv += ["--" + flag.replace("_", "-"), value]
    return argv


async def run(args: argparse.Namespace) -> int:
    from services.gateway.__main__ import build_parser as gateway_parser
    from services.gateway.__main__ import start_gateway

    procs: list[asyncio.subprocess.Process] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    code = 0
    try:
        started = await asyncio.gather(*[_start_worker(args, i, role) for i, role in enumerate(worker_roles(args))],
                                       return_exceptions=True)
        for s in started:
            if isinstance(s, tuple):
                procs.append(s[0])
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            print(f"launch failed: {errors[0]}", file=sys.stderr, flush=True)
            return 1
        addrs = [s[1] for s in started]
        runner, state = await start_gateway(gateway_parser().parse_args(_gateway_argv(args, addrs)))
        # Ready means routable: every worker connected and its role known (PD pairs need both sides).
        for w in state.router.workers:
            w.start()
        deadline = loop.time() + 30
        while not all(w.connected for w in state.router.workers) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        print(f"READY http://{args.host}:{args.port} workers={','.join(addrs)}", flush=True)
        waits = [asyncio.create_task(p.wait()) for p in procs]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
        if stopper not in done:
            print("a worker exited; shutting the stack down", file=sys.stderr, flush=True)
            code = 1
        for t in [stopper, *waits]:
            t.cancel()
    finally:
        if runner is not None:
            # Requests in flight finish first (workers are still up), then the workers stop.
            await runner.cleanup()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 15)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
    return code


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Worker ports are private to this stack: one random key, handed to every process through the
    # environment (never argv, which `ps` shows); an operator's own $RADIXSERVE_INTERNAL_KEY wins.
    if not os.environ.get(INTERNAL_KEY_ENV):
        os.environ[INTERNAL_KEY_ENV] = secrets.token_urlsafe(32)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
