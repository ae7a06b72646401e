"""`GET /openapi.json`, generated: every route of the aiohttp app, each POST's body schema from its
request model (api/models.py, through msgspec's JSON Schema generation), so the description and the
decoder cannot drift apart."""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from services.gateway.api.models import ROUTE_BODIES
from services.gateway.api.auth import OPEN_PATHS

_SUMMARIES = {
    "/v1/completions": "OpenAI text completions",
    "/v1/chat/completions": "OpenAI chat completions",
    "/generate": "SGLang-native generation",
    "/v1/programs": "Run a traced program server-side",
    "/tokenize": "Token ids of a prompt or chat messages (count, max_model_len, tokens)",
    "/detokenize": "Text of token ids (as `text` and `prompt`)",
    "/v1/models": "Served models",
    "/v1/models/{model_id}": "One served model (404 model_not_found for another id)",
    "/get_model_info": "Model information",
    "/server_info": "Server, limits and worker information",
    "/health": "Ready to serve (503 while draining or without a healthy worker)",
    "/health_generate": "Runs a one-token generation",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "This document",
    "/flush_cache": "Empty every worker's prefix cache (admin key when one is set)",
}
_ALIASES = {"/v1/tokenize": "/tokenize", "/v1/detokenize": "/detokenize", "/model_info": "/get_model_info",
            "/get_server_info": "/server_info"}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OK = {"description": "OK", "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}},
                                        "text/plain": {"schema": {"type": "string"}}}}
_ERRORS = {str(status): {"description": why, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
           for status, why in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                               (413, "body too large"), (429, "too many programs running for this key"),
                               (503, "no worker can serve it now, or the grammar compiler is busy"))}


def build_spec(app: web.Application) -> dict[str, Any]:
    routes = sorted({(r.resource.canonical, r.method.lower()) for r in app.router.routes()
                     if r.method != "HEAD" and r.resource is not None})
    schemas, components = msgspec.json.schema_components(list(ROUTE_BODIES.values()),
                                                         ref_template="#/components/schemas/{name}")
    refs = dict(zip(ROUTE_BODIES, schemas))
    paths: dict[str, dict] = {}
    for path, method in routes:
        canonical = _ALIASES.get(path, path)
        op: dict[str, Any] = {"summary": _SUMMARIES.get(canonical, canonical), "responses": {"200": _OK, **_ERRORS}}
        if path in OPEN_PATHS:
            op["security"] = []
        if method == "post" and canonical in refs:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[canonical]}}}
        if "{model_id}" in path:
            op["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixserve gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible and SGLang-native generation over a radix-cached worker fleet."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                       "schemas": {**components, "Error": _ERROR}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
