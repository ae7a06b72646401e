"""SGLang's released frontend (`pip install --no-deps sglang==0.5.23`, see the README's test command) runs
programs of our own against the real stack, and `import lang_client as sgl` runs the same programs to the
same texts: a user can switch clients, or servers, without their programs noticing.

Every gen is greedy (temperature 0), so both frontends must send the same prompts to get the same answers.
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest

import lang_client
import sglang

pytestmark = pytest.mark.e2e

PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


@program
def few_shot(sgl):
    @sgl.function
    def qa(s, question):
        s += "Q: What is 2 + 2?\nA: 4\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=12, stop="\n")

    state = qa.run(question="What colour is the sky?", temperature=0)
    return {"text": state.text(), "answer": state["answer"]}


@program
def roles_and_messages(sgl):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        s += sgl.user("Name a fruit.")
        s += sgl.assistant(sgl.gen("fruit", max_tokens=6))
        s += sgl.user("Another one?")
        s += sgl.assistant(sgl.gen("again", max_tokens=6))

    state = chat.run(temperature=0)
    return {"text": state.text(), "messages": state.messages()}


@program
def choose(sgl):
    @sgl.function
    def pick(s):
        s += "The best pet is a" + sgl.select("pet", choices=[" cat", " dog", " hamster"]) + "."

    state = pick.run()
    return {"pet": state["pet"], "text": state.text()}


@program
def fork_and_join(sgl):
    @sgl.function
    def tips(s, topic):
        s += "Two tips about " + topic + ":\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, stop="\n")
        s += "Summary:" + forks[0]["tip"] + " /" + forks[1]["tip"]

    state = tips.run(topic="sleep", temperature=0)
    return {"text": state.text()}


@program
def regex_constrained(sgl):
    @sgl.function
    def year(s):
        s += "The year it happened: " + sgl.gen("year", max_tokens=8, regex=r"[0-9]{4}")

    state = year.run(temperature=0)
    return {"year": state["year"]}


@program
def stop_regex(sgl):
    @sgl.function
    def until_digit(s):
        s += "Count: " + sgl.gen("out", max_tokens=24, stop_regex=r"[aeiou][^aeiou]")

    state = until_digit.run(temperature=0)
    return {"out": state["out"]}


@program
def next_token_top_k(sgl):
    """SGLang's chain-of-thought decoding example starts this way: the top-k of the next position from a
    gen of zero tokens."""
    @sgl.function
    def probe(s):
        s += "Question: which branch? Answer:"
        s += sgl.gen("top", max_tokens=0, return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)

    state = probe.run(temperature=0)
    tops = state.get_meta_info("top")["output_top_logprobs"][0]
    return {"top_ids": [t[1] for t in tops], "top_texts": [t[2] for t in tops], "n": len(tops)}


@program
def batch(sgl):
    @sgl.function
    def complete(s, word):
        s += "A sentence with the word " + word + ":" + sgl.gen("s", max_tokens=6)

    states = complete.run_batch([{"word": w} for w in ("river", "stone", "cloud")], temperature=0)
    return {"outs": [st["s"] for st in states]}


@program
def streamed_async(sgl):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=16)

    async def collect():
        state = story.run(stream=True, temperature=0)
        return [chunk async for chunk in state.text_async_iter(var_name="story")], state

    chunks, state = asyncio.run(collect())
    return {"joined": "".join(chunks), "story": state["story"]}


def run_both(name, base_url):
    results = []
    for sgl in (sglang, lang_client):
        sgl.set_default_backend(sgl.RuntimeEndpoint(base_url))
        results.append(PROGRAMS[name](sgl))
    return results


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sglang_frontend_and_ours_agree(name, base_url):
    theirs, ours = run_both(name, base_url)
    assert theirs == ours, json.dumps({"sglang": theirs, "lang_client": ours}, indent=1)
    check = CHECKS.get(name)
    if check:
        check(theirs)


def _check_messages(r):
    msgs = r["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert r["text"].startswith("SYSTEM:You are terse.\nUSER:Name a fruit.\nASSISTANT:")  # SGLang's default
    assert all(m["content"] == m["content"].lstrip() for m in msgs)


def _check_stop_regex(r):
    assert re.search(r"[aeiou][^aeiou]\Z", r["out"]), r


CHECKS = {
    "roles_and_messages": _check_messages,
    "regex_constrained": lambda r: re.fullmatch(r"[0-9]{4}", r["year"]),
    "next_token_top_k": lambda r: r["n"] == 3 and all(isinstance(t, str) for t in r["top_texts"]),
    "choose": lambda r: r["pet"] in (" cat", " dog", " hamster"),
    "streamed_async": lambda r: r["joined"] == r["story"] and r["story"],
    "stop_regex": _check_stop_regex,
}
