"""A stand-in for an SGLang-native server, for lang_client's tests (stdlib http.server in a thread).

One token per character (token id = code point), deterministic text and logprobs, every request recorded
with its start and end time. Implements /get_model_info, /generate (single and batch, max_new_tokens 0,
logprobs in the documented shapes, cumulative SSE streaming), /flush_cache, and /v1/programs through
services.gateway.programs with a generate callable backed by the same fake.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def default_responder(prompt: str, sampling: dict) -> str:
    """Deterministic output depending on the prompt: a word, a sentence end, then a second line."""
    return f" gen{zlib.crc32(prompt.encode()) % 1000} end.\nnext line"


def default_scorer(context: str, token: str) -> float:
    """log p(token | context): deterministic, varies by character."""
    return -1.0 - (ord(token) % 7) / 10


class FakeSGLangServer:
    def __init__(self, model_path: str = "Qwen/Qwen2-0.5B-Instruct", delay: float = 0.0,
                 responder: Callable[[str, dict], str] = default_responder,
                 scorer: Callable[[str, str], float] = default_scorer, api_key: str | None = None):
        self.model_path = model_path
        self.delay = delay            # seconds per request that generates at least one token
        self.responder = responder
        self.scorer = scorer
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    # ---- lifecycle ----
    def __enter__(self) -> "FakeSGLangServer":
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def generate_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == "/generate"]

    # ---- the fake model ----
    def _record(self, path: str, body: Any) -> dict:
        entry = {"path": path, "body": body, "start": time.monotonic(), "end": None}
        with self._lock:
            self.requests.append(entry)
        return entry

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def complete(self, text: str, sampling: dict) -> tuple[str, dict]:
        max_new = sampling.get("max_new_tokens", 128)
        if max_new == 0:
            return "", {"type": "length", "length": 0}
        out = self.responder(text, sampling)
        finish: dict = {"type": "stop", "matched": None}
        hits = [(out.find(s), s) for s in sampling.get("stop") or [] if s and out.find(s) >= 0]
        if hits:
            pos, s = min(hits)
            out, finish = out[:pos], {"type": "stop", "matched": s}
        if len(out) > max_new:
            out, finish = out[:max_new], {"type": "length", "length": max_new}
        return out, finish

    def answer(self, text: str, sampling: dict, top: dict) -> dict:
        out, finish = self.complete(text, sampling)
        meta: dict[str, Any] = {"id": f"req-{zlib.crc32(text.encode())}", "finish_reason": finish,
                                "prompt_tokens": len(text), "completion_tokens": len(out),
                                "cached_tokens": 0, "e2e_latency": 0.0}
        if top.get("return_logprob"):
            with_text = bool(top.get("return_text_in_logprobs"))
            start = top.get("logprob_start_len", -1)
            inputs = []
            if start is not None and start >= 0:
                for i in range(start, len(text)):
                    lp = None if i == start else self.scorer(text[:i], text[i])
                    inputs.append([lp, ord(text[i]), text[i] if with_text else None])
            full = text + out
            meta["input_token_logprobs"] = inputs
            meta["output_token_logprobs"] = [
                [self.scorer(full[:len(text) + j], ch), ord(ch), ch if with_text else None]
                for j, ch in enumerate(out)]
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate_body(self, body: dict) -> Any:
        """The /generate semantics on a parsed body (used by HTTP and by the programs executor)."""
        texts = body["text"]
        sps = body.get("sampling_params") or {}
        top = {k: body[k] for k in ("return_logprob", "logprob_start_len", "return_text_in_logprobs")
               if k in body}
        if isinstance(texts, list):
            sps = sps if isinstance(sps, list) else [sps] * len(texts)
            return [self.answer(t, sp, top) for t, sp in zip(texts, sps)]
        return self.answer(texts, sps, top)

    def _needs_delay(self, body: dict) -> bool:
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps]
        return self.delay > 0 and any(sp.get("max_new_tokens", 128) > 0 for sp in sps)

    async def generate_async(self, body: dict) -> Any:
        """The injected `generate` for execute_program: records like HTTP calls do."""
        entry = self._record("/generate", body)
        self._enter()
        try:
            if self._needs_delay(body):
                await asyncio.sleep(self.delay)
            return self.generate_body(body)
        finally:
            self._leave()
            entry["end"] = time.monotonic()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeSGLangServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send_json(self, obj: Any, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.fake.api_key is None:
            return True
        if self.headers.get("Authorization") == f"Bearer {self.fake.api_key}":
            return True
        self._send_json({"error": {"message": "bad api key", "type": "authentication_error"}}, 401)
        return False

    def do_GET(self) -> None:
        self.fake._record(self.path, None)
        if not self._authorized():
            return
        if self.path in ("/get_model_info", "/model_info"):
            self._send_json({"model_path": self.fake.model_path, "is_generation": True})
        elif self.path in ("/server_info", "/get_server_info"):
            self._send_json({"version": "fake"})
        else:
            self._send_json({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        entry = self.fake._record(self.path, body)
        if not self._authorized():
            return
        try:
            if self.path == "/generate":
                self._generate(body)
            elif self.path == "/flush_cache":
                data = b"Cache flushed.\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/programs":
                self._program(body)
            else:
                self._send_json({"error": {"message": "not found"}}, 404)
        finally:
            entry["end"] = time.monotonic()

    def _generate(self, body: dict) -> None:
        if "text" not in body:
            self._send_json({"error": {"message": "text is required", "type": "invalid_request_error"}}, 400)
            return
        self.fake._enter()
        try:
            if self.fake._needs_delay(body):
                time.sleep(self.fake.delay)
            answer = self.fake.generate_body(body)
        finally:
            self.fake._leave()
        if not body.get("stream"):
            self._send_json(answer)
            return
        self._start_sse()
        out, meta = answer["text"], answer["meta_info"]
        cuts = list(range(3, len(out), 3)) + [len(out)]
        for i, cut in enumerate(cuts):  # cumulative text, finish_reason only on the last event
            last = i == len(cuts) - 1
            event_meta = {**meta, "completion_tokens": cut, "finish_reason": meta["finish_reason"] if last else None}
            self._sse({"text": out[:cut], "output_ids": [ord(c) for c in out[:cut]], "meta_info": event_meta})
        self._sse_done()

    def _program(self, body: dict) -> None:
        from services.gateway.programs import execute_program, parse_program_request, stream_program
        from shared.errors import InvalidRequest
        try:
            program, stream = parse_program_request(body)
        except InvalidRequest as e:
            self._send_json({"error": {"message": e.message, "type": e.code, "param": e.param}}, 400)
            return
        if not stream:
            self._send_json(asyncio.run(execute_program(program, self.fake.generate_async)))
            return
        self._start_sse()

        async def pump():
            async for event in stream_program(program, self.fake.generate_async):
                self._sse(event)
        asyncio.run(pump())
        self._sse_done()

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj: Any) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _sse_done(self) -> None:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def regex_responder(answers: dict[str, str], fallback: Callable[[str, dict], str] = default_responder):
    """A responder answering regex-constrained gens from a table (checked to match), others by fallback."""
    def respond(prompt: str, sampling: dict) -> str:
        regex = sampling.get("regex")
        if regex is None:
            return fallback(prompt, sampling)
        out = answers[regex]
        assert re.fullmatch(regex, out), (regex, out)
        return out
    return respond
