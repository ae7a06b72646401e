"""The request models (services/gateway/api/models.py) and the body reader that decodes them
(services/gateway/http/body.py): which field a refusal names, what is ignored and what refused, and the
structural refusals (depth, NaN, lone surrogates) - each a 400, never a 5xx."""
from __future__ import annotations

import msgspec
import pytest

from services.gateway.api.models import ChatRequest, CompletionRequest, GenerateRequest, ProgramRequest
from services.gateway.http.body import _too_deep, _undecodable, invalid


def _refusal(model, raw: bytes):
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(raw, type=model)
    return invalid(e.value)


@pytest.mark.parametrize("model,raw,param", [
    (ChatRequest, b'{}', "messages"),  # a required top-level field names itself
    (ChatRequest, b'{"messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    (ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content"),
    (ChatRequest, b'{"messages": [{"role": "user"}], "tools": [{"type": "function"}]}', "tools[0]"),
    (ChatRequest, b'{"messages": [{"role": "user"}], "tools": [{"function": {"name": "a b"}}]}',
     "tools[0].function.name"),
    (ChatRequest, b'{"messages": [{"role": "user"}], "structured_outputs": {"regx": "a"}}', "structured_outputs.regx"),
    (CompletionRequest, b'{"prompt": [5, true]}', "prompt"),  # inside a list of values: the field
    (CompletionRequest, b'{"prompt": "x", "n": 1.5}', "n"),
    (CompletionRequest, b'{"prompt": "x", "temperature": 1e400}', "temperature"),
    (GenerateRequest, b'{"text": "x", "sampling_params": {"n": 1e400}}', "sampling_params"),
    (ProgramRequest, b'{"program": {"nodes": [{"op": "text", "text": 1}]}}', "program.nodes[0].text"),
    (ProgramRequest, b'{"program": {"nodes": []}, "eval": 1}', "eval"),
    (CompletionRequest, b'["not", "an", "object"]', None),
])
def test_a_refusal_names_the_field(model, raw, param):
    err = _refusal(model, raw)
    assert err.status == 400 and err.param == param, (err.param, err.message)
    assert err.message


def test_unknown_top_level_fields_are_ignored():
    body = msgspec.json.decode(b'{"prompt": "x", "some_new_openai_field": {"a": 1}, "user": "u"}',
                               type=CompletionRequest)
    assert body.prompt == "x" and body.n == 1


def test_structural_refusals():
    assert _too_deep(b'{"a":' + b"[" * 65 + b"]" * 65 + b"}", 64)
    assert not _too_deep(b'{"a": "' + b"[" * 200 + b'"}', 64)  # brackets inside a string do not nest
    assert not _too_deep(b'{"a": "\\"' + b"[" * 200 + b'"}', 64)  # an escaped quote does not end the string
    nan = _undecodable(b'{"temperature": NaN}', msgspec.DecodeError("bad"))
    assert nan.status == 400 and "malformed JSON" in nan.message
    lone = _undecodable(b'{"messages": [{"content": "\\ud800"}]}', msgspec.DecodeError("bad"))
    assert (lone.code, lone.param) == ("invalid_unicode", "messages[0].content")
