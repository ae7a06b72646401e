"""The aiohttp application: route table, error and auth middlewares, start-up and shutdown. Routes only
read the state and call the translator that owns the endpoint."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.gateway.api import admin, native, openai, programs, tokens
from services.gateway.api.auth import authorize, may_see_internals
from services.gateway.http.access_log import access_middleware, add_request_id_header, quiet_parse_errors
from services.gateway.http.errors import APIError, error_body, internal_error, overloaded
from services.gateway.http.json_out import json_response
from services.gateway.openapi import build_spec
from services.gateway.state import GatewayState
from services.gateway.http.tenancy import CACHE_SALT
from shared.errors import InvalidRequest, Overloaded

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
    quiet_parse_errors()

    def route(translator, as_json: bool = False):
        """A handler for a translator that takes (state, request): its answer, or a dict as JSON."""
        async def handler(request: web.Request) -> web.StreamResponse:
            out = translator(state, request)
            out = await out if asyncio.iscoroutine(out) else out
            return json_response(out) if as_json else out
        return handler

    add = app.router.add_route
    add("POST", "/v1/completions", route(openai.completions))
    add("POST", "/v1/chat/completions", route(openai.chat_completions))
    add("POST", "/generate", route(native.generate))
    add("POST", "/v1/programs", route(programs.run_program))
    add("GET", "/v1/models", route(lambda s, r: openai.models(s), as_json=True))
    # {model_id:.+}: hub ids contain a slash (meta-llama/Llama-3.1-8B).
    add("GET", "/v1/models/{model_id:.+}", route(lambda s, r: openai.model(s, r.match_info["model_id"]), True))
    for prefix in ("", "/v1"):  # SGLang serves both; vLLM the first
        add("POST", f"{prefix}/tokenize", route(tokens.tokenize))
        add("POST", f"{prefix}/detokenize", route(tokens.detokenize))
    for path in ("/get_model_info", "/model_info"):
        add("GET", path, route(lambda s, r: admin.model_info(s), as_json=True))
    for path in ("/server_info", "/get_server_info"):
        add("GET", path, route(lambda s, r: admin.server_info(s), as_json=True))
    for method in ("POST", "GET"):
        add(method, "/flush_cache", route(lambda s, r: admin.flush_cache(s)))
    add("GET", "/health", route(lambda s, r: admin.health(s, names=may_see_internals(s, r.headers))))
    add("GET", "/health_generate", route(lambda s, r: admin.health_generate(s)))
    add("GET", "/metrics", route(lambda s, r: admin.metrics(s)))
    add("GET", "/openapi.json", route(lambda s, r: spec, as_json=True))
    spec = build_spec(app)  # every route is in the table now

    app.on_response_prepare.append(add_request_id_header)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app


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
    except Overloaded as e:
        return overloaded(e.message).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        body = error_body(e.reason, _HTTP_ERROR_TYPES.get(e.status, "invalid_request_error"),
                          code=_HTTP_ERROR_CODES.get(e.status))
        return json_response(body, status=e.status, headers={
            k: v for k, v in e.headers.items() if k.lower() == "allow"})
    except Exception:
        # Bad input never lands here (translators raise APIError); this is a bug, logged but not shown.
        log.exception("unhandled error on %s %s", request.method, request.rel_url.raw_path)
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
