"""The primitives a program writes: gen, select, roles, image; and the default backend."""
from __future__ import annotations

import json
from typing import Any

from lang_client.expr import Concat, Expr, Gen, Image, RoleBegin, RoleEnd, Select, to_expr

# What a typed gen may produce; the server enforces it as a regex, exactly like any user regex.
DTYPE_REGEX = {
    int: r"[-+]?[0-9]+",
    float: r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?",
    bool: r"(True|False)",
    str: r"\"[\w\d\s]*\"",
}

_default_backend = None


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend():
    return _default_backend


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_regex: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | None = None,
    choices: list[str] | None = None,
    choices_method: Any = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Expr:
    if choices is not None:
        # gen(choices=...) is select under another name, as in SGLang.
        return select(name, choices, temperature=temperature or 0.0, choices_method=choices_method)
    if dtype is not None:
        if regex is not None:
            raise ValueError("gen: give either dtype or regex, not both")
        if dtype not in DTYPE_REGEX:
            raise ValueError(f"gen: dtype must be one of int, float, str, bool, not {dtype!r}")
        regex = DTYPE_REGEX[dtype]
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop_regex, str):
        stop_regex = [stop_regex]
    given = {
        "max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop, "stop_regex": stop_regex,
        "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "min_p": min_p, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos, "regex": regex, "json_schema": json_schema,
    }
    return Gen(name, {k: v for k, v in given.items() if v is not None}, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
               return_text_in_logprobs=return_text_in_logprobs)


def gen_int(name: str | None = None, **kwargs) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Any = None) -> Expr:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select needs a non-empty list of string choices")
    return Select(name, list(choices), temperature=temperature, choices_method=choices_method)


def image(path: str) -> Expr:
    # Built lazily so a program can be defined anywhere; appending it fails with a clear message.
    return Image(path)


def video(path: str, num_frames: int = 0) -> Expr:
    return Image(path)


def _role(role: str, expr: Any = None) -> Expr:
    if expr is None:
        return Concat([RoleBegin(role), RoleEnd(role)])
    return Concat([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> Expr:
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
