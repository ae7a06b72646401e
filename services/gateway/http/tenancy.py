"""Tenants: each API key is one, with its own cache namespace, so one tenant's prompts can never be
probed through another's cache hits (prefix-cache timing side channel)."""
from __future__ import annotations

import hashlib

from aiohttp import web

CACHE_SALT = web.RequestKey("cache_salt", str)


def tenant_salt(key: str) -> str:
    return hashlib.sha256(b"radixserve-tenant:" + key.encode()).hexdigest()[:16]


def request_salt(request: web.Request) -> str | None:
    return request.get(CACHE_SALT)
