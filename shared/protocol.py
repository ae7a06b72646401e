"""Every message that crosses a process boundary, defined once.

Each message is a msgspec Struct; the wire is a tagged union of them on the "type" key, msgpack-encoded and
length-prefixed on the stream (shared/wire.py). One Decoder for the whole union checks field names and
types while it parses, so a malformed frame (not msgpack, an unknown type, an unknown field, a wrong type,
a missing field, absurd nesting) becomes a ProtocolError, never a crash deeper in. No pickle anywhere.

Values inside messages are typed too: sampling parameters travel as the SamplingParams struct the gateway
validated, finish reasons as one of the FinishReason structs below (SGLang's meta_info dicts, encoded
once, at the HTTP edge, by `FinishReason.to_json`).
"""
from __future__ import annotations

from typing import Any, ClassVar, Union

import msgspec

from shared.sampling_params import SamplingParams


class ProtocolError(ValueError):
    pass


_REGISTRY: dict[str, type["Message"]] = {}


class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of every message. A subclass names its wire type with `tag=` and registers with @message."""
    TYPE: ClassVar[str] = ""


def message(cls):
    """Class decorator: register a Message subclass under its tag (also its TYPE)."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or tag in _REGISTRY:
        raise RuntimeError(f"message {cls.__name__} needs a unique tag, got {tag!r}")
    cls.TYPE = tag
    _REGISTRY[tag] = cls
    return cls


# ---------------------------------------------------------------- finish reasons (inside TokenOutput)
class FinishReason(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Why a request ended. `to_json()` is SGLang's meta_info finish_reason ({"type": "stop", "matched":
    ...} and so on), the one shape HTTP clients see; TYPE names the kind."""
    TYPE: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def _finish_reason(cls):
    cls.TYPE = cls.__struct_config__.tag
    return cls


@_finish_reason
class FinishStop(FinishReason, tag="stop"):
    matched: int | str | None = None  # the stop token id or the stop string / regex match


@_finish_reason
class FinishLength(FinishReason, tag="length"):
    length: int


@_finish_reason
class FinishAbort(FinishReason, tag="abort"):
    message: str | None = None


@_finish_reason
class FinishTransferred(FinishReason, tag="transferred"):
    """A prefill worker's request whose KV went to its decode worker (PD)."""


AnyFinishReason = Union[FinishStop, FinishLength, FinishAbort, FinishTransferred]


class Transfer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """PD mode, set by the gateway on a GenerateRequest (the worker checks role and id: a wrong one is a
    refusal naming `transfer`, not a dropped connection).
      decode side:  role "decode", id  - reserve KV slots, wait for the pages
      prefill side: role "prefill", id, host, port  - compute the prompt's KV and first token, push them
                    over UCX to the decode worker's receiver listening at host:port"""
    role: str
    id: str
    host: str | None = None
    port: int | None = None


def wants_input_logprobs(return_logprob: bool, logprob_start_len: int, prompt_len: int) -> bool:
    """The request asks for logprobs of its own prompt tokens (from logprob_start_len on). They come from
    the prompt's forward pass: such a request skips cached prefill of those positions and, in PD, runs
    whole on one worker."""
    return return_logprob and 0 <= logprob_start_len < prompt_len


# ---------------------------------------------------------------- gateway -> worker
@message
class Hello(Message, tag="hello"):
    """The first frame of every worker connection: the shared internal key (`--internal-key`). A worker
    reads nothing else from a connection until this one matched (shared/wire.py)."""
    key: str = ""


@message
class GenerateRequest(Message, tag="generate"):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams  # validated at the gateway; the worker checks the limits again
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = True
    # Per-tenant salt set by the server: requests with different salts never share cache entries.
    cache_salt: str | None = None
    # PD mode (None: the worker computes the whole request itself).
    transfer: Transfer | None = None
    # The client's X-Request-Id (the gateway makes one if absent): workers put it on their log lines.
    request_id: str | None = None

    @property
    def wants_input_logprobs(self) -> bool:
        return wants_input_logprobs(self.return_logprob, self.logprob_start_len, len(self.input_ids))


@message
class AbortRequest(Message, tag="abort"):
    rid: str


@message
class FlushCacheRequest(Message, tag="flush_cache"):
    call_id: int


@message
class InfoRequest(Message, tag="info"):
    call_id: int


@message
class PingRequest(Message, tag="ping"):
    """Liveness: answered by the worker's event loop, not the engine, so it also works mid-step."""
    call_id: int


# ---------------------------------------------------------------- worker -> gateway
@message
class TokenOutput(Message, tag="out"):
    """Incremental output of one request. The last one has `finished` set and `finish_reason`."""
    rid: str
    token_ids: list[int]  # new tokens since the previous TokenOutput
    text: str  # new text since the previous TokenOutput (stop strings trimmed, partial matches held)
    finished: bool = False
    finish_reason: AnyFinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Each entry [logprob, token_id]; top entries: per position a list of [logprob, token_id].
    output_logprobs: list = []
    output_top_logprobs: list = []
    input_logprobs: list = []  # sent once, with the first output
    input_top_logprobs: list = []
    queue_time: float = 0.0
    spec_verify_ct: int = 0  # speculative decoding: verification passes of this request so far
    error: str | None = None  # set when the worker refused or failed this request
    refused: bool = False  # with error: the request itself cannot run here (invalid, larger than the pool)
    overloaded: bool = False  # with error: refused for now, the worker too busy (its grammar compiler); a 503


def merge_outputs(first: "TokenOutput", later: "TokenOutput") -> "TokenOutput":
    """One increment equal to `first` followed by `later` (same request): what a consumer that fell behind
    sends as one event instead of two. Tokens, text and per-token logprobs concatenate; counts, the finish
    and any error are the later one's; input logprobs come once, from whichever carried them."""
    return TokenOutput(
        rid=later.rid, token_ids=first.token_ids + later.token_ids, text=first.text + later.text,
        finished=later.finished, finish_reason=later.finish_reason,
        prompt_tokens=later.prompt_tokens or first.prompt_tokens, cached_tokens=later.cached_tokens or first.cached_tokens,
        completion_tokens=later.completion_tokens or first.completion_tokens,
        output_logprobs=first.output_logprobs + later.output_logprobs,
        output_top_logprobs=first.output_top_logprobs + later.output_top_logprobs,
        input_logprobs=first.input_logprobs or later.input_logprobs,
        input_top_logprobs=first.input_top_logprobs or later.input_top_logprobs,
        queue_time=first.queue_time, spec_verify_ct=later.spec_verify_ct or first.spec_verify_ct,
        error=later.error, refused=later.refused, overloaded=later.overloaded)


@message
class TokenOutputs(Message, tag="outs"):
    """Every output of one engine step for the requests of one connection: one frame per step, however
    many streams the connection carries."""
    outputs: list[TokenOutput]


@message
class FlushCacheResult(Message, tag="flush_cache_result"):
    call_id: int
    ok: bool
    message: str = ""


@message
class InfoResult(Message, tag="info_result"):
    call_id: int
    info: dict[str, Any]


@message
class PongResult(Message, tag="pong"):
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
    # The worker's radix cache identity: new when the worker starts and at every flush (when it also
    # goes out unasked), so every gateway, not just the one that asked for the flush, forgets what it
    # thought that worker held.
    cache_id: str = ""
    # How the worker's KV pages look on the wire (one token's layout and the pool's dtype: ModelRunner.kv_format):
    # a PD pair must agree on it, so the gateway pairs a prefill worker only with decode workers of its format.
    kv_format: str = ""


# ---------------------------------------------------------------- prefill worker <-> decode worker (UCX)
@message
class KvHeader(Message, tag="kv_header"):
    """Prefill -> decode, first on a transfer's endpoint, sent when the prefill worker takes the request
    (so the handshake overlaps the prefill): which request, and the KV layout that will follow."""
    transfer_id: str
    prompt_len: int
    layout: list[int]  # [num_layers, 2, num_kv_heads, head_dim] of one token's KV
    dtype: str
    key: str = ""  # the internal key: a receiver ignores a header without the right one


@message
class KvAccept(Message, tag="kv_accept"):
    """Decode -> prefill: send KV of positions [start, prompt_len) (what the decode side's tree lacks),
    or nothing, with the reason."""
    transfer_id: str
    start: int = 0
    error: str | None = None


@message
class KvDone(Message, tag="kv_done"):
    """Prefill -> decode, right after the KV: what the prefill produced besides it."""
    transfer_id: str
    first_token: int | None = None  # None when the request asked for no new tokens
    first_logprob: float | None = None
    first_top_logprobs: list = []
    cached_tokens: int = 0  # the prefill side's own cache hit (computation saved)


@message
class KvAck(Message, tag="kv_ack"):
    """Decode -> prefill, after the pages arrived: the prefill side may release its copy."""
    transfer_id: str


def all_message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


# ---------------------------------------------------------------- the codec: one encoder, one decoder
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Union[tuple(_REGISTRY.values())])


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def encode_into(msg: Message, buf: bytearray, offset: int) -> None:
    """Encode `msg` into `buf` from `offset` on (room for a length prefix before it, no extra copy)."""
    _ENCODER.encode_into(msg, buf, offset)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """One frame's body -> its message; ProtocolError for anything that is not exactly one valid message."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:  # ValidationError included: unknown type or field, wrong type, missing
        raise ProtocolError(f"invalid frame: {e}") from None
    except RecursionError:
        raise ProtocolError("invalid frame: nested too deeply") from None
