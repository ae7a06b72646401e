"""API keys: which routes need one and whether a request's Authorization header carries one (the auth
middleware of services/gateway/app.py asks)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.http.errors import APIError
from services.gateway.http.tenancy import tenant_salt
from shared.wire import key_matches

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

# Routes that answer without an API key even when --api-key is set (as SGLang: liveness and metrics
# scrapers carry no key). Everything else needs one; /flush_cache needs the admin key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def authorize(state: "GatewayState", path: str, authorization: str) -> str | None:
    """The tenant's cache salt for a request to `path` with this Authorization header value (None when the
    route needs no key); raises the 401 when it needs one the header does not carry."""
    keys = required_keys(state, path)
    if not keys:
        return None
    key = matching_key(authorization, keys)
    if key is None:
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")
    return tenant_salt(key)


def may_see_internals(state: "GatewayState", headers) -> bool:
    """Whether an open route may name internal addresses to this caller: a keyless server's callers, or
    the holder of a key (a route open to anyone says only what a load balancer needs)."""
    keys = state.api_keys
    return not keys or matching_key(headers.get("Authorization", ""), keys) is not None


def required_keys(state: "GatewayState", path: str) -> list[str]:
    """With --api-key every route needs a key except liveness, metrics and the API description (as
    SGLang); /flush_cache takes the admin key when one is set."""
    if path == "/flush_cache":
        return [state.admin_api_key] if state.admin_api_key else state.api_keys
    if path in OPEN_PATHS:
        return []
    return state.api_keys


def matching_key(authorization: str, keys: list[str]) -> str | None:
    """The key a `Bearer <key>` Authorization header value carries, if it is one of `keys`."""
    scheme, _, token = authorization.partition(" ")
    found = None
    # Constant-time comparison against every key (no early exit): timing says nothing about the keys.
    for key in keys:
        if key_matches(key, token.strip()) and scheme.lower() == "bearer":
            found = key
    return found
