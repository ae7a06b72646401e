"""Model/server information, cache flush, health and metrics: the small routes around generation."""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway.http.errors import WorkerUnavailable
from shared import event_loop

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

VERSION = "0.1.0"


def model_info(state: "GatewayState") -> dict:
    return {"model_path": state.model_path, "tokenizer_path": state.tokenizer_path or state.model_path,
            "served_model_name": state.served_model_name, "is_generation": True,
            "max_context_length": state.context_length, "vocab_size": state.tokenizer.vocab_size,
            "eos_token_ids": state.tokenizer.eos_token_ids}


async def server_info(state: "GatewayState") -> dict:
    await state.health.poll_infos()
    health = state.health
    workers = [{"address": w.address, "connected": w.connected, "load": w.load, "state": health.worker_state(w),
                "role": w.role, "supervisor": health.worker_status.get(w.address), "info": health.last_info.get(w.address)}
               for w in state.router.workers]
    limits = state.limits
    return {**model_info(state), "version": VERSION, "context_length": state.context_length,
            "max_total_num_tokens": sum((w["info"] or {}).get("max_total_tokens", 0) for w in workers),
            "limits": {"max_n": limits.max_n, "max_batch": limits.max_batch,
                       "max_body_bytes": limits.max_body_bytes, "max_top_logprobs": limits.max_top_logprobs},
            "gateway_inflight": len(state.dispatcher.inflight), "event_loop": event_loop.current_loop_name(),
            "gateway_process": {"index": state.process[0], "count": state.process[1], "pid": os.getpid()},
            "routing": state.router.stats(),
            "workers": workers}


async def flush_cache(state: "GatewayState") -> web.Response:
    # Flushing under running requests would free KV they still read: refuse, as SGLang does.
    if state.dispatcher.inflight or state.router.load:
        return web.Response(status=400, text="Cache not flushed: requests are running. Retry when idle.\n")
    try:
        results = await asyncio.gather(*(w.flush_cache() for w in state.router.workers))
    except WorkerUnavailable as e:
        return web.Response(status=503, text=f"Cache not flushed: {e}\n")
    failed = [r.message for r in results if not r.ok]
    if failed:
        return web.Response(status=400, text=f"Cache not flushed: {'; '.join(failed)}\n")
    state.router.forget_cache()
    return web.Response(text="Cache flushed.\n")


def health(state: "GatewayState", names: bool = True) -> web.Response:
    """200 while requests can be served; the body names every worker that is not up (restarting, down,
    draining...), so a degraded stack says so. 503 while draining or while nothing can serve. Without
    `names` (a keyless caller under --api-key) only the count: worker addresses are internal."""
    down = state.health.not_up()
    if names:
        detail = "".join(f"worker {a}: {s}\n" for a, s in sorted(down.items()))
    else:
        detail = f"{len(down)} worker(s) not up\n" if down else ""
    if state.draining:
        return web.Response(status=503, text="Not ready: draining.\n" + detail)
    if state.health.healthy:
        return web.Response(text=("OK (degraded)\n" if down else "OK\n") + detail)
    return web.Response(status=503, text="Not ready: waiting for workers.\n" + detail)


async def health_generate(state: "GatewayState", timeout: float = 20.0) -> web.Response:
    """Runs a one-token generate now, on the worker the router would pick."""
    try:
        worker = state.router.pick(state.health.probe_ids)
        async with asyncio.timeout(timeout):
            await state.health.tiny_generate(worker)
    except Exception as e:  # any failure is an unhealthy answer, never a 500
        return web.Response(status=503, text=f"Unhealthy: {e}\n")
    return web.Response(text="OK\n")


async def metrics(state: "GatewayState") -> web.Response:
    state.metrics.set_worker_stats(await state.health.poll_infos(timeout=1.0))
    state.metrics.set_routing_stats(state.router.stats())
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
