"""HTTP with the standard library only (urllib): JSON calls and Server-Sent Events."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator

from lang_client.errors import BackendError


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any = None, accept: str = "application/json"):
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise BackendError(f"{method} {path} -> {e.code}: {_error_message(e.read())}", e.code) from None
        except urllib.error.URLError as e:
            raise BackendError(f"{method} {path}: cannot reach {self.base_url}: {e.reason}") from None

    def get_json(self, path: str) -> Any:
        with self._request("GET", path) as resp:
            return json.loads(resp.read())

    def post_json(self, path: str, body: Any) -> Any:
        with self._request("POST", path, body) as resp:
            raw = resp.read()
            if "json" not in (resp.headers.get("Content-Type") or ""):
                return raw.decode(errors="replace")  # /flush_cache answers plain text
            return json.loads(raw)

    def post_sse(self, path: str, body: Any) -> Iterator[Any]:
        """Yield each `data:` event as parsed JSON until `[DONE]`; an error event raises."""
        with self._request("POST", path, body, accept="text/event-stream") as resp:
            for raw_line in resp:
                line = raw_line.decode().rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    raise BackendError(f"POST {path} stream: {_error_message(json.dumps(event).encode())}")
                yield event


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err or body)[:500]
