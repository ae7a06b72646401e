"""The DSL's examples against the real stack (gateway + worker + tiny model), in interpreter mode and
through the program endpoint; the fork prefix hint must show up as cached tokens in the children."""
from __future__ import annotations

import json
import re

import pytest
import requests

from lang_client import RuntimeEndpoint, set_default_backend
from lang_client.examples.branch_solve_merge import GRADE_REGEX, multi_dimensional_judge
from lang_client.examples.few_shot_qa import few_shot_qa
from lang_client.examples.json_extraction import CITY_REGEX, extract_city
from lang_client.examples.multi_turn_chat import multi_turn_chat
from lang_client.examples.tree_of_thought import best_solution, tree_search
from shared.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

MODES = [False, True]  # interpreter mode, program endpoint


@pytest.fixture(scope="module", autouse=True)
def backend(base_url):
    set_default_backend(RuntimeEndpoint(base_url))


@pytest.mark.parametrize("remote", MODES)
def test_few_shot_qa(remote):
    states = few_shot_qa.run_batch([{"question": q} for q in ["Who wrote Hamlet?", "What is 7 times 8?"]],
                                   remote=remote)
    for s in states:
        assert isinstance(s["answer"], str) and "\n" not in s["answer"]


@pytest.mark.parametrize("remote", MODES)
def test_branch_solve_merge(remote):
    s = multi_dimensional_judge.run(essay="Trees cool cities.", remote=remote)
    assert s["on_topic"] in ("yes", "no")
    assert re.fullmatch(GRADE_REGEX, s["grade"])
    assert isinstance(s["summary"], str)


@pytest.mark.parametrize("remote", MODES)
def test_tree_of_thought(remote):
    s = tree_search.run(question="17 sheep, all but 9 run away. How many are left?", remote=remote)
    assert len(s["plan"]) == 2 and all(len(a) == 2 for a in s["answer"])
    score, plan, answer = best_solution(s)
    assert isinstance(score, int) and plan in s["plan"]


@pytest.mark.parametrize("remote", MODES)
def test_json_extraction(remote):
    s = extract_city.run(document="Lyon, in France, has about 520000 inhabitants.", remote=remote)
    assert re.fullmatch(CITY_REGEX, s["city"])
    assert json.loads(s["city"])["name"]
    assert re.fullmatch(r"[-+]?\d+", s["founded"].strip())


@pytest.mark.parametrize("remote", MODES)
def test_multi_turn_chat(remote):
    s = multi_turn_chat.run(questions=["Name a prime.", "Is it odd?"], remote=remote)
    assert "answer_0" in s.text() or s["answer_0"] is not None
    assert isinstance(s["answer_1"], str)


def test_fork_children_hit_the_prefix_cache(base_url):
    """The interpreter sends the shared prefix (max_new_tokens 0) before forking: every child reports
    at least that prefix as cached."""
    from lang_client import assistant, function, gen, user

    prefix_text = "A distinct essay about rivers and their deltas. " * 8

    @function
    def fan_out(s):
        s += user(prefix_text)
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += assistant("Point " + str(i) + ":" + gen("point", max_tokens=4))
        s["probe"] = forks  # keep the forks reachable for their meta info

    s = fan_out.run()
    shared = len(Tokenizer.load("tiny-random").encode(s.text()))
    for f in s["probe"]:
        meta = f.get_meta_info("point")
        # The hint cached the whole shared prefix; a BPE merge at the boundary may cost a token.
        assert meta["cached_tokens"] >= shared - 2, (meta, shared)


def test_program_limits_are_enforced(base_url):
    ir = {"version": 1, "nodes": [{"op": "text", "text": "x" * 10}] * 100_000}
    r = requests.post(base_url + "/v1/programs", json={"program": ir}, timeout=30)
    assert r.status_code in (400, 413) and "error" in r.json()
    r = requests.post(base_url + "/v1/programs", json={"program": {"nodes": [{"op": "exec", "code": "1"}]}},
                      timeout=30)
    assert r.status_code == 400 and "error" in r.json()


def _finished_requests(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


@pytest.fixture(scope="module")
def no_hint_url():
    from tests.support.stack import Stack

    s = Stack("--disable-fork-hint")
    yield s.url
    s.stop()


def test_disable_fork_hint_leaves_the_program_endpoints_warm_up_out(base_url, no_hint_url):
    """services.launch --disable-fork-hint (a gateway flag): the program endpoint sends a fork's branches
    without the max_new_tokens=0 prefill of their shared prefix; the default sends it once per fork."""
    from lang_client import function, gen

    @function
    def fan_out(s):
        s += "A shared prefix about rivers and their deltas. " * 4
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += "Point " + str(i) + ":" + gen("point", max_tokens=2)

    sent = {}
    for name, url in (("hint", base_url), ("no hint", no_hint_url)):
        before = _finished_requests(url)
        state = fan_out.run(backend=RuntimeEndpoint(url), remote=True)
        assert state.error() is None
        sent[name] = _finished_requests(url) - before
    assert sent == {"hint": 4, "no hint": 3}  # 3 branches, + the warm-up with the hint
