"""Bounds on what one `/v1/programs` request may cost, beyond the static checks of its IR (programs.py
ProgramLimits): prompt tokens processed over all its generate calls, text generated, answer size, wall
time, and how many programs one API key may run at once. A program over a bound ends with a 4xx that
names the bound (429 for concurrency, 400 otherwise); its in-flight generations are aborted as usual."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from services.gateway.errors import APIError

Generate = Callable[[dict], Awaitable[Any]]


@dataclass(frozen=True)
class ProgramBudget:
    max_prompt_tokens: int = 1_000_000  # summed over every generate call (a fork's branches each count)
    max_generated_chars: int = 2_000_000
    max_answer_bytes: int = 16 * 1024 * 1024
    max_seconds: float = 300.0
    # A bound against one tenant flooding the executor, not a batch size: SGLang's run_batch and our
    # bench/workloads send 16-64 programs at once (4 made them fail with 429 on the H200, 2026-11-30).
    max_running_per_key: int = 256


def _limit(message: str) -> APIError:
    return APIError(400, message, param="program", code="program_limit_exceeded")


class ProgramMeter:
    """One program run: wraps its generate calls, adding up what they cost."""

    def __init__(self, budget: ProgramBudget):
        self.budget = budget
        self.deadline = time.monotonic() + budget.max_seconds
        self.prompt_tokens = 0
        self.generated_chars = 0

    def _check(self) -> None:
        b = self.budget
        if self.prompt_tokens > b.max_prompt_tokens:
            raise _limit(f"program processed more than {b.max_prompt_tokens} prompt tokens")
        if self.generated_chars > b.max_generated_chars:
            raise _limit(f"program generated more than {b.max_generated_chars} characters")

    def wrap(self, generate: Generate) -> Generate:
        async def metered(body: dict) -> Any:
            self._check()
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise _limit(f"program ran longer than {self.budget.max_seconds:g} s")
            try:
                async with asyncio.timeout(remaining):
                    answer = await generate(body)
            except TimeoutError:
                raise _limit(f"program ran longer than {self.budget.max_seconds:g} s") from None
            for item in answer if isinstance(answer, list) else [answer]:
                if isinstance(item, dict):
                    self.prompt_tokens += int((item.get("meta_info") or {}).get("prompt_tokens") or 0)
                    self.generated_chars += len(item.get("text") or "")
            self._check()
            return answer
        return metered

    async def serialize(self, result: dict) -> bytes:
        """The answer as JSON (in a thread), refused when over the size bound."""
        body = await asyncio.to_thread(lambda: json.dumps(result).encode())
        if len(body) > self.budget.max_answer_bytes:
            raise _limit(f"program answer is larger than {self.budget.max_answer_bytes} bytes")
        return body


class ProgramSlots:
    """How many programs each API key (tenant) runs at once."""

    def __init__(self, budget: ProgramBudget):
        self.budget = budget
        self.running: dict[str | None, int] = {}

    @contextlib.contextmanager
    def hold(self, tenant: str | None) -> Iterator[None]:
        if self.running.get(tenant, 0) >= self.budget.max_running_per_key:
            raise APIError(429, f"at most {self.budget.max_running_per_key} programs may run at once per API key",
                           type="rate_limit_error", code="too_many_programs")
        self.running[tenant] = self.running.get(tenant, 0) + 1
        try:
            yield
        finally:
            self.running[tenant] -= 1
            if not self.running[tenant]:
                del self.running[tenant]
