"""Compiler mode: the tracer's IR for each example, the server-side validator and executor, remote runs."""
import asyncio
import copy
import json
import time

import msgpack
import pytest

import lang_client as sgl
from lang_client.api import DTYPE_REGEX
from lang_client.examples import branch_solve_merge, few_shot_qa, json_extraction, multi_turn_chat, tree_of_thought
from lang_client.tracer import constant_prefix
from services.gateway.programs import (ProgramLimits, execute_program, parse_program_request, stream_program,
                                       validate_program)
from shared.errors import InvalidRequest
from tests.support.fake_sglang_server import FakeSGLangServer, regex_responder

RESPONDER = regex_responder({
    json_extraction.CITY_REGEX: '{"name": "Lyon", "country": "France", "population": 520000, "is_capital": false}',
    DTYPE_REGEX[int]: "7",
    branch_solve_merge.GRADE_REGEX: "B+",
})

# (program, kwargs) for each example; traced with concrete arguments, as run(remote=True) does.
EXAMPLES = {
    "few_shot_qa": (few_shot_qa.few_shot_qa, {"question": "Who wrote Hamlet?"}),
    "branch_solve_merge": (branch_solve_merge.multi_dimensional_judge, {"essay": "Trees cool cities."}),
    "tree_of_thought": (tree_of_thought.tree_search, {"question": "17 sheep, all but 9 leave?"}),
    "json_extraction": (json_extraction.extract_city, {"document": "Lyon, France."}),
    "multi_turn_chat": (multi_turn_chat.multi_turn_chat, {"questions": ["Hi?", "And then?"]}),
}


def ops(nodes):
    return [n["op"] for n in nodes]


@pytest.fixture
def server():
    with FakeSGLangServer(responder=RESPONDER) as srv:
        yield srv


@pytest.fixture
def backend(server):
    return sgl.RuntimeEndpoint(server.url)


# ---- tracer ----
def test_few_shot_ir_has_an_arg_placeholder_and_constant_prefix():
    ir = few_shot_qa.few_shot_qa.trace()
    assert ir["args"] == ["question"]
    assert ir["nodes"] == [
        {"op": "text", "text": few_shot_qa.FEW_SHOT + "Question: "},
        {"op": "arg", "name": "question"},
        {"op": "text", "text": "\nAnswer:"},
        {"op": "gen", "name": "answer", "sampling_params": {"max_new_tokens": 32, "stop": ["\n"], "temperature": 0}},
    ]
    assert constant_prefix(ir) == few_shot_qa.FEW_SHOT + "Question: "


def test_branch_solve_merge_ir_forks_over_dimensions_and_reads_branch_vars():
    ir = branch_solve_merge.multi_dimensional_judge.trace(essay="E")
    top = ir["nodes"]
    assert ops(top).count("select") == 1 and ops(top).count("fork") == 1
    select = next(n for n in top if n["op"] == "select")
    assert select["choices"] == ["yes", "no"] and select["method"] == "token_length_normalized"
    fork = next(n for n in top if n["op"] == "fork")
    assert fork["n"] == 3 == len(fork["branches"])
    for i, (branch, dim) in enumerate(zip(fork["branches"], branch_solve_merge.DIMENSIONS)):
        assert ops(branch) == ["role_begin", "text", "role_end", "role_begin", "text", "gen", "role_end"]
        assert dim in branch[1]["text"]
        assert branch[5]["name"] == "judgment" and branch[5]["sampling_params"]["stop"] == ["END"]
    reads = [n for n in top if n["op"] == "var"]
    assert reads == [{"op": "var", "name": "judgment", "scope": f"f0.{i}"} for i in range(3)]
    grade = [n for n in top if n["op"] == "gen" and n["name"] == "grade"][0]
    assert grade["sampling_params"]["regex"] == branch_solve_merge.GRADE_REGEX


def test_tree_of_thought_ir_nests_forks_and_joins():
    ir = tree_of_thought.tree_search.trace(question="Q", num_branches=2)
    outer = next(n for n in ir["nodes"] if n["op"] == "fork")
    assert outer["id"] == 0 and outer["n"] == 2
    assert ir["nodes"][-1] == {"op": "join", "fork": 0, "mode": "gather_variable"}
    inner_ids = []
    for branch in outer["branches"]:
        inner = next(n for n in branch if n["op"] == "fork")
        inner_ids.append(inner["id"])
        assert branch[-1] == {"op": "join", "fork": inner["id"], "mode": "gather_variable"}
        for leaf in inner["branches"]:
            gens = [n for n in leaf if n["op"] == "gen"]
            assert [g["name"] for g in gens] == ["answer", "score"]
            assert gens[1]["sampling_params"]["regex"] == DTYPE_REGEX[int]
    assert inner_ids == [1, 2]


def test_json_and_chat_irs():
    ir = json_extraction.extract_city.trace(document="D")
    gens = [n for n in ir["nodes"] if n["op"] == "gen"]
    assert [g["sampling_params"].get("regex") for g in gens] == [json_extraction.CITY_REGEX, DTYPE_REGEX[int]]
    ir = multi_turn_chat.multi_turn_chat.trace(questions=["a", "b"])
    assert [n["name"] for n in ir["nodes"] if n["op"] == "gen"] == ["answer_0", "answer_1"]
    assert ops(ir["nodes"]).count("role_begin") == 5


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_ir_is_plain_data(name):
    program, kwargs = EXAMPLES[name]
    ir = program.trace(**kwargs)
    assert json.loads(json.dumps(ir)) == ir
    assert msgpack.unpackb(msgpack.packb(ir)) == ir


def test_tracing_refuses_what_needs_the_value_in_python():
    # Comparisons with constants and string work are traced (tests/lang/test_branches.py); these are not.
    @sgl.function
    def measures_output(s):
        s += sgl.gen("x")
        if len(s["x"]) > 3:
            s += "long"

    @sgl.function
    def reads_text(s):
        s += sgl.gen("x")
        s.text()

    @sgl.function
    def reads_undefined(s):
        s += s["never"]

    for prog in (measures_output, reads_text, reads_undefined):
        with pytest.raises(sgl.TracingError):
            prog.trace()


def test_tracer_follows_the_backends_chat_template(server):
    with FakeSGLangServer(model_path="meta-llama/Llama-3.2-1B-Instruct") as srv:
        ir = multi_turn_chat.multi_turn_chat.trace(questions=["a"], backend=sgl.RuntimeEndpoint(srv.url))
    assert ir["nodes"][0]["text"] == "<|start_header_id|>system<|end_header_id|>\n\n"


# ---- validation ----
def good_ir():
    return branch_solve_merge.multi_dimensional_judge.trace(essay="E")


def mutated(fn):
    ir = copy.deepcopy(good_ir())
    fn(ir)
    return ir


def fork_of(ir):
    return next(n for n in ir["nodes"] if n["op"] == "fork")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_validates(name):
    program, kwargs = EXAMPLES[name]
    p = validate_program(program.trace(**kwargs), ProgramLimits())
    assert p.nodes


BAD = {
    "not an object": (lambda ir: None, ["nodes"], "program"),
    "unknown op": (lambda ir: ir["nodes"].append({"op": "exec", "code": "1"}), None, "op"),
    "unknown field": (lambda ir: ir["nodes"][0].update(code="x"), None, "unknown field"),
    "bad version": (lambda ir: ir.update(version=2), None, "version"),
    "bad sampling param": (lambda ir: fork_of(ir)["branches"][0][5]["sampling_params"].update(temperature="hot"),
                           None, "temperature"),
    "unknown sampling key": (lambda ir: fork_of(ir)["branches"][0][5]["sampling_params"].update(bogus=1),
                             None, "bogus"),
    "read before define": (lambda ir: ir["nodes"].insert(0, {"op": "var", "name": "summary", "scope": ""}),
                           None, "before it is defined"),
    "unknown scope": (lambda ir: ir["nodes"].append({"op": "var", "name": "judgment", "scope": "f9.0"}),
                      None, "scope"),
    "join of unknown fork": (lambda ir: ir["nodes"].append({"op": "join", "fork": 7}), None, "fork"),
    "unbalanced roles": (lambda ir: ir["nodes"].append({"op": "role_end", "role": "user"}), None, "open role"),
    "fork n mismatch": (lambda ir: fork_of(ir).update(n=2), None, "branches"),
    "empty choices": (lambda ir: next(n for n in ir["nodes"] if n["op"] == "select").update(choices=[]),
                      None, "choices"),
    "too many choices": (lambda ir: next(n for n in ir["nodes"] if n["op"] == "select").update(choices=["x"] * 257),
                         None, "choices"),
    "fork too wide": (lambda ir: fork_of(ir).update(n=65, branches=[[]] * 65), None, ".n"),
    "gen in set parts": (lambda ir: ir["nodes"].append({"op": "set", "name": "v", "parts": [{"op": "gen"}]}),
                         None, "parts[0].op"),
    "bad name": (lambda ir: fork_of(ir)["branches"][0][5].update(name="a b"), None, "name"),
    "missing arg": (lambda ir: ir["nodes"].append({"op": "arg", "name": "who"}), None, "argument"),
    "n > 1": (lambda ir: fork_of(ir)["branches"][0][5]["sampling_params"].update(n=4), None, "one value"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_programs_are_refused(case):
    fn, replacement, needle = BAD[case]
    ir = replacement if replacement is not None else mutated(fn)
    with pytest.raises(InvalidRequest) as err:
        validate_program(ir, ProgramLimits())
    assert needle in err.value.message or needle in (err.value.param or "")
    assert err.value.param  # every refusal names where


def test_limits_are_enforced_each_by_name():
    ir = good_ir()
    cases = {
        "max_nodes": (ProgramLimits(max_nodes=10), "nodes"),
        "max_total_tokens": (ProgramLimits(max_total_tokens=200), "tokens"),
        "max_depth": (ProgramLimits(max_depth=0), "deeper"),
        "max_text_chars": (ProgramLimits(max_text_chars=100), "characters"),
    }
    for name, (limits, needle) in cases.items():
        with pytest.raises(InvalidRequest, match=needle):
            validate_program(ir, limits)
    deep = tree_of_thought.tree_search.trace(question="Q")
    validate_program(deep, ProgramLimits(max_depth=2))
    with pytest.raises(InvalidRequest, match="deeper"):
        validate_program(deep, ProgramLimits(max_depth=1))


def test_gathered_list_cannot_be_appended_as_text():
    ir = tree_of_thought.tree_search.trace(question="Q")
    ir["nodes"].append({"op": "var", "name": "plan", "scope": ""})
    with pytest.raises(InvalidRequest, match="gathered list"):
        validate_program(ir, ProgramLimits())


def test_request_parsing_binds_args_and_checks_shape():
    ir = few_shot_qa.few_shot_qa.trace()
    program, stream = parse_program_request({"program": ir, "args": {"question": "Why?"}, "stream": True})
    assert stream is True and program.nodes[1].text == "Why?"
    for body in ({"program": ir}, {"program": ir, "args": {"question": ["x"]}}, {"program": ir, "eval": 1},
                 {"program": ir, "args": {"question": "x"}, "stream": "yes"}, []):
        with pytest.raises(InvalidRequest):
            parse_program_request(body)


def test_executor_has_no_code_execution_paths():
    import inspect

    from services.gateway import programs
    from services.gateway.programs import execute, ir, validate
    for mod in (programs, ir, validate, execute):
        source = inspect.getsource(mod)
        for word in ("eval(", "exec(", "pickle", "__import__", "getattr("):
            assert word not in source, (mod.__name__, word)


# ---- execution ----
class RecordingGenerate:
    """A fake generate callable: deterministic answers from the fake server's model, with timings."""

    def __init__(self, delay=0.0):
        self.fake = FakeSGLangServer(responder=RESPONDER, delay=delay)

    @property
    def calls(self):
        return self.fake.requests

    async def __call__(self, body):
        return await self.fake.generate_async(body)


def run_async(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_execute_program_matches_the_interpreter(name, backend):
    program, kwargs = EXAMPLES[name]
    local = program.run(backend=backend, **kwargs)
    gen = RecordingGenerate()
    result = run_async(execute_program(validate_program(program.trace(backend=backend, **kwargs)), gen))
    assert result["text"] == local.text()
    assert result["messages"] == local.messages()
    for var, value in local.variables().items():
        assert result["variables"][var] == value
    assert gen.calls  # it did generate


def test_fork_warms_the_prefix_once_then_admits_branches_together():
    gen = RecordingGenerate(delay=0.2)
    program = validate_program(branch_solve_merge.multi_dimensional_judge.trace(essay="E"))
    t0 = time.monotonic()
    result = run_async(execute_program(program, gen))
    elapsed = time.monotonic() - t0
    bodies = [c["body"] for c in gen.calls]
    # select (2 calls), then the fork warm-up, then three branches, then the merge's two gens
    warm = bodies[2]
    assert warm["sampling_params"] == {"max_new_tokens": 0} and isinstance(warm["text"], str)
    branch_calls = gen.calls[3:6]
    assert all(c["body"]["text"].startswith(warm["text"]) for c in branch_calls)
    assert all(c["start"] >= gen.calls[2]["end"] for c in branch_calls)
    assert max(c["start"] for c in branch_calls) < min(c["end"] for c in branch_calls)  # concurrent
    assert gen.fake.max_in_flight == 3
    assert elapsed < 0.2 * 5  # 3 branches + 2 merge gens would take 5 delays if serialized
    assert set(result["variables"]) >= {"on_topic", "f0.0.judgment", "f0.1.judgment", "f0.2.judgment",
                                         "summary", "grade"}
    assert result["variables"]["grade"] == "B+"
    assert result["meta_info"]["f0.1.judgment"]["prompt_tokens"] > 0


def test_fork_hint_off_sends_no_warm_up():
    """execute_program(fork_hint=False), what the gateway's --disable-fork-hint passes: the same answer,
    one request fewer per fork (no max_new_tokens=0 prefill of the shared prefix)."""
    program = validate_program(branch_solve_merge.multi_dimensional_judge.trace(essay="E"))
    on, off = RecordingGenerate(), RecordingGenerate()
    with_hint = run_async(execute_program(program, on))
    without = run_async(execute_program(program, off, fork_hint=False))
    assert without == with_hint
    warm_ups = [c for c in on.calls if c["body"]["sampling_params"] == {"max_new_tokens": 0}
                and isinstance(c["body"]["text"], str)]
    assert len(off.calls) == len(on.calls) - 1 and on.calls[2] in warm_ups
    assert not any(c["body"] == on.calls[2]["body"] for c in off.calls)


def test_select_in_executor_sends_the_documented_requests():
    ir = {"version": 1, "nodes": [{"op": "text", "text": "Pick: "},
                                  {"op": "select", "name": "c", "choices": ["ab", "c"], "temperature": 0}]}
    gen = RecordingGenerate()
    result = run_async(execute_program(validate_program(ir), gen))
    first, batch = [c["body"] for c in gen.calls]
    assert first == {"text": "Pick: ", "sampling_params": {"max_new_tokens": 0}}
    assert batch["text"] == ["Pick: ab", "Pick: c"] and batch["logprob_start_len"] == len("Pick: ") - 2
    assert batch["return_logprob"] and batch["return_text_in_logprobs"]
    scores = result["meta_info"]["c"]["normalized_prompt_logprobs"]
    assert result["variables"]["c"] == ["ab", "c"][scores.index(max(scores))]


def test_streamed_events_arrive_before_the_result():
    program = validate_program(tree_of_thought.tree_search.trace(question="Q"))

    async def collect():
        return [e async for e in stream_program(program, RecordingGenerate())]

    events = run_async(collect())
    assert events[-1]["type"] == "result"
    names = [e["name"] for e in events[:-1]]
    assert "f0.0.plan" in names and "f1.1.score" in names and names[-3:] == ["plan", "answer", "score"]
    assert events[-1]["variables"]["score"] == [["7", "7"], ["7", "7"]]


def test_a_failing_branch_fails_the_program_without_hanging():
    ir = branch_solve_merge.multi_dimensional_judge.trace(essay="E")
    calls = []

    async def generate(body):
        calls.append(body)
        if "Originality" in str(body.get("text")):
            raise RuntimeError("worker died")
        return await RecordingGenerate()(body)

    with pytest.raises(RuntimeError, match="worker died"):
        run_async(asyncio.wait_for(execute_program(validate_program(ir), generate), 5))


def test_generate_error_answers_become_errors():
    ir = {"version": 1, "nodes": [{"op": "gen", "name": "x", "sampling_params": {}}]}

    async def generate(body):
        return {"error": {"message": "context_length_exceeded"}}

    with pytest.raises(Exception, match="context_length_exceeded"):
        run_async(execute_program(validate_program(ir), generate))


# ---- remote runs through the fake server's /v1/programs ----
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_remote_run_equals_local_run(name, backend):
    program, kwargs = EXAMPLES[name]
    local = program.run(backend=backend, **kwargs)
    remote = program.run(backend=backend, remote=True, **kwargs)
    assert remote.text() == local.text()
    for var, value in local.variables().items():
        assert remote[var] == value


def test_remote_streaming_fills_variables_as_they_complete(server, backend):
    s = tree_of_thought.tree_search.run(question="Q", backend=backend, remote=True, stream=True)
    pieces = list(s.text_iter("f0.0.plan"))
    assert len(pieces) == 1 and pieces[0] == s["f0.0.plan"]
    score, plan, answer = tree_of_thought.best_solution(s)
    assert score == 7
    assert any(r["path"] == "/v1/programs" and r["body"]["stream"] for r in server.requests)


def test_remote_refusal_is_a_400(backend):
    @sgl.function
    def huge(s):
        forks = s.fork(100)
        forks += sgl.gen("x")

    with pytest.raises(sgl.BackendError) as err:
        huge.run(backend=backend, remote=True)
    assert err.value.status == 400 and "<= 64" in str(err.value)


def test_remote_batch(backend):
    states = few_shot_qa.few_shot_qa.run_batch([{"question": "a"}, {"question": "b"}], backend=backend,
                                               remote=True)
    local = few_shot_qa.few_shot_qa.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    assert [s["answer"] for s in states] == [s["answer"] for s in local]


def test_closing_the_event_stream_cancels_every_branch():
    fake = FakeSGLangServer(responder=RESPONDER, delay=0.1)
    program = validate_program(tree_of_thought.tree_search.trace(question="Q"))

    async def scenario():
        events = stream_program(program, fake.generate_async)
        first = await events.__anext__()
        await events.aclose()  # what the gateway does when the client hangs up
        await asyncio.sleep(0.05)
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return first, leftover

    first, leftover = run_async(scenario())
    assert first["type"] == "variable"
    assert leftover == [] and fake.in_flight == 0
    assert len(fake.requests) < 1 + 2 + 4 * 3  # the tree was not finished behind the client's back
