"""Per-request sampling parameters: one msgspec Struct, validated once at the gateway and again on the
worker (the limits of shared/limits.py), and carried typed inside GenerateRequest (shared/protocol.py).

Field names follow SGLang's native API (`sampling_params` of `/generate`); the OpenAI translators map
their own names onto these.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable

import msgspec
import regex

from shared.errors import InvalidRequest
from shared.limits import (MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_REPEAT, MAX_STOP_LEN, MAX_STOP_STRINGS,
                           MAX_STOP_TOKEN_IDS)

# Temperatures below this are treated as greedy, as SGLang does.
GREEDY_EPS = 1e-5
MAX_STOP_REGEX = 16
MAX_STOP_REGEX_LEN = 256


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """On the wire, msgspec checks each field's type; `validate` checks ranges and limits (and, for a
    dict from an HTTP body, the types and the coercions SGLang accepts: one stop string, float ints)."""
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    # Stop when the output text matches one of these (SGLang's `stop_regex`); the match stays in the text.
    stop_regex: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] = {}
    # Constrained decoding: at most one of these.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        for kind in ("regex", "json_schema", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    # ---- construction and validation ----
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, strict: bool = False) -> "SamplingParams":
        """Build from a JSON dict (an HTTP body). Unknown keys are ignored unless `strict`.

        Raises InvalidRequest naming the field on any wrong type or out-of-range value.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise InvalidRequest("sampling_params must be an object", "sampling_params")
        known = cls.__struct_fields__
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key == "sampling_seed":
                key = "seed"
            if key not in known:
                if strict:
                    raise InvalidRequest(f"unknown sampling parameter '{key}'", key)
                continue
            if value is None:
                continue
            kwargs[key] = value
        p = cls()
        for key, value in kwargs.items():
            setattr(p, key, value)
        p.validate(kwargs.keys())
        return p

    def validate(self, given: Any = None) -> None:
        """Check ranges and limits, normalizing what SGLang accepts loosely. `given`: the names of the
        fields set from a body (a set or a dict's keys); the others hold their defaults, which pass, so
        only these are checked (a body's few fields, not all 23). The first failing check, in the order
        of _CHECKS, is raised either way."""
        for names, check in _CHECKS:
            if given is None or not given.isdisjoint(names):
                check(self)
        if self.min_new_tokens > self.max_new_tokens:
            self.min_new_tokens = self.max_new_tokens


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> "regex.Pattern":
    """The `regex` module (not `re`): its matcher resists catastrophic backtracking and takes a timeout,
    and stop patterns run on the engine thread at every step."""
    try:
        return regex.compile(pattern)
    except (regex.error, RecursionError, OverflowError) as e:
        raise InvalidRequest(f"stop_regex {pattern!r} does not compile: {e}", "stop_regex") from None


def partial_stop_suffix(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: text held back
    while streaming (the worker's stop strings, the gateway's reasoning and tool-call markers)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


# Repetition counts in a grammar: {n} / {n,m} (regex, EBNF, a schema's pattern) and a JSON schema's
# size keywords. A huge one makes a forced run (jump-forward) or an automaton that size.
_COUNTS = re.compile(r'\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|"(?:min|max)(?:Length|Items|Properties|Contains)"\s*:\s*(\d+)')


def _largest_count(text: str) -> int:
    return max((int(n) for m in _COUNTS.finditer(text) for n in m.groups() if n), default=0)


_INT_MAX = 2 ** 31 - 1  # every integer parameter fits int32 (and the wire)


def _int(p: SamplingParams, name: str, lo: int | None = None) -> None:
    v = getattr(p, name)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
        setattr(p, name, v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"{name} must be an integer", name)
    if lo is not None and v < lo:
        raise InvalidRequest(f"{name} must be >= {lo}, got {v}", name)
    if v > _INT_MAX:
        raise InvalidRequest(f"{name} must be <= {_INT_MAX}", name)


def _num(p: SamplingParams, name: str, lo: float | None = None, hi: float | None = None) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number", name)
    v = float(v)
    setattr(p, name, v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {v}", name)


# ---- the checks `validate` runs, each for the fields it reads; defaults pass every one ----
def _check_counts(p: SamplingParams) -> None:
    _int(p, "max_new_tokens", lo=0)
    _int(p, "min_new_tokens", lo=0)
    _int(p, "n", lo=1)


def _check_sampling(p: SamplingParams) -> None:
    _num(p, "temperature", lo=0.0)
    _num(p, "top_p", lo=0.0, hi=1.0)
    if p.top_p == 0.0:
        raise InvalidRequest("top_p must be in (0, 1]", "top_p")
    _int(p, "top_k", lo=-1)
    if p.top_k == 0:
        raise InvalidRequest("top_k must be -1 (disabled) or >= 1", "top_k")
    _num(p, "min_p", lo=0.0, hi=1.0)


def _check_penalties(p: SamplingParams) -> None:
    _num(p, "frequency_penalty", lo=-2.0, hi=2.0)
    _num(p, "presence_penalty", lo=-2.0, hi=2.0)
    _num(p, "repetition_penalty", lo=0.0, hi=10.0)
    if p.repetition_penalty == 0.0:
        raise InvalidRequest("repetition_penalty must be > 0", "repetition_penalty")


def _check_stop(p: SamplingParams) -> None:
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    p.stop = [s for s in p.stop if s]
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in p.stop):
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} characters", "stop")


def _check_stop_regex(p: SamplingParams) -> None:
    if isinstance(p.stop_regex, str):
        p.stop_regex = [p.stop_regex]
    if not isinstance(p.stop_regex, list) or not all(isinstance(s, str) and s for s in p.stop_regex):
        raise InvalidRequest("stop_regex must be a non-empty string or a list of them", "stop_regex")
    if len(p.stop_regex) > MAX_STOP_REGEX or any(len(s) > MAX_STOP_REGEX_LEN for s in p.stop_regex):
        raise InvalidRequest(f"at most {MAX_STOP_REGEX} stop_regex patterns of at most "
                             f"{MAX_STOP_REGEX_LEN} characters", "stop_regex")
    for pattern in p.stop_regex:
        compile_stop_regex(pattern)


def _check_stop_token_ids(p: SamplingParams) -> None:
    if isinstance(p.stop_token_ids, int) and not isinstance(p.stop_token_ids, bool):
        p.stop_token_ids = [p.stop_token_ids]
    if not isinstance(p.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")


_FLAGS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def _check_flags(p: SamplingParams) -> None:
    for name in _FLAGS:
        if not isinstance(getattr(p, name), bool):
            raise InvalidRequest(f"{name} must be a boolean", name)


def _check_seed(p: SamplingParams) -> None:
    if p.seed is not None:
        if isinstance(p.seed, bool) or not isinstance(p.seed, int):
            raise InvalidRequest("seed must be an integer", "seed")
        p.seed = p.seed & 0x7FFFFFFF


def _check_logit_bias(p: SamplingParams) -> None:
    if not isinstance(p.logit_bias, dict):
        raise InvalidRequest("logit_bias must be an object of token id -> bias", "logit_bias")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
    try:
        p.logit_bias = {int(k): float(v) for k, v in p.logit_bias.items()}
    except (TypeError, ValueError):
        raise InvalidRequest("logit_bias must map token ids to numbers", "logit_bias") from None
    if any(not -100.0 <= v <= 100.0 for v in p.logit_bias.values()):
        raise InvalidRequest("logit_bias values must be in [-100, 100]", "logit_bias")


_GRAMMARS = ("regex", "json_schema", "ebnf")


def _check_grammars(p: SamplingParams) -> None:
    grammars = [k for k in _GRAMMARS if getattr(p, k) is not None]
    if len(grammars) > 1:
        raise InvalidRequest("only one of regex, json_schema, ebnf may be set", grammars[1])
    for k in grammars:
        if not isinstance(getattr(p, k), str):
            raise InvalidRequest(f"{k} must be a string", k)
        if len(getattr(p, k)) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{k} is longer than {MAX_GRAMMAR_CHARS} characters", k)
        count = _largest_count(getattr(p, k))
        if count > MAX_REPEAT:
            raise InvalidRequest(f"{k} asks for {count} repetitions; at most {MAX_REPEAT}", k)


# (fields a check reads, the check), in the order `validate` has always checked them.
_CHECKS = (
    (("max_new_tokens", "min_new_tokens", "n"), _check_counts),
    (("temperature", "top_p", "top_k", "min_p"), _check_sampling),
    (("frequency_penalty", "presence_penalty", "repetition_penalty"), _check_penalties),
    (("stop",), _check_stop),
    (("stop_regex",), _check_stop_regex),
    (("stop_token_ids",), _check_stop_token_ids),
    (_FLAGS, _check_flags),
    (("seed",), _check_seed),
    (("logit_bias",), _check_logit_bias),
    (_GRAMMARS, _check_grammars),
)
