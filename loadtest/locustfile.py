"""Locust load test for the gateway: streamed chat completions with TTFT and per-token latency recorded
as their own locust entries, prompts drawn from a few shared prefixes so the cache-hit rate is set by
--prefix-share, fixed output lengths via ignore_eos.

    pip install -e ".[load]"
    locust -f loadtest/locustfile.py --host http://127.0.0.1:30000 --headless -u 32 -r 8 -t 60s \
        --max-tokens 64 --prefix-share 0.8

Target only servers you run yourself (loopback or your own test hosts).
"""
from __future__ import annotations

import json
import random
import time

from locust import HttpUser, constant, events, task

_PREFIXES = [("You are a helpful assistant. " + f"Context document {i}: " + "lorem ipsum dolor sit amet " * 40)
             for i in range(4)]


@events.init_command_line_parser.add_listener
def _args(parser):
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefix-share", type=float, default=0.8, help="share of requests reusing a prefix")
    parser.add_argument("--model", default="tiny-random")


class ChatUser(HttpUser):
    wait_time = constant(0)

    @task
    def stream_chat(self):
        opts = self.environment.parsed_options
        if random.random() < opts.prefix_share:
            system = random.choice(_PREFIXES)
        else:
            system = f"Unique context {random.getrandbits(64)}: " + "text " * 200
        body = {"model": opts.model, "stream": True, "max_tokens": opts.max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Question {random.randrange(10**6)}?"}]}
        start = time.perf_counter()
        first = None
        last = start
        gaps = []
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat (stream)") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    resp.failure(chunk["error"].get("message", "error"))
                    return
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            resp.success()
        fire = self.environment.events.request.fire
        if first is not None:
            fire(request_type="LLM", name="TTFT", response_time=(first - start) * 1000, response_length=0)
        for g in gaps:
            fire(request_type="LLM", name="ITL", response_time=g * 1000, response_length=0)
