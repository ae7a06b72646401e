"""Traced programs as users write them: string work on generated values and branches on them.

Each program runs in interpreter mode and through the program endpoint (the fake server's /v1/programs runs
services.gateway.programs); both must give the same text and variables, or tracing must refuse it clearly
before any request is sent.
"""
import asyncio
import re

import pytest

import lang_client as sgl
from lang_client import assistant, function, gen, select, user
from lang_client.tracer import MAX_PATHS
from services.gateway.programs import ProgramError, execute_program, validate_program
from shared.errors import InvalidRequest
from tests.support.fake_sglang_server import FakeSGLangServer


def echo(prompt: str, sampling: dict) -> str:
    """The fake model repeats the word after the prompt's last `say `; `WORDS` otherwise."""
    if "say " in prompt:
        return prompt.rsplit("say ", 1)[1].split("\n")[0].split("<")[0].split()[0] + "\n"
    return "words and more words\n"


@pytest.fixture(scope="module")
def server():
    with FakeSGLangServer(responder=echo) as srv:
        yield srv


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.url)


def both(program, backend, **kwargs):
    """Run locally and remotely; assert they agree; return (local state, remote state)."""
    local = program.run(backend=backend, **kwargs)
    remote = program.run(backend=backend, remote=True, **kwargs)
    assert remote.text() == local.text()
    for name, value in local.variables().items():
        assert remote[name] == value, name
    return local, remote


def ops(nodes):
    return [n["op"] for n in nodes]


# ---- 1. string work on variables ----
@function
def string_work(s, word):
    s += "say " + word + "\n" + gen("a", stop="\n") + "\n"
    a = s["a"]
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"say {a}{i}\n" + gen("b", stop="\n")
    joined = "; ".join(f["b"] for f in forks)
    s += "Both: " + joined + "\n"                     # str + variable text
    s += a + " was first\n"                           # variable + str
    s += "again: %s and %s\n" % (a, str(a))           # % formatting and str()
    s += "{}|{}\n".format(a, "literal"[:3])           # str.format and a sliced literal
    s += "say " + forks[1]["b"] + "\n" + gen("c", stop="\n")


def test_string_work_traces_into_text_and_var_nodes():
    ir = string_work.trace(word="kiwi")
    nodes = ir["nodes"]
    assert {"op": "var", "name": "b", "scope": "f0.0"} in nodes and {"op": "var", "name": "b", "scope": "f0.1"} in nodes
    assert {"op": "text", "text": "; "} in nodes
    fork = next(n for n in nodes if n["op"] == "fork")
    assert fork["branches"][1][:3] == [{"op": "text", "text": "say "}, {"op": "var", "name": "a", "scope": ""},
                                       {"op": "text", "text": "1\n"}]
    assert {"op": "text", "text": "|lit\nsay "} in nodes
    assert all("\ue000" not in str(n) for n in nodes)


def test_string_work_runs_remotely_like_locally(backend):
    local, remote = both(string_work, backend, word="kiwi")
    assert "Both: kiwi0; kiwi1\n" in local.text() and local["c"] == "kiwi1"
    assert remote["a"] == "kiwi" and remote["f0.1.b"] == "kiwi1"


def test_unbound_arguments_join_and_format_too():
    @function
    def greet(s, name, place):
        s += f"{name} from {place}: " + ", ".join([name, place]) + gen("x", max_tokens=4)

    ir = greet.trace()
    assert ir["args"] == ["name", "place"]
    assert ops(ir["nodes"]) == ["arg", "text", "arg", "text", "arg", "text", "arg", "gen"]


# ---- set_var: constants and strings built from generated values become `set` nodes ----
@function
def with_vars(s, word):
    s += "say " + word + "\n" + gen("a", stop="\n") + "\n"
    s["label"] = "fixed"                       # a constant string
    s.set_var("n", 3)                          # JSON data
    s.set_var("info", {"k": [1, 2.5, None, True]})
    s["both"] = s["a"] + "/" + word            # built from a variable and an argument
    s["fmt"] = f"<{s['a']}>"                   # an f-string of a variable
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f["tag"] = f"{i}:{s['a']}"             # set inside a fork branch, gathered by join
        f += "say " + f["tag"] + "\n" + gen("b", stop="\n")
    forks.join()
    if s["both"] == "kiwi/kiwi":               # a branch on a set variable
        s += "same "
    s["both"] = s["both"] + "!"                # redefined from its previous value
    s += "n=" + str(s["n"] + 1) + " " + s["label"] + " " + s["fmt"] + " " + s["both"] + "\n"
    s += "say " + s["both"] + "\n" + gen("c", stop="\n")


def test_set_var_traces_into_set_nodes():
    ir = with_vars.trace(word="kiwi")
    sets = [n for n in ir["nodes"] if n["op"] == "set"]
    assert sets[:3] == [{"op": "set", "name": "label", "value": "fixed"}, {"op": "set", "name": "n", "value": 3},
                        {"op": "set", "name": "info", "value": {"k": [1, 2.5, None, True]}}]
    assert sets[3] == {"op": "set", "name": "both", "parts": [{"op": "var", "name": "a", "scope": ""},
                                                              {"op": "text", "text": "/kiwi"}]}
    assert sets[4]["parts"][1] == {"op": "var", "name": "a", "scope": ""}
    fork = next(n for n in ir["nodes"] if n["op"] == "fork")
    assert fork["branches"][1][0]["op"] == "set" and fork["branches"][1][0]["name"] == "tag"
    assert "n=4 fixed" in str(ir)  # constants are known while tracing: Python computes with them
    validate_program(ir)
    unbound = with_vars.trace()  # the argument unbound: an arg node inside the parts
    assert {"op": "arg", "name": "word"} in next(n for n in unbound["nodes"] if n.get("name") == "both")["parts"]


@pytest.mark.parametrize("word", ["kiwi", "plum"])
def test_set_var_runs_remotely_like_locally(backend, word):
    local, remote = both(with_vars, backend, word=word)
    assert local["both"] == f"{word}/{word}!" and local["tag"] == [f"0:{word}", f"1:{word}"]
    assert ("same " in local.text()) == (word == "kiwi")
    assert remote["info"] == {"k": [1, 2.5, None, True]} and remote["f0.1.tag"] == f"1:{word}"
    assert local["c"] == f"{word}/{word}!"


def test_set_var_of_a_select_keeps_its_choices_for_branches():
    @function
    def pick(s):
        s += select("c", choices=["a", "b"])
        s["d"] = s["c"]
        if s["d"] == "a":
            s += "A"
        elif s["d"] == "b":
            s += "B"
        else:
            s += "never"

    assert "never" not in str(pick.trace())


@pytest.mark.parametrize("value, needle", [
    (lambda s: s.fork(2), "ForkList|TracerGroup|cannot be part of a remote program"),
    (lambda s: ("a", "b"), "tuple"),
    (lambda s: float("nan"), "finite"),
    (lambda s: [s["v"]], "cannot depend on generated values"),
    (lambda s: {1: "x"}, "keys must be strings"),
    (lambda s: s["v"].strip(), "strip"),
])
def test_set_var_of_what_cannot_be_data_is_refused_before_anything_is_sent(value, needle, backend, server):
    @function
    def prog(s):
        s += "say x\n" + sgl.gen("v", max_tokens=4)
        s["w"] = value(s)

    before = len(server.requests)
    with pytest.raises(sgl.TracingError, match=needle):
        prog.run(backend=backend, remote=True)
    assert len(server.requests) == before


def test_set_node_validation():
    gen_x = {"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 2}}
    for bad, match in [({"op": "set", "name": "y"}, "either a value or parts"),
                       ({"op": "set", "name": "y", "value": "a", "parts": []}, "either a value or parts"),
                       ({"op": "set", "name": "y", "parts": [{"op": "gen", "name": "z"}]},
                        r"parts\[0\]\.op: Invalid value 'gen'"),  # parts are text, var or arg nodes
                       ({"op": "set", "name": "y", "parts": "x"}, "Expected `array`"),
                       ({"op": "set", "name": "y", "parts": [{"op": "var", "name": "q", "scope": ""}]},
                        "before it is defined"),
                       ({"op": "set", "name": "1y", "value": 1}, "matching regex")]:
        with pytest.raises(InvalidRequest, match=match):
            validate_program({"version": 1, "nodes": [gen_x, bad]})
    data = {"op": "set", "name": "y", "value": [1, 2]}
    with pytest.raises(InvalidRequest, match="not a string"):  # data is answered, not appended
        validate_program({"version": 1, "nodes": [data, {"op": "var", "name": "y", "scope": ""}]})


# ---- 2. branches ----
@function
def triage(s, word):
    s += "say " + word + "\n" + gen("kind", stop="\n") + "\n"
    if s["kind"] == "stop":
        s += "Stopped."
        return
    if s["kind"] in ("red", "green"):
        s += "say colour\n" + gen("note", stop="\n")
    elif s["kind"] != "blue":
        s += "say other\n" + gen("note", stop="\n")
    s += "\nsay done\n" + gen("end", stop="\n")


def test_branches_become_if_nodes_placed_where_paths_differ():
    ir = triage.trace(word="x")
    top = ir["nodes"]
    assert ops(top)[-1] == "if" and top[-1]["cond"] == {"var": "kind", "scope": "", "test": "eq", "value": "stop"}
    assert top[-1]["then"] == [{"op": "text", "text": "Stopped."}]
    red = top[-1]["else"][-1]
    assert red["cond"]["value"] == "red" and red["else"][-1]["cond"]["value"] == "green"
    validate_program(ir)


@pytest.mark.parametrize("word", ["stop", "red", "green", "blue", "teal"])
def test_every_path_runs_remotely_like_locally(backend, word):
    local, remote = both(triage, backend, word=word)
    assert ("note" in local.variables()) == (word not in ("stop", "blue"))


def test_select_choices_bound_the_paths():
    @function
    def pick(s):
        s += select("c", choices=["a", "b"])
        if s["c"] == "a":
            s += "A"
        elif s["c"] == "b":   # must be true here: no third path
            s += "B"
        else:
            s += "never"
        if s["c"] == "zzz":   # not a choice: never true, no branch at all
            s += "never"

    ir = pick.trace()
    top = ir["nodes"]
    assert ops(top) == ["select", "if"] and top[1]["then"] == [{"op": "text", "text": "A"}]
    assert top[1]["else"] == [{"op": "text", "text": "B"}]
    assert "never" not in str(ir)


def test_truth_value_and_ne_branch(backend):
    @function
    def nonempty(s, word):
        s += "say " + word + "\n" + gen("w", stop="\n", max_tokens=8)
        if s["w"]:
            s += " yes"
        if s["w"] != "k":
            s += " not k"

    for word in ("k", "zz"):
        both(nonempty, backend, word=word)


def test_branch_inside_fork_branches(backend):
    @function
    def prune(s):
        s += "Start.\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"say {'keep' if i else 'drop'}\n" + gen("v", stop="\n")
        for f in forks:
            if f["v"] == "keep":
                f += "\nsay more\n" + gen("w", stop="\n")
        s += "First: " + forks[0]["v"]

    ir = prune.trace()
    fork = ir["nodes"][1]
    assert all(b[-1]["op"] == "if" for b in fork["branches"])
    both(prune, backend)


def test_fork_ids_stay_unique_across_paths(backend):
    @function
    def forks_in_arms(s, word):
        s += "say " + word + "\n" + gen("w", stop="\n")
        if s["w"] == "one":
            f = s.fork(2)
            f += "say a\n" + gen("x", stop="\n")
            f.join()
        else:
            f = s.fork(3)
            f += "say b\n" + gen("y", stop="\n")
            f.join()

    ir = forks_in_arms.trace(word="q")
    ids = [ir["nodes"][-1]["then"][0]["id"], ir["nodes"][-1]["else"][0]["id"]]
    assert ids[0] != ids[1]
    for word in ("one", "two"):
        both(forks_in_arms, backend, word=word)


def test_bounded_loops_over_constants_keep_working(backend):
    @function
    def chat(s, questions):
        for i, q in enumerate(questions):
            s += user("say " + q)
            s += assistant(gen(f"a{i}", stop="\n"))
            if s[f"a{i}"] == "bye":
                break

    ir = chat.trace(questions=["hi", "bye", "more"])
    validate_program(ir)
    validate_program(chat.trace(questions=[f"q{i}" for i in range(30)]))  # 30 turns, 31 paths: still bounded
    local, _ = both(chat, backend, questions=["hi", "bye", "more"])
    assert "a2" not in local.variables()


def test_unbounded_data_dependent_loop_is_refused_naming_the_line(backend, server):
    @function
    def agent(s):
        s += "say go\n"
        step = 0
        while s.get_var(f"act{step - 1}") != "finish" if step else True:
            s += gen(f"act{step}", stop="\n") + "\nsay finish\n"
            step += 1

    before = len(server.requests)
    with pytest.raises(sgl.TracingError, match=r"test_branches.py:\d+.*loop.*without remote=True"):
        agent.run(backend=backend, remote=True)
    assert len(server.requests) == before  # refused before anything was sent
    local = agent.run(backend=backend)      # interpreter mode still runs it
    assert local["act1"] == "finish"


def test_too_many_paths_are_refused():
    @function
    def explode(s):
        for i in range(8):
            s += gen(f"x{i}", max_tokens=2)
            if s[f"x{i}"] == "y":
                s += "Y"
            s += "."

    with pytest.raises(sgl.TracingError, match=f"more than {MAX_PATHS} paths"):
        explode.trace()


@pytest.mark.parametrize("body, needle", [
    (lambda v: len(v), "len()"),
    (lambda v: str(int(v)), "int()"),
    (lambda v: v[:3], "slicing"),
    (lambda v: v.upper(), "upper"),
    (lambda v: {v: 1}, "hashing"),
    (lambda v: v < "m", "ordering"),
    (lambda v: v == v, "another generated value"),
    (lambda v: ("x" + v + "y")[:3], "indexing or slicing a string built"),
    (lambda v: "".join(["x", v, "y"])[:3], "cut apart"),
    (lambda v: str((v + "!") == "x!"), "comparing a string built from generated values"),
    (lambda v: str(len("Q: %s" % v)), "len() of a string built"),
    (lambda v: sgl.gen("z", stop=v), "sampling parameters"),
])
def test_value_dependent_python_is_refused_clearly(body, needle):
    @function
    def prog(s):
        s += sgl.gen("v", max_tokens=4)
        s += body(s["v"])

    with pytest.raises(sgl.TracingError) as err:
        prog.trace()
    assert needle in str(err.value)


@function
def derived(s, case):
    """Strings built from a generated value by f-strings, join, %, format and str(): any use of their value
    is refused where it happens (this file, that line); each case's line says `# <case>`."""
    s += "say x\n" + gen("v", max_tokens=4) + "\n"
    v = s["v"]
    if case == "len":
        s += str(len(f"<{v}>"))  # len
    elif case == "int":
        s += str(int(f"{v}0"))  # int
    elif case == "compare":
        s += "yes" if ", ".join([v, "x"]) == "a, x" else "no"  # compare
    elif case == "percent-tuple":
        s += str(len("%s-%s" % (v, v)))  # percent-tuple
    elif case == "str":
        s += str(len(str(v)))  # str
    elif case == "format":
        s += str("{}!".format(v) < "m")  # format
    elif case == "in":
        s += str("a" in f"{v}")  # in
    elif case == "slice":
        s += f"{v}!"[:2]  # slice
    elif case == "truth":
        s += "yes" if f"{v}" else "no"  # truth
    elif case == "lambda":
        s += str((lambda x: len(f"[{x}]"))(v))  # lambda
    elif case == "nested":
        def shout(x):
            return f"{x}!".upper()  # nested
        s += shout(v)
    elif case == "spec":
        s += f"{v:>8}"  # spec
    elif case == "repr":
        s += f"{v!r}"  # repr
    elif case == "repr-call":
        s += repr(v + "!")  # repr-call
    elif case == "hash":
        s += {f"{v}": "x"}[f"{v}"]  # hash
    elif case == "join-then-split":
        s += " ".join([v, v]).split()[0]  # join-then-split


DERIVED_CASES = ["len", "int", "compare", "percent-tuple", "str", "format", "in", "slice", "truth", "lambda",
                 "nested", "spec", "repr", "repr-call", "hash", "join-then-split"]


@pytest.mark.parametrize("case", DERIVED_CASES)
def test_value_of_a_derived_string_is_refused_at_its_line(case, backend, server):
    before = len(server.requests)
    with pytest.raises(sgl.TracingError) as err:
        derived.run(backend=backend, remote=True, case=case)
    assert len(server.requests) == before  # nothing was sent
    where = re.match(r"(.+):(\d+): ", str(err.value))
    assert where and where.group(1) == __file__, str(err.value)
    with open(__file__) as f:
        assert f.read().splitlines()[int(where.group(2)) - 1].endswith(f"# {case}"), str(err.value)
    assert "without remote=True" in str(err.value)


def test_derived_strings_still_concatenate_join_and_format(backend):
    """What moves a generated value around without looking at it keeps working and runs like locally."""
    @function
    def fine(s, word):
        s += "say " + word + "\n" + gen("v", stop="\n") + "\n"
        v = s["v"]
        line = f"<{v}>" + " and " + ", ".join([v, f"{v}!"]) + " %s|%s" % (v, "{}".format(v)) + str(v)
        sep = f" {v} "
        s += sep.join(["a", "b"]) + "\n" + line + "\n"
        s += f"{'-'.join(['x', f'{v}'])}" + "\n"
        if v in ("kiwi", "plum"):
            s += "fruit\n"
        s += "say " + f"{v}" + "\n" + gen("w", stop="\n")

    for word in ("kiwi", "rock"):
        local, _ = both(fine, backend, word=word)
        assert f"<{word}> and {word}, {word}! {word}|{word}{word}" in local.text()


def test_programs_without_source_still_trace():
    """No source to rewrite (exec'd code): traced as before, with the built-in checks only."""
    namespace = {"gen": gen}
    exec("def p(s):\n    s += 'say a\\n' + gen('v', max_tokens=2)\n    s += f\"<{s['v']}>\"\n", namespace)
    ir = sgl.function(namespace["p"]).trace()
    assert {"op": "var", "name": "v", "scope": ""} in ir["nodes"]


def test_image_is_refused_before_anything_is_sent(backend, server):
    @function
    def look(s, path):
        s += user(sgl.image(path) + "Describe it.")
        s += assistant(gen("d"))

    before = len(server.requests)
    with pytest.raises(sgl.NotSupportedError, match="image"):
        look.run(path="cat.png", backend=backend, remote=True)
    assert len(server.requests) == before


# ---- the server's side of `if` ----
def test_if_must_end_its_list_and_arms_are_checked():
    base = [{"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 2}}]
    cond = {"var": "x", "scope": "", "test": "eq", "value": "a"}
    not_last = {"version": 1, "nodes": base + [{"op": "if", "cond": cond, "then": [], "else": []},
                                               {"op": "text", "text": "t"}]}
    with pytest.raises(InvalidRequest, match="last of its list"):
        validate_program(not_last)
    bad_test = {"version": 1, "nodes": base + [{"op": "if", "cond": {**cond, "test": "lt"}, "then": [], "else": []}]}
    with pytest.raises(InvalidRequest, match="test"):
        validate_program(bad_test)
    bad_arm = {"version": 1, "nodes": base + [{"op": "if", "cond": cond, "then": [{"op": "exec"}], "else": []}]}
    with pytest.raises(InvalidRequest, match=r"then\[0\]\.op: Invalid value 'exec'"):
        validate_program(bad_arm)
    undefined = {"version": 1, "nodes": [{"op": "if", "cond": cond, "then": [], "else": []}]}
    with pytest.raises(InvalidRequest, match="before it is defined"):
        validate_program(undefined)


def test_deeply_nested_ifs_are_refused_not_a_crash():
    from services.gateway.programs import ProgramLimits
    inner = []
    for _ in range(200):
        inner = [{"op": "if", "cond": {"var": "x", "scope": "", "test": "eq", "value": "a"}, "then": inner,
                  "else": []}]
    ir = {"version": 1, "nodes": [{"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 1}}] + inner}
    with pytest.raises(InvalidRequest, match="nest deeper than 128"):
        validate_program(ir, ProgramLimits())


def test_a_read_of_a_variable_defined_differently_per_arm_in_another_stream_is_refused():
    cond = {"var": "x", "scope": "f0.0", "test": "eq", "value": "a"}
    ir = {"version": 1, "nodes": [
        {"op": "fork", "id": 0, "n": 1, "branches": [[
            {"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 2}},
            {"op": "if", "cond": cond, "then": [{"op": "gen", "name": "y", "sampling_params": {}}], "else": []}]]},
        {"op": "var", "name": "y", "scope": "f0.0"}]}
    with pytest.raises(InvalidRequest, match="under a condition"):
        validate_program(ir)


def test_a_read_the_taken_path_never_defines_fails_instead_of_hanging():
    # Hand-written IR (the tracer never makes this): the main stream waits on a branch variable that the
    # branch's taken arm does not define; the validator cannot know which arm runs.
    cond = {"var": "x", "scope": "f0.0", "test": "eq", "value": "zzz"}
    ir = {"version": 1, "nodes": [
        {"op": "fork", "id": 0, "n": 1, "branches": [[
            {"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 2}},
            {"op": "if", "cond": cond, "then": [{"op": "gen", "name": "y", "sampling_params": {}}],
             "else": [{"op": "gen", "name": "z", "sampling_params": {}}]}]]},
        {"op": "if", "cond": {"var": "x", "scope": "f0.0", "test": "eq", "value": "zzz"},
         "then": [], "else": []}]}
    program = validate_program(ir)

    async def generate(body):
        return {"text": "q", "meta_info": {"prompt_tokens": 1}}

    result = asyncio.run(asyncio.wait_for(execute_program(program, generate), 5))
    assert result["variables"]["f0.0.z"] == "q" and "f0.0.y" not in result["variables"]
    assert ProgramError  # the class a never-defined read would fail with


def test_streamed_remote_run_with_branches(backend):
    s = triage.run(word="red", backend=backend, remote=True, stream=True)
    assert list(s.text_iter("note")) == ["colour"]
    local = triage.run(word="red", backend=backend)
    assert s.text() == local.text() and s["end"] == local["end"]


def test_comparisons_after_strip_and_lower(backend):
    @function
    def polite(s, word):
        s += "say " + word + "\n" + gen("w", stop="<", max_tokens=12)
        if s["w"].strip().lower() == "yes":
            s += "\nsay agreed\n" + gen("r", stop="\n")
        s += select("c", choices=[" Yes", "no "])
        if s["c"].strip().lower() in ("yes", "maybe"):  # "maybe" is no choice: no path for it
            s += "!"

    ir = polite.trace(word="x")
    assert ir["nodes"][-1]["cond"]["transforms"] == ["strip", "lower"]
    assert "maybe" not in str(ir)
    for word in ("YES", "no"):
        local, remote = both(polite, backend, word=word)
        assert ("r" in local.variables()) == (word == "YES")

    @function
    def appends_transformed(s):
        s += gen("w", max_tokens=2)
        s += s["w"].strip()

    with pytest.raises(sgl.TracingError, match="not appended"):
        appends_transformed.trace()
    bad = {"version": 1, "nodes": [{"op": "gen", "name": "x", "sampling_params": {"max_new_tokens": 1}},
                                   {"op": "if", "cond": {"var": "x", "test": "eq", "value": "a",
                                                         "transforms": ["__class__"]}, "then": [], "else": []}]}
    with pytest.raises(InvalidRequest, match="transforms"):
        validate_program(bad)


@pytest.mark.parametrize("words", [("go", "go"), ("go", "stay")])
def test_join_gathers_a_branch_variable_only_when_every_branch_defined_it(backend, words):
    """Like the interpreter: a variable defined under a condition in the branches is gathered into the
    parent only when every branch's path defined it."""
    @function
    def react_or_not(s, words):
        forks = s.fork(2)
        for f, w in zip(forks, words):
            f += "say " + w + "\n" + gen("w", stop="\n")
            if f["w"] == "go":
                f += "\nsay went\n" + gen("reaction", stop="\n")
        forks.join()

    local, remote = both(react_or_not, backend, words=list(words))
    assert ("reaction" in local.variables()) == (words == ("go", "go"))
    assert ("reaction" in remote.variables()) == (words == ("go", "go"))
