"""Request identity and the access log: every request gets an id (the client's sane `X-Request-Id`, else
a new one), returned in the `X-Request-Id` header, carried to the workers, and one access-log line per
request, fed by the dispatcher through a context variable. Requests too broken to reach a handler get one
warning line from aiohttp's logger, not a traceback."""
from __future__ import annotations

import contextvars
import logging
import re
import time
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shared.ids import unique_hex

log = logging.getLogger("services.gateway.access")

HEADER = "X-Request-Id"
_PROBES = {"/health", "/metrics"}  # polled every few seconds: access-logged at debug only
_SANE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    start: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None

    def first_token(self) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.start

    def finished(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.output_tokens += output_tokens


CURRENT: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("access_record", default=None)


_KEY = web.RequestKey("access_record", AccessRecord)


def request_id_from(given: str) -> str:
    """The client's X-Request-Id header value when it is a sane token, else a new id."""
    return given if given and _SANE.fullmatch(given) else unique_hex()


def log_access(record: AccessRecord, method: str, path: str, status: int) -> None:
    """The request's access-log line (probes at debug level)."""
    level = logging.DEBUG if path in _PROBES else logging.INFO
    if log.isEnabledFor(level):
        ttft = f"{record.ttft:.3f}" if record.ttft is not None else "-"
        log.log(level, "request_id=%s %s %s %d prompt_tokens=%d cached_tokens=%d output_tokens=%d ttft=%s "
                "e2e=%.3f", record.request_id, method, path, status, record.prompt_tokens, record.cached_tokens,
                record.output_tokens, ttft, time.perf_counter() - record.start)


@web.middleware
async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
    record = AccessRecord(request_id_from(request.headers.get(HEADER, "")))
    request[_KEY] = record
    token = CURRENT.set(record)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except BaseException:
        status = 499  # the client went away (handler cancelled) or an error escaped
        raise
    finally:
        CURRENT.reset(token)
        # As sent (percent-encoded): request.path decodes %0a into a newline that would forge a line.
        log_access(record, request.method, request.rel_url.raw_path, status)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: streamed responses get the header too."""
    record = request.get(_KEY)
    if record is not None:
        response.headers[HEADER] = record.request_id


class _OneLineParseErrors(logging.Filter):
    """aiohttp logs a request it cannot frame (duplicate Content-Length, an oversized header line...) at
    ERROR with a traceback; anyone can send such bytes, so each becomes one warning line, the parser's
    message repr'd (the client's bytes in it, newlines escaped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.getMessage()}: {exc.code} {exc.message!r}"
            record.args, record.exc_info, record.exc_text = None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_PARSE_ERRORS = _OneLineParseErrors()


def quiet_parse_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    logging.getLogger("aiohttp.server").addFilter(_PARSE_ERRORS)  # a no-op when already there
