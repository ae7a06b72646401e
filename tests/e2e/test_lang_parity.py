"""Every example program and the paper's judge program, run against the real stack (gateway + worker +
tiny model) in interpreter mode and through the program endpoint with greedy sampling: the same text and
the same variables, or a clear refusal before any token is generated."""
from __future__ import annotations

import pytest

import lang_client as sgl
from lang_client import RuntimeEndpoint
from lang_client.examples import branch_solve_merge, few_shot_qa, json_extraction, multi_turn_chat, tree_of_thought
from tests.support import seed_judge

pytestmark = pytest.mark.e2e

ESSAY = "The photo shows a crowded market; the essay argues that markets build trust between neighbours."

@sgl.function
def notes_with_vars(s, topic):
    """set_var as IR data: a constant, JSON data, strings built from generated values (an f-string, a
    concatenation with an argument), set in fork branches and gathered, then branched on."""
    s += sgl.user("Write one word about " + topic + ".")
    s += sgl.assistant(sgl.gen("word", stop="\n"))
    s["kind"] = "note"
    s.set_var("weights", {"style": 0.5, "facts": [1, 2]})
    s["headline"] = f"[{s['word']}] on " + topic
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f["angle"] = ("pro: " if i == 0 else "con: ") + s["word"]
        f += sgl.user("Argue " + f["angle"]) + sgl.assistant(sgl.gen("arg", stop="\n"))
    forks.join()
    if s["headline"] == "[x] on " + topic:
        s += sgl.user("Too short.")
    s += sgl.user(s["kind"] + ": " + s["headline"] + " / " + forks[0]["angle"]) + sgl.assistant(sgl.gen("summary"))


CASES = {
    "few_shot_qa": (few_shot_qa.few_shot_qa, {"question": "Who wrote Hamlet?"}),
    "branch_solve_merge": (branch_solve_merge.multi_dimensional_judge, {"essay": ESSAY}),
    "tree_of_thought": (tree_of_thought.tree_search, {"question": "17 sheep, all but 9 leave?", "branch_temperature": 0.0}),
    "json_extraction": (json_extraction.extract_city, {"document": "Lyon, in France, has 520000 inhabitants."}),
    "multi_turn_chat": (multi_turn_chat.multi_turn_chat, {"questions": ["Name a prime.", "Is it odd?"]}),
    "seed_judge": (seed_judge.multi_dimensional_judge, {"path": "market.jpg", "essay": ESSAY}),
    "set_var": (notes_with_vars, {"topic": "rivers"}),
}


@pytest.fixture(scope="module")
def backend(base_url):
    return RuntimeEndpoint(base_url)


def assert_same(local, remote):
    assert remote.text() == local.text()
    assert remote.messages() == local.messages()
    for name, value in local.variables().items():
        assert remote[name] == value, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_remote_run_equals_interpreter_run_greedy(name, backend):
    program, kwargs = CASES[name]
    local = program.run(backend=backend, temperature=0, max_new_tokens=24, **kwargs)
    remote = program.run(backend=backend, remote=True, temperature=0, max_new_tokens=24, **kwargs)
    assert local.error() is None and remote.error() is None
    assert_same(local, remote)


@pytest.mark.parametrize("related", ["yes", "no"])
def test_seed_judge_takes_both_paths_like_the_interpreter(related, backend):
    """Whatever the tiny model selects, each outcome of `if s["related"] == "no": return` is exercised: a
    one-choice select forces it (the program is the seed's, with its choices narrowed)."""
    @sgl.function
    def judge(s, essay):
        s += sgl.user("Essay:" + essay)
        s += sgl.assistant(sgl.select("related", choices=[related]))
        if s["related"] == "no":
            return
        forks = s.fork(2)
        for f, dim in zip(forks, ["Clarity", "Evidence"]):
            f += sgl.user("Evaluate based on the following dimension:" + dim + ".")
            f += sgl.assistant("Judgment:" + sgl.gen("judgment", stop="END"))
        s += sgl.assistant("\n".join(f["judgment"] for f in forks) + "In summary," + sgl.gen("summary", stop="."))

    local = judge.run(backend=backend, temperature=0, max_new_tokens=12, essay=ESSAY)
    remote = judge.run(backend=backend, remote=True, temperature=0, max_new_tokens=12, essay=ESSAY)
    assert_same(local, remote)
    assert ("summary" in local.variables()) == (related == "yes")


def test_seed_judge_with_its_image_line_is_refused_by_a_text_only_model(backend):
    with pytest.raises(sgl.NotSupportedError, match="image"):
        seed_judge.judge_with_image.run(backend=backend, remote=True, path="market.jpg", essay=ESSAY)
    with pytest.raises(sgl.NotSupportedError, match="image"):  # interpreter mode: the stream stops there
        seed_judge.judge_with_image.run(backend=backend, path="market.jpg", essay=ESSAY)
