"""`GET /openapi.json`: an OpenAPI 3.1 description of the gateway's public routes, detailed enough for
clients and for property-based testing (schemathesis) of the request bodies. Built once from the limits
the gateway enforces, so the numbers in the spec are the ones it checks."""
from __future__ import annotations

from typing import Any

from services.gateway.limits import Limits
from shared.limits import MAX_GRAMMAR_CHARS, MAX_STOP_LEN, MAX_STOP_STRINGS

# Routes that answer without an API key even when --api-key is set (as SGLang: liveness and metrics
# scrapers carry no key). Everything else needs one; /flush_cache needs the admin key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}


def _errors(*codes: int) -> dict:
    text = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
            413: "body too large", 429: "too many programs running for this key", 503: "no worker can serve it now"}
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": _ERROR}}} for c in codes}


def _json_ok(schema: dict | None = None, description: str = "OK") -> dict:
    return {"200": {"description": description,
                    "content": {"application/json": {"schema": schema or {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}}}


def _text_ok(description: str) -> dict:
    return {"200": {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}}


def build_spec(limits: Limits) -> dict[str, Any]:
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    stop = {"oneOf": [{"type": "string", "maxLength": MAX_STOP_LEN},
                      {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "maxLength": MAX_STOP_LEN}},
                      {"type": "null"}]}
    sampling = {
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "stop": stop, "stop_token_ids": token_ids, "seed": {"type": "integer"},
        "ignore_eos": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
        "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "regex": {"type": "string", "maxLength": MAX_GRAMMAR_CHARS},
        "json_schema": {"type": "string", "maxLength": MAX_GRAMMAR_CHARS},
        "ebnf": {"type": "string", "maxLength": MAX_GRAMMAR_CHARS},
    }
    grammar_text = {"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS}
    schema_given = {"type": ["object", "string"]}
    choices = {"type": "array", "minItems": 1, "items": {"type": "string"}}
    # vLLM's structured outputs (services/gateway/grammar_fields.py: one constraint per request) and extras.
    vllm_extras = {
        "structured_outputs": {"type": "object", "additionalProperties": False, "properties": {
            "json": schema_given, "regex": grammar_text, "choice": choices, "grammar": grammar_text,
            "json_object": {"type": "boolean"}, "disable_fallback": {"type": "boolean"},
            "disable_any_whitespace": {"type": "boolean"}, "disable_additional_properties": {"type": "boolean"}}},
        "guided_json": schema_given, "guided_regex": grammar_text, "guided_choice": choices,
        "guided_grammar": grammar_text, "guided_decoding_backend": {"type": "string"},
        # vLLM's other extras that this server has (services/gateway/vllm_params.py)
        "include_stop_str_in_output": {"type": "boolean"},
        "truncate_prompt_tokens": {"oneOf": [{"type": "integer", "minimum": 1}, {"const": -1}]},
    }
    n = {"type": "integer", "minimum": 1, "maximum": limits.max_n}
    common = {"model": {"type": "string"}, "n": n, "stream": {"type": "boolean"},
              "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
              "max_tokens": {"type": ["integer", "null"], "minimum": 0},
              **{k: v for k, v in sampling.items() if k not in ("regex", "json_schema", "ebnf")}, **vllm_extras}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                             {**token_ids, "minItems": 1}, {"type": "array", "minItems": 1, "items": {**token_ids, "minItems": 1}}]},
        "echo": {"type": "boolean"}, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": limits.max_top_logprobs},
        "min_tokens": {"type": "integer", "minimum": 0}, **common}}
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]}, "content": content}}},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"}, "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "schema": {"type": "object"}}}}}]},
        **common}}
    native_sampling = {"type": "object", "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 0}, "min_new_tokens": {"type": "integer", "minimum": 0},
        "n": n, **sampling}}
    generate = {"type": "object", "properties": {
        "text": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "minItems": 1, "maxItems": limits.max_batch, "items": {"type": "string", "minLength": 1}}]},
        "input_ids": {"oneOf": [{**token_ids, "minItems": 1}, {"type": "array", "minItems": 1, "items": {**token_ids, "minItems": 1}}]},
        "sampling_params": native_sampling, "rid": {"type": "string", "minLength": 1, "maxLength": limits.max_rid_len},
        "stream": {"type": "boolean"}, "return_logprob": {"type": "boolean"},
        "logprob_start_len": {"type": "integer", "minimum": -1},
        "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs},
        "return_text_in_logprobs": {"type": "boolean"}},
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
    program = {"type": "object", "required": ["program"], "properties": {
        "program": {"type": "object", "description": "a traced lang_client program (IR version 1)"},
        "args": {"type": "object", "additionalProperties": {"type": "string"}}, "stream": {"type": "boolean"}}}

    tokenize = {"type": "object", "properties": {
        "model": {"type": "string"},
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]},
        "messages": chat["properties"]["messages"], "add_special_tokens": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
        "chat_template_kwargs": {"type": "object"}, "tools": {"type": "array"},
        "return_token_strs": {"type": "boolean"}},
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string"},
        "tokens": {"oneOf": [token_ids, {"type": "array", "minItems": 1, "items": token_ids}]},
        "skip_special_tokens": {"type": "boolean"}}}

    def post(summary: str, body: dict, *errors: int) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {**_json_ok(), **_errors(*errors)}}}

    def get(summary: str, responses: dict) -> dict:
        return {"get": {"summary": summary, "responses": responses}}

    info = _json_ok({"type": "object"})
    paths = {
        "/v1/completions": post("OpenAI text completions", completion, 400, 401, 404, 413, 503),
        "/v1/chat/completions": post("OpenAI chat completions", chat, 400, 401, 404, 413, 503),
        "/generate": post("SGLang-native generation", generate, 400, 401, 413, 503),
        "/v1/programs": post("Run a traced program server-side", program, 400, 401, 413, 429, 503),
        **{f"{prefix}/tokenize": post("Token ids of a prompt or chat messages (count, max_model_len, tokens)",
                                      tokenize, 400, 401, 404, 413) for prefix in ("", "/v1")},
        **{f"{prefix}/detokenize": post("Text of token ids (as `text` and `prompt`)", detokenize, 400, 401, 404, 413)
           for prefix in ("", "/v1")},
        "/v1/models": get("Served models", {**_json_ok(), **_errors(401)}),
        "/v1/models/{model_id}": {"get": {
            "summary": "One served model (404 model_not_found for another id)",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {**_json_ok(), **_errors(401, 404)}}},
        "/get_model_info": get("Model information", {**info, **_errors(401)}),
        "/model_info": get("Model information", {**info, **_errors(401)}),
        "/server_info": get("Server, limits and worker information", {**info, **_errors(401)}),
        "/get_server_info": get("Server, limits and worker information", {**info, **_errors(401)}),
        "/health": get("Ready to serve (no key needed)", {**_text_ok("ready"), "503": {"description": "not ready"}}),
        "/health_generate": get("Runs a one-token generation", {**_text_ok("a worker generated"),
                                                              "503": {"description": "generation failed"}, **_errors(401)}),
        "/metrics": get("Prometheus metrics (no key needed)", _text_ok("metrics")),
        "/openapi.json": get("This document (no key needed)", _json_ok()),
        "/flush_cache": {"post": {"summary": "Empty every worker's prefix cache (admin key when set)",
                                  "responses": {**_text_ok("flushed"), "400": {"description": "requests are running"},
                                                "503": {"description": "a worker did not answer"}, **_errors(401)}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixserve gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible and SGLang-native generation over a radix-cached worker fleet."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                       "schemas": {"Error": _ERROR}},
        "security": [{"bearer": []}],
        "paths": {p: _open(p, item) for p, item in paths.items()},
    }


def _open(path: str, item: dict) -> dict:
    if path in OPEN_PATHS:
        for op in item.values():
            op["security"] = []
    return item
