"""Client-side instruments for the driver: a backend that records every /generate request (the trace),
one that adds an emulated network round trip to every HTTP call, one without the fork prefix hint; and
the offline-optimal prefix hit rate of a trace.

Offline optimum (the paper's Fig. 8 reference): an infinite radix tree that has seen the whole trace. A
prompt token is a hit unless no earlier computation holds its prefix; with unbounded memory the order of
requests does not matter, so the optimum is 1 - (distinct prompt prefixes not covered by a generated
continuation) / (prompt tokens). A request's generated tokens count as computed (decode fills the cache).
"""
from __future__ import annotations

import threading
import time
from typing import Any

from lang_client import RuntimeEndpoint


class _TimedHttp:
    """Wraps lang_client's HttpClient: sleeps `rtt_s` per call (one round trip of a remote client)."""

    def __init__(self, http, rtt_s: float, on_post=None):
        self._http, self.rtt_s, self.on_post = http, rtt_s, on_post

    def __getattr__(self, name):
        return getattr(self._http, name)

    def post_json(self, path: str, body: Any):
        if self.rtt_s:
            time.sleep(self.rtt_s)
        answer = self._http.post_json(path, body)
        if self.on_post is not None:
            self.on_post(path, body, answer)
        return answer

    def post_sse(self, path: str, body: Any):
        if self.rtt_s:
            time.sleep(self.rtt_s)
        return self._http.post_sse(path, body)

    def get_json(self, path: str):
        if self.rtt_s:
            time.sleep(self.rtt_s)
        return self._http.get_json(path)


class BenchEndpoint(RuntimeEndpoint):
    """RuntimeEndpoint with the driver's knobs: emulated RTT, fork hint off, request recording."""

    def __init__(self, url: str, rtt_s: float = 0.0, fork_hint: bool = True, record: bool = False):
        super().__init__(url)
        self.fork_hint = fork_hint
        self.trace: list[tuple[str, str]] = []   # (prompt text, generated text) per /generate prompt
        self._lock = threading.Lock()
        self.http = _TimedHttp(self.http, rtt_s, self._record if record else None)

    def cache_prefix(self, text: str) -> None:
        if self.fork_hint:
            super().cache_prefix(text)

    def _record(self, path: str, body: Any, answer: Any) -> None:
        if path != "/generate":
            return
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        answers = answer if isinstance(answer, list) else [answer]
        with self._lock:
            for t, a in zip(texts, answers):
                self.trace.append((t, a.get("text", "") if isinstance(a, dict) else ""))


def optimal_hit_rate(trace: list[tuple[list[int], list[int]]]) -> dict:
    """(prompt token ids, generated token ids) per request -> the infinite-cache hit rate."""
    root: dict = {}
    prompt_nodes: list[dict] = []
    total = 0
    for prompt, output in trace:
        node = root
        for tok in prompt:
            node = node.setdefault(tok, {})
            prompt_nodes.append(node)
        total += len(prompt)
        for tok in output:
            node = node.setdefault(tok, {})
            node[-1] = True  # computed by a decode step
    # Distinct prompt nodes (a node object once) that no decode computed: each must be prefilled once.
    seen: set[int] = set()
    misses = 0
    for node in prompt_nodes:
        if id(node) not in seen:
            seen.add(id(node))
            if -1 not in node:
                misses += 1
    return {"prompt_tokens": total, "optimal_hit_rate": 1 - misses / total if total else 0.0}


def tokenized_trace(trace: list[tuple[str, str]], tokenizer) -> list[tuple[list[int], list[int]]]:
    out = []
    for prompt, generated in trace:
        ids = tokenizer.encode(prompt)
        full = tokenizer.encode(prompt + generated)
        # The continuation as the cache would hold it: whatever follows the shared token prefix.
        k = 0
        while k < min(len(ids), len(full)) and ids[k] == full[k]:
            k += 1
        out.append((ids, full[len(ids):] if k == len(ids) else []))
    return out
