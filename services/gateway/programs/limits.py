"""Bounds on what one `/v1/programs` request may cost beyond its IR's static limits: tokens over all its
generate calls, text generated, answer size, wall time, programs per API key at once (429; 400 for the
rest). Each refuses before the work that would cross it: a call reserves its prompt and max_new_tokens
once tokenized, before anything is sent, and held text is counted as it grows."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from services.gateway.http.errors import APIError
from services.gateway.http.json_out import dumps
from services.gateway.programs.execute import Bounds
from shared.protocol import GenerateRequest

# api/native.py generate_json's shape: a /generate body and the admission hook it calls before dispatch.
Generate = Callable[[dict, Callable[[list[GenerateRequest]], None]], Awaitable[Any]]


@dataclass(frozen=True)
class ProgramBudget:
    # Tokens over every generate call (a fork's branches each count): a call's prompt and max_new_tokens
    # are reserved when it is issued, and settled to what it really used when it returns.
    max_prompt_tokens: int = 1_000_000
    max_generated_chars: int = 2_000_000
    # The answer's JSON; while the program runs, every character of text it holds (streams, messages,
    # variables) counts against it, so a program refused here is refused before its text grows past it.
    max_answer_bytes: int = 16 * 1024 * 1024
    max_seconds: float = 300.0
    # A bound against one tenant flooding the executor, not a batch size: SGLang's run_batch and our
    # bench/workloads send 16-64 programs at once (a bound of 4 made them fail with 429).
    max_running_per_key: int = 256


def _limit(message: str) -> APIError:
    return APIError(400, message, param="program", code="program_limit_exceeded")


# A long string of the answer is encoded this many characters at a time, with a yield to the event loop
# between steps (orjson takes ~1 ms per MB; a whole 16 MB answer at once would hold the loop ~15 ms).
ENCODE_STEP = 256 * 1024


class ProgramMeter(Bounds):
    """One program run: wraps its generate calls, adding up what they cost, and bounds the text it holds."""

    def __init__(self, budget: ProgramBudget):
        self.budget = budget
        self.deadline = time.monotonic() + budget.max_seconds
        self.tokens = 0  # used by finished calls plus reserved by running ones
        self.generated_chars = 0
        self.text_chars = 0
        self._held: dict[asyncio.Task | None, int] = {}  # tokens held for a task's next call (hold_prompt_tokens)

    def _answer_limit(self) -> APIError:
        return _limit(f"program answer is larger than {self.budget.max_answer_bytes} bytes")

    def add_text(self, chars: int) -> None:
        self.text_chars += chars
        if self.text_chars > self.budget.max_answer_bytes:  # a character is at least one byte of JSON
            raise self._answer_limit()

    def _room(self, tokens: int) -> None:
        if self.tokens + tokens > self.budget.max_prompt_tokens:
            raise _limit(f"program would process more than {self.budget.max_prompt_tokens} prompt tokens "
                         "(each generate call's prompt and max_new_tokens count from when it is issued)")

    def hold_prompt_tokens(self, tokens: int) -> None:
        # Keyed by task: the call that follows runs in the same task, and its reservation takes the hold's place.
        self._room(tokens)
        task = asyncio.current_task()
        self._held[task] = self._held.get(task, 0) + tokens
        self.tokens += tokens

    def wrap(self, generate: Generate) -> Callable[[dict], Awaitable[Any]]:
        """`generate(body, admit)` calls `admit(requests)` once its prompts are tokenized, before any is
        sent: the reservation that may refuse them."""
        async def metered(body: dict) -> Any:
            held = self._held.pop(asyncio.current_task(), 0)
            reserved = 0

            def admit(reqs: list[GenerateRequest]) -> None:
                nonlocal held, reserved
                self.tokens -= held
                held = 0
                need = sum(len(r.input_ids) + r.sampling.max_new_tokens for r in reqs)
                self._room(need)
                self.tokens += need
                reserved = need

            remaining = self.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise _limit(f"program ran longer than {self.budget.max_seconds:g} s")
                async with asyncio.timeout(remaining):
                    answer = await generate(body, admit)
            except TimeoutError:
                raise _limit(f"program ran longer than {self.budget.max_seconds:g} s") from None
            finally:
                self.tokens -= held  # a call that ended before its prompts were tokenized
            # A failed call keeps its reservation: what it cost is unknown, and the program ends anyway.
            self.tokens -= reserved
            for item in answer if isinstance(answer, list) else [answer]:
                if isinstance(item, dict):
                    meta = item.get("meta_info") or {}
                    self.tokens += int(meta.get("prompt_tokens") or 0) + int(meta.get("completion_tokens") or 0)
                    self.generated_chars += len(item.get("text") or "")
            if self.generated_chars > self.budget.max_generated_chars:
                raise _limit(f"program generated more than {self.budget.max_generated_chars} characters")
            return answer
        return metered

    async def serialize(self, result: dict) -> bytes:
        """The answer as JSON, refused as soon as it passes the size bound; encoded a step at a time."""
        out, since_yield = bytearray(), 0
        for chunk in _json_chunks(result):
            out += chunk
            if len(out) > self.budget.max_answer_bytes:
                raise self._answer_limit()
            since_yield += len(chunk)
            if since_yield >= ENCODE_STEP:
                since_yield = 0
                await asyncio.sleep(0)
        return bytes(out)


def _json_chunks(obj: Any) -> Iterator[bytes]:
    """`obj` as JSON (json_out.dumps's), in pieces: a long string in ENCODE_STEP slices (escaping is per
    character, so the escaped slices join to the escaped string), dicts and lists item by item."""
    if isinstance(obj, str) and len(obj) > ENCODE_STEP:
        yield b'"'
        for i in range(0, len(obj), ENCODE_STEP):
            yield dumps(obj[i:i + ENCODE_STEP])[1:-1]
        yield b'"'
    elif isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        sep = b"{"
        for key, value in obj.items():
            yield sep + dumps(key) + b":"
            yield from _json_chunks(value)
            sep = b","
        yield b"}"
    elif isinstance(obj, list) and obj:
        sep = b"["
        for value in obj:
            yield sep
            yield from _json_chunks(value)
            sep = b","
        yield b"]"
    else:
        yield dumps(obj)


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
