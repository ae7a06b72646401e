"""The token-id checks every prompt given as ids passes (fields.is_token_ids, admission.check_token_ids):
the same answers as the per-element Python checks they replaced, the offender named in the message."""
from __future__ import annotations

import types

import pytest

from services.gateway.admission import check_token_ids, child_requests
from services.gateway.errors import APIError
from services.gateway.fields import is_token_ids
from shared.sampling_params import SamplingParams




@pytest.mark.parametrize("value", [[], [0], [1, 2, 3], list(range(512))])
def test_lists_of_ints_are_token_ids(value):
    assert is_token_ids(value)


@pytest.mark.parametrize("value", [None, "12", (1, 2), {1: 2}, [1, True], [False], [1, 2.0], [1, "2"], [[1]],
                                   [1, None]])
def test_anything_else_is_not(value):
    # bool is an int subclass to Python, but never a token id; a float that happens to be whole is not one
    assert not is_token_ids(value)


def _state(vocab: int):
    return types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=vocab))


def test_ids_inside_the_vocabulary_pass():
    check_token_ids(_state(100), [0, 5, 99], "prompt")
    check_token_ids(_state(100), list(range(100)) * 5, "prompt")


@pytest.mark.parametrize("ids,bad", [([0, 100], 100), ([5, -1, 7], -1), ([3, 10 ** 30], 10 ** 30),
                                     ([99, 100, -4], 100)])
def test_the_first_id_outside_is_named(ids, bad):
    with pytest.raises(APIError) as e:
        check_token_ids(_state(100), ids, "input_ids")
    assert e.value.status == 400 and e.value.param == "input_ids"
    assert f"token id {bad} is outside the vocabulary [0, 100)" in str(e.value.message)


def test_an_empty_prompt_is_refused():
    with pytest.raises(APIError) as e:
        check_token_ids(_state(100), [], "prompt")
    assert "empty" in str(e.value.message)


def test_vocabularies_of_different_sizes_are_told_apart():
    check_token_ids(_state(1000), [999], "prompt")
    with pytest.raises(APIError):
        check_token_ids(_state(10), [999], "prompt")


@pytest.mark.parametrize("n", [1, 3])
def test_child_requests_share_the_prompt_list(n):
    """No copy of the prompt per worker request (a copy is one more list of hundreds of ids alive, and
    walked by the garbage collector, for as long as the stream runs); seeds still differ per child."""
    ids = list(range(512))
    reqs = child_requests("r", n, ids, SamplingParams(seed=7))
    assert all(r.input_ids is ids for r in reqs)
    assert [r.rid for r in reqs] == (["r"] if n == 1 else [f"r-{j}" for j in range(n)])
    assert [r.sampling.seed for r in reqs] == [7 + j for j in range(n)]
