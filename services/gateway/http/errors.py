"""OpenAI-style error bodies. Every refusal the gateway makes goes through `APIError` so clients always get
`{"error": {"message", "type", "param", "code"}}` and never a traceback."""
from __future__ import annotations

import logging

from aiohttp import web

from services.gateway.http.json_out import json_response
from shared.errors import InvalidRequest

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_invalid(cls, e: InvalidRequest) -> "APIError":
        # ContextLengthExceeded and friends carry their own code; clients match on it.
        code = e.code if e.code != "invalid_request_error" else None
        return cls(400, e.message, param=e.param, code=code)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)


class WorkerUnavailable(Exception):
    """The worker connection is down or did not answer in time (not the client's fault)."""


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    """A bug's answer: logged where it is caught, never shown to the client."""
    return APIError(500, "internal server error", type="internal_error")


def unavailable(detail: str) -> APIError:
    """No worker could serve. `detail` (worker addresses, socket errors) is the operator's, logged here;
    the client, to whom the fleet's layout is internal, is told only that and to retry."""
    log.warning("worker unavailable: %s", detail)
    return APIError(503, "no worker can serve the request right now; retry later", type="service_unavailable",
                    code="worker_unavailable")


def overloaded(message: str) -> APIError:
    """Too busy right now (the grammar compiler, on the gateway or a worker): the request is fine, so a 503."""
    return APIError(503, message, type="service_unavailable", code="server_overloaded")


def worker_refused(message: str) -> APIError:
    # A worker refuses only what passed gateway validation but cannot run (grammar that does not compile,
    # prompt over its pool): the input is still the cause, so 400.
    return APIError(400, message, code="worker_refused")
