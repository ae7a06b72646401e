"""Every message that crosses a process boundary, defined once.

Frames are msgpack maps with a "type" key, length-prefixed on the stream (see shared/wire.py). Each
message type is a dataclass; `decode_message` validates field names and types on receipt, so a malformed
frame becomes a ProtocolError, never a crash deeper in. No pickle anywhere.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ProtocolError(ValueError):
    pass


_REGISTRY: dict[str, type["Message"]] = {}


def message(cls):
    """Class decorator: make a dataclass and register it under its TYPE."""
    cls = dataclass(cls)
    if cls.TYPE in _REGISTRY:
        raise RuntimeError(f"duplicate message type {cls.TYPE}")
    _REGISTRY[cls.TYPE] = cls
    cls._hints = typing.get_type_hints(cls)
    return cls


class Message:
    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["type"] = self.TYPE
        return d


def decode_message(d: Any) -> Message:
    if not isinstance(d, dict):
        raise ProtocolError("frame is not a map")
    kind = d.get("type")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    kwargs = {}
    hints = cls._hints
    for f in dataclasses.fields(cls):
        if f.name in d:
            value = d[f.name]
            if not _check(value, hints[f.name]):
                raise ProtocolError(f"{kind}.{f.name}: unexpected value of type {type(value).__name__}")
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{kind}: missing field {f.name}")
    extra = set(d) - {f.name for f in dataclasses.fields(cls)} - {"type"}
    if extra:
        raise ProtocolError(f"{kind}: unknown fields {sorted(extra)}")
    return cls(**kwargs)


def _check(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_check(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (str, bool, bytes):
        return isinstance(value, tp)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_check(v, arg) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


# ---------------------------------------------------------------- gateway -> worker
@message
class Hello(Message):
    """The first frame of every worker connection: the shared internal key (`--internal-key`). A worker
    reads nothing else from a connection until this one matched (shared/wire.py)."""
    TYPE: ClassVar[str] = "hello"
    key: str = ""


@message
class GenerateRequest(Message):
    TYPE: ClassVar[str] = "generate"
    rid: str
    input_ids: list[int]
    sampling: dict  # SamplingParams.to_dict()
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = True
    # Per-tenant salt set by the server: requests with different salts never share cache entries.
    cache_salt: str | None = None
    # PD mode, set by the gateway (None: the worker computes the whole request itself).
    #   decode side:  {"role": "decode", "id": transfer id}  - reserve KV slots, wait for the pages
    #   prefill side: {"role": "prefill", "id": transfer id, "host": h, "port": p}  - compute the prompt's
    #                 KV and first token, push them over UCX to the decode worker listening at h:p
    transfer: dict | None = None
    # The client's X-Request-Id (the gateway makes one if absent): workers put it on their log lines.
    request_id: str | None = None


@message
class AbortRequest(Message):
    TYPE: ClassVar[str] = "abort"
    rid: str


@message
class FlushCacheRequest(Message):
    TYPE: ClassVar[str] = "flush_cache"
    call_id: int


@message
class InfoRequest(Message):
    TYPE: ClassVar[str] = "info"
    call_id: int


@message
class PingRequest(Message):
    """Liveness: answered by the worker's event loop, not the engine, so it also works mid-step."""
    TYPE: ClassVar[str] = "ping"
    call_id: int


# ---------------------------------------------------------------- worker -> gateway
@message
class TokenOutput(Message):
    """Incremental output of one request. The last one has `finished` set and `finish_reason`."""
    TYPE: ClassVar[str] = "out"
    rid: str
    token_ids: list[int]  # new tokens since the previous TokenOutput
    text: str  # new text since the previous TokenOutput (stop strings trimmed, partial matches held)
    finished: bool = False
    finish_reason: dict | None = None  # {"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Each entry [logprob, token_id]; top entries: per position a list of [logprob, token_id].
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: list = field(default_factory=list)  # sent once, with the first output
    input_top_logprobs: list = field(default_factory=list)
    queue_time: float = 0.0
    error: str | None = None  # set when the worker refused or failed this request
    refused: bool = False  # with error: the request itself cannot run here (invalid, larger than the pool)


@message
class FlushCacheResult(Message):
    TYPE: ClassVar[str] = "flush_cache_result"
    call_id: int
    ok: bool
    message: str = ""


@message
class InfoResult(Message):
    TYPE: ClassVar[str] = "info_result"
    call_id: int
    info: dict


@message
class PongResult(Message):
    TYPE: ClassVar[str] = "pong"
    call_id: int
    steps: int = 0  # engine steps so far: a stuck engine shows as steps that stop moving
    num_running: int = 0
    # What this worker is: the gateway learns it in the first ping of every connection.
    role: str = "unified"  # unified | prefill | decode
    transfer_host: str | None = None  # decode workers: where their UCX KV receiver listens
    transfer_port: int | None = None
    # True once the worker is stopping (SIGTERM): it finishes what it has but takes no new requests. It
    # also sends a pong with call_id 0 unasked at that moment, so gateways stop routing to it at once.
    draining: bool = False


# ---------------------------------------------------------------- prefill worker <-> decode worker (UCX)
@message
class KvHeader(Message):
    """Prefill -> decode, first on a transfer's endpoint, sent when the prefill worker takes the request
    (so the handshake overlaps the prefill): which request, and the KV layout that will follow."""
    TYPE: ClassVar[str] = "kv_header"
    transfer_id: str
    prompt_len: int
    layout: list[int]  # [num_layers, 2, num_kv_heads, head_dim] of one token's KV
    dtype: str
    key: str = ""  # the internal key: a receiver ignores a header without the right one


@message
class KvAccept(Message):
    """Decode -> prefill: send KV of positions [start, prompt_len) (what the decode side's tree lacks),
    or nothing, with the reason."""
    TYPE: ClassVar[str] = "kv_accept"
    transfer_id: str
    start: int = 0
    error: str | None = None


@message
class KvDone(Message):
    """Prefill -> decode, right after the KV: what the prefill produced besides it."""
    TYPE: ClassVar[str] = "kv_done"
    transfer_id: str
    first_token: int | None = None  # None when the request asked for no new tokens
    first_logprob: float | None = None
    first_top_logprobs: list = field(default_factory=list)
    cached_tokens: int = 0  # the prefill side's own cache hit (computation saved)


@message
class KvAck(Message):
    """Decode -> prefill, after the pages arrived: the prefill side may release its copy."""
    TYPE: ClassVar[str] = "kv_ack"
    transfer_id: str


def all_message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)
