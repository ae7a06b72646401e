"""The aiohttp application: route table, error and auth middlewares, start-up and shutdown. Routes only
read the state and call the translator that owns the endpoint."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.gateway.api import admin, native, openai, programs, tokens
from services.gateway.http.auth import authorize
from services.gateway.http.access_log import access_middleware, add_request_id_header
from services.gateway.http.errors import APIError, error_body, internal_error
from services.gateway.http.json_out import json_response
from services.gateway.http.openapi import build_spec
from services.gateway.state import GatewayState
from services.gateway.http.tenancy import CACHE_SALT
from shared.errors import InvalidRequest

__all__ = ["GatewayState", "create_app", "STATE"]

log = logging.getLogger(__name__)

STATE = web.AppKey("gateway_state", GatewayState)

_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}
# OpenAI's `code` is a string or null, never the HTTP status.
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def create_app(state: GatewayState) -> web.Application:
    app = web.Application(client_max_size=state.limits.max_body_bytes,
                          middlewares=[access_middleware, _error_middleware, _auth_middleware(state)])
    app[STATE] = state
    s = state

    async def models(request):
        return json_response(openai.models(s))

    async def model(request):
        return json_response(openai.model(s, request.match_info["model_id"]))

    async def model_info(request):
        return json_response(admin.model_info(s))

    async def server_info(request):
        return json_response(await admin.server_info(s))

    async def flush_cache(request):
        return await admin.flush_cache(s)

    async def health(request):
        return admin.health(s)

    async def health_generate(request):
        return await admin.health_generate(s)

    async def metrics(request):
        return await admin.metrics(s)

    app.router.add_post("/v1/completions", _bound(s, openai.completions))
    app.router.add_post("/v1/chat/completions", _bound(s, openai.chat_completions))
    app.router.add_post("/generate", _bound(s, native.generate))
    app.router.add_get("/v1/models", models)
    # {model_id:.+}: hub ids contain a slash (meta-llama/Llama-3.1-8B).
    app.router.add_get("/v1/models/{model_id:.+}", model)
    app.router.add_post("/v1/programs", _bound(s, programs.run_program))
    for prefix in ("", "/v1"):  # SGLang serves both; vLLM the first
        app.router.add_post(f"{prefix}/tokenize", _bound(s, tokens.tokenize))
        app.router.add_post(f"{prefix}/detokenize", _bound(s, tokens.detokenize))
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/metrics", metrics)
    async def openapi(request):
        return json_response(spec)

    app.router.add_get("/openapi.json", openapi)
    spec = build_spec(app)  # every route is in the table now

    app.on_response_prepare.append(add_request_id_header)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app


def _bound(state: GatewayState, translator):
    """A route handler for a translator that takes (state, request)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await translator(state, request)

    return handler


async def _on_startup(app: web.Application) -> None:
    state = app[STATE]
    for w in state.router.workers:
        w.start()
    state.health.start()
    state.metrics.start_publishing()


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE]
    await state.metrics.stop_publishing()
    await state.health.stop()
    await asyncio.gather(*(w.close() for w in state.router.workers))
    state.cpu.close()


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except InvalidRequest as e:
        return APIError.from_invalid(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        body = error_body(e.reason, _HTTP_ERROR_TYPES.get(e.status, "invalid_request_error"),
                          code=_HTTP_ERROR_CODES.get(e.status))
        return json_response(body, status=e.status, headers={
            k: v for k, v in e.headers.items() if k.lower() == "allow"})
    except Exception:
        # Bad input never lands here (translators raise APIError); this is a bug, logged but not shown.
        log.exception("unhandled error on %s %s", request.method, request.path)
        return internal_error().response()


def _auth_middleware(state: GatewayState):
    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        try:
            salt = authorize(state, request.path, request.headers.get("Authorization", ""))
        except APIError as e:
            return e.response()
        if salt is not None:
            request[CACHE_SALT] = salt
        return await handler(request)

    return check
