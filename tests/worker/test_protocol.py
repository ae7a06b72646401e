"""The wire's codec (shared/protocol.py + shared/wire.py), in process: every message round-trips with
every field, typed sampling parameters lose nothing, finish reasons keep SGLang's JSON shapes, and any
frame that is not exactly one valid message - malformed msgpack, an unknown type or field, a wrong type,
absurd nesting, random bytes - becomes a ProtocolError, never another exception."""
from __future__ import annotations

import asyncio
import struct

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol
from shared.engine.request import Req
from shared.protocol import (AbortRequest, FinishAbort, FinishLength, FinishStop, FinishTransferred,
                             FlushCacheRequest, FlushCacheResult, GenerateRequest, Hello, InfoRequest, InfoResult,
                             KvAccept, KvAck, KvDone, KvHeader, PingRequest, PongResult, ProtocolError, TokenOutput,
                             TokenOutputs, Transfer)
from shared.sampling_params import SamplingParams
from shared.wire import HELLO_MAX_FRAME, accept_hello, encode_frame, read_message

# Every field away from its default, so a field the codec dropped or renamed shows.
FULL_SAMPLING = SamplingParams(
    max_new_tokens=77, min_new_tokens=3, n=2, temperature=0.25, top_p=0.5, top_k=40, min_p=0.05,
    frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2, stop=["\n\n", "END"],
    stop_regex=[r"\d{3}"], stop_token_ids=[2, 9], ignore_eos=True, skip_special_tokens=False,
    spaces_between_special_tokens=False, no_stop_trim=True, seed=1234, logit_bias={5: -1.5, 1000: 2.0},
    regex=None, json_schema='{"type": "object"}', ebnf=None)

FULL_OUTPUT = TokenOutput(
    rid="r-1", token_ids=[5, 6], text="hé", finished=True, finish_reason=FinishStop(matched="END"),
    prompt_tokens=9, cached_tokens=4, completion_tokens=2, output_logprobs=[[-0.5, 5], [-0.25, 6]],
    output_top_logprobs=[[[-0.5, 5]], [[-0.25, 6]]], input_logprobs=[[None, 1], [-3.0, 2]],
    input_top_logprobs=[None, [[-3.0, 2]]], queue_time=0.125, spec_verify_ct=3, error="oops", refused=True,
    overloaded=True)

EXAMPLES = {
    "hello": Hello(key="secret"),
    "generate": GenerateRequest(rid="r-1", input_ids=[1, 2, 3], sampling=FULL_SAMPLING, return_logprob=True,
                                logprob_start_len=1, top_logprobs_num=3, return_text_in_logprobs=True, stream=False,
                                cache_salt="tenant", transfer=Transfer(role="prefill", id="t", host="h", port=9),
                                request_id="req-abc"),
    "abort": AbortRequest(rid="r-1"),
    "flush_cache": FlushCacheRequest(call_id=3),
    "info": InfoRequest(call_id=4),
    "ping": PingRequest(call_id=5),
    "out": FULL_OUTPUT,
    "outs": TokenOutputs(outputs=[FULL_OUTPUT, TokenOutput(rid="r-2", token_ids=[7], text="x")]),
    "flush_cache_result": FlushCacheResult(call_id=3, ok=False, message="busy"),
    "info_result": InfoResult(call_id=4, info={"num_running": 2, "nested": {"a": [1, 2.5, None]}}),
    "pong": PongResult(call_id=5, steps=10, num_running=2, role="decode", transfer_host="h", transfer_port=7,
                       draining=True, cache_id="c0ffee", kv_format="2x2x4x8 bfloat16"),
    "kv_header": KvHeader(transfer_id="t", prompt_len=12, layout=[2, 2, 4, 8], dtype="bfloat16", key="k"),
    "kv_accept": KvAccept(transfer_id="t", start=4, error="no room"),
    "kv_done": KvDone(transfer_id="t", first_token=42, first_logprob=-0.5, first_top_logprobs=[[-0.5, 42]],
                      cached_tokens=3),
    "kv_ack": KvAck(transfer_id="t"),
}


def _frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


def _read(data: bytes, max_size: int | None = None):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await (read_message(reader) if max_size is None else read_message(reader, max_size))
    return asyncio.run(go())


def test_every_message_type_has_an_example():
    assert set(EXAMPLES) == set(protocol.all_message_types())
    assert all(type(m).TYPE == tag for tag, m in EXAMPLES.items())


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_round_trip_keeps_every_field(tag):
    msg = EXAMPLES[tag]
    got = _read(bytes(encode_frame(msg)))
    assert type(got) is type(msg) and got == msg
    assert msgspec.to_builtins(got) == msgspec.to_builtins(msg)


def test_examples_set_every_field_away_from_its_default():
    """So the round trip above would see a field the codec loses (omit_defaults drops defaults only)."""
    for tag, msg in EXAMPLES.items():
        for f in msgspec.structs.fields(msg):
            if not f.required:
                default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
                assert getattr(msg, f.name) != default, f"{tag}.{f.name} is left at its default {default!r}"


def test_typed_sampling_params_round_trip_loses_no_field():
    defaults = SamplingParams()
    for name in SamplingParams.__struct_fields__:
        if name not in ("regex", "ebnf"):  # at most one grammar may be set: json_schema carries that case
            assert getattr(FULL_SAMPLING, name) != getattr(defaults, name), name
    FULL_SAMPLING.validate()  # the example is valid, so the worker's re-check keeps it as it is
    got = _read(bytes(encode_frame(EXAMPLES["generate"])))
    assert isinstance(got.sampling, SamplingParams)
    for name in SamplingParams.__struct_fields__:
        assert getattr(got.sampling, name) == getattr(FULL_SAMPLING, name), name
    got.sampling.validate()
    assert got.sampling == FULL_SAMPLING
    # And the gateway's path: an HTTP body's dict, validated once, then sent typed.
    body = {k: v for k, v in msgspec.to_builtins(FULL_SAMPLING).items()}
    body["logit_bias"] = {str(k): v for k, v in FULL_SAMPLING.logit_bias.items()}  # JSON object keys
    assert SamplingParams.from_dict(body, strict=True) == FULL_SAMPLING


def test_defaults_are_not_sent_and_come_back():
    msg = TokenOutput(rid="r", token_ids=[1], text="a")
    body = protocol.encode(msg)
    assert set(msgpack.unpackb(body)) == {"type", "rid", "token_ids", "text"}
    got = protocol.decode(body)
    assert got == msg and got.output_logprobs == [] and got.output_logprobs is not msg.output_logprobs


def test_finish_reasons_keep_sglang_json_shapes():
    assert FinishStop(matched=2).to_json() == {"type": "stop", "matched": 2}
    assert FinishStop(matched="\n\n").to_json() == {"type": "stop", "matched": "\n\n"}
    assert FinishLength(length=16).to_json() == {"type": "length", "length": 16}
    assert FinishAbort(message="aborted").to_json() == {"type": "abort", "message": "aborted"}
    assert FinishTransferred().to_json() == {"type": "transferred"}
    assert [c.TYPE for c in (FinishStop, FinishLength, FinishAbort, FinishTransferred)] == \
        ["stop", "length", "abort", "transferred"]


def test_input_logprobs_are_wanted_by_one_definition():
    for ret, start, n, want in [(True, 0, 3, True), (True, 2, 3, True), (True, 3, 3, False), (True, -1, 3, False),
                                (False, 0, 3, False)]:
        req = GenerateRequest(rid="r", input_ids=list(range(n)), sampling=SamplingParams(), return_logprob=ret,
                              logprob_start_len=start)
        engine_req = Req(rid="r", input_ids=list(range(n)), params=SamplingParams(), seed=0, return_logprob=ret,
                         logprob_start_len=start)
        assert req.wants_input_logprobs is engine_req.wants_input_logprobs is want


# ---------------------------------------------------------------- malformed frames
GOOD_GENERATE = {"type": "generate", "rid": "r", "input_ids": [1, 2], "sampling": {}}
BAD_FRAMES = {
    "not msgpack": b"\x00\x00\x00\x05hello",
    "invalid opcode": b"\x00\x00\x00\x03\xc1\xc1\xc1",
    "truncated body": (lambda f: struct.pack("!I", len(f) - 7) + f[4:-3])(_frame(GOOD_GENERATE)),
    "trailing bytes": (lambda b: struct.pack("!I", len(b) + 1) + b + b"\x00")(msgpack.packb(GOOD_GENERATE)),
    "not a map": _frame([1, 2, 3]),
    "a bare int": _frame(7),
    "no type": _frame({"rid": "r"}),
    "unknown type": _frame({"type": "exec", "code": "import os"}),
    "type not a string": _frame({"type": 3, "rid": "r"}),
    "unknown field": _frame({"type": "ping", "call_id": 1, "cmd": "x"}),
    "missing field": _frame({"type": "generate", "rid": "r"}),
    "rid not a string": _frame({**GOOD_GENERATE, "rid": 5}),
    "token ids not ints": _frame({**GOOD_GENERATE, "input_ids": ["a"]}),
    "bool as an int": _frame({**GOOD_GENERATE, "input_ids": [True]}),
    "float as an int": _frame({"type": "ping", "call_id": 1.0}),
    "sampling not a map": _frame({**GOOD_GENERATE, "sampling": "greedy"}),
    "sampling unknown field": _frame({**GOOD_GENERATE, "sampling": {"temprature": 0.5}}),
    "sampling wrong type": _frame({**GOOD_GENERATE, "sampling": {"temperature": "hot"}}),
    "sampling stop not strings": _frame({**GOOD_GENERATE, "sampling": {"stop": [1]}}),
    "logit bias key not an int": _frame({**GOOD_GENERATE, "sampling": {"logit_bias": {"x": 1.0}}}),
    "finish reason unknown": _frame({"type": "out", "rid": "r", "token_ids": [], "text": "",
                                     "finish_reason": {"type": "exploded"}}),
    "finish reason extra field": _frame({"type": "out", "rid": "r", "token_ids": [], "text": "",
                                         "finish_reason": {"type": "length", "length": 3, "x": 1}}),
    "finish reason a dict of strings": _frame({"type": "out", "rid": "r", "token_ids": [], "text": "",
                                               "finish_reason": {"type": "length", "length": "3"}}),
    "transfer id not a string": _frame({**GOOD_GENERATE, "transfer": {"role": "decode", "id": 5}}),
    "transfer unknown field": _frame({**GOOD_GENERATE, "transfer": {"role": "decode", "id": "t", "slots": [1]}}),
    "batch of non-outputs": _frame({"type": "outs", "outputs": [{"type": "ping", "call_id": 1}]}),
    # {"type": "info_result", "call_id": 1, "info": {"a": [[[...200k deep...]]]}}: the untyped `info` map
    "deep nesting": (lambda b: struct.pack("!I", len(b)) + b)(
        b"\x83" + b"".join(msgpack.packb(v) for v in ("type", "info_result", "call_id", 1, "info"))
        + b"\x81" + msgpack.packb("a") + b"\x91" * 200_000 + b"\xc0"),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_malformed_frame_is_a_protocol_error(name):
    with pytest.raises(ProtocolError):
        _read(BAD_FRAMES[name])


def test_length_prefix_is_checked_before_reading():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _read(struct.pack("!I", 2 ** 31) + b"x", max_size=1024)  # no 2 GB read, and no wait for it


def test_hello_is_capped_and_checked_before_anything_else():
    async def handshake(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        await accept_hello(reader, "k")

    asyncio.run(handshake(bytes(encode_frame(Hello(key="k")))))
    for data in (bytes(encode_frame(Hello(key="k" * HELLO_MAX_FRAME))), bytes(encode_frame(PingRequest(call_id=0))),
                 bytes(encode_frame(Hello(key="wrong"))), _frame({"type": "hello", "key": 5})):
        with pytest.raises(ProtocolError):
            asyncio.run(handshake(data))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        msg = protocol.decode(data)
    except ProtocolError:
        return
    assert type(msg).TYPE in protocol.all_message_types()


_scalars = st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
_json_values = st.recursive(
    _scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(EXAMPLES)), st.data())
def test_mutated_messages_decode_or_fail_cleanly(tag, data):
    """A valid message with one field replaced by an arbitrary value, or one key added: a ProtocolError
    or a message whose fields have the declared types - nothing else."""
    d = msgspec.to_builtins(EXAMPLES[tag])
    key = data.draw(st.sampled_from(sorted(d) + ["extra"]))
    d[key] = data.draw(_json_values)
    try:
        msg = protocol.decode(msgpack.packb(d, use_bin_type=True))
    except ProtocolError:
        return
    assert type(msg).TYPE == d["type"]
    msgspec.msgpack.decode(protocol.encode(msg), type=type(msg))  # still well-typed after a round trip


def test_merge_outputs_is_the_two_increments_in_order():
    from shared.protocol import FinishLength, TokenOutput, merge_outputs

    a = TokenOutput(rid="r", token_ids=[1, 2], text="ab", prompt_tokens=5, cached_tokens=2, completion_tokens=2,
                    output_logprobs=[[-0.1, 1], [-0.2, 2]], output_top_logprobs=[[], []],
                    input_logprobs=[[None, 7]], queue_time=0.5, spec_verify_ct=1)
    b = TokenOutput(rid="r", token_ids=[3], text="c", finished=True, finish_reason=FinishLength(length=3),
                    prompt_tokens=5, cached_tokens=2, completion_tokens=3, output_logprobs=[[-0.3, 3]],
                    output_top_logprobs=[[]], queue_time=0.9, spec_verify_ct=2)
    m = merge_outputs(a, b)
    assert (m.token_ids, m.text, m.finished, m.finish_reason, m.completion_tokens) == ([1, 2, 3], "abc", True,
                                                                                     FinishLength(length=3), 3)
    assert m.output_logprobs == [[-0.1, 1], [-0.2, 2], [-0.3, 3]] and len(m.output_top_logprobs) == 3
    assert m.input_logprobs == [[None, 7]] and m.queue_time == 0.5 and m.error is None
    assert m.spec_verify_ct == 2  # a running count: the later one
    # Every field of the message is accounted for (a new one must be merged on purpose).
    assert set(TokenOutput.__struct_fields__) == {
        "rid", "token_ids", "text", "finished", "finish_reason", "prompt_tokens", "cached_tokens",
        "completion_tokens", "output_logprobs", "output_top_logprobs", "input_logprobs", "input_top_logprobs",
        "queue_time", "spec_verify_ct", "error", "refused", "overloaded"}
