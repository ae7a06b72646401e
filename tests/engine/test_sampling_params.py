"""SamplingParams.from_dict checks only the fields a body sets (the others hold defaults, which pass):
the same parameters, or the same first error, as checking every field."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams

# Per field, values that pass, fail, or are coerced (float ints, one stop string, string keys).
_VALUES = {
    "max_new_tokens": [0, 16, 16.0, -1, 2.5, True, "8", 2 ** 40],
    "min_new_tokens": [0, 4, 64, -2, None],
    "n": [1, 3, 0],
    "temperature": [0, 0.7, -0.1, float("nan"), "1", False],
    "top_p": [1.0, 0.5, 0.0, 1.5],
    "top_k": [-1, 1, 40, 0, -5, 3.0],
    "min_p": [0.0, 0.2, 2.0],
    "frequency_penalty": [0.0, 1.5, 3.0],
    "presence_penalty": [-2.0, 2.5],
    "repetition_penalty": [1.0, 0.0, 11.0, 1.1],
    "stop": ["x", ["a", "", "b"], [1], ["y" * 1000], 5],
    "stop_regex": [r"\d+", [""], ["a", "("], 3],
    "stop_token_ids": [[2, 3], 7, [True], [-1], "x"],
    "ignore_eos": [True, False, 1],
    "skip_special_tokens": [False, "no"],
    "spaces_between_special_tokens": [True, 0],
    "no_stop_trim": [True, None],
    "seed": [7, 2 ** 33, -3, 1.5, True],
    "logit_bias": [{"5": 1.0}, {"5": 101}, {"x": 1}, [1], {}],
    "regex": ["a+", 5, "a{9999999}"],
    "json_schema": ['{"type": "object"}', "{}"],
    "ebnf": ['root ::= "a"'],
}


def _every_field_checked(d: dict) -> SamplingParams:
    p = SamplingParams()
    for key, value in d.items():
        setattr(p, key, value)
    p.validate()
    return p


def _outcome(build, d: dict):
    try:
        return build(d)
    except InvalidRequest as e:
        return type(e), str(e), e.param


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_VALUES)), st.integers(0, 7), max_size=6))
def test_from_dict_answers_as_checking_every_field(picks):
    d = {k: _VALUES[k][i % len(_VALUES[k])] for k, i in picks.items()}
    d = {k: v for k, v in d.items() if v is not None}
    assert _outcome(SamplingParams.from_dict, dict(d)) == _outcome(_every_field_checked, dict(d))


def test_an_unset_field_is_not_checked_but_a_set_one_is():
    p = SamplingParams.from_dict({"max_new_tokens": 5, "min_new_tokens": 9})
    assert (p.max_new_tokens, p.min_new_tokens) == (5, 5)  # the cross-field clamp still applies
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"temperature": 0.5, "top_p": 0.0})
    assert e.value.param == "top_p"
