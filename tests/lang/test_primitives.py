"""lang_client in interpreter mode against the stand-in SGLang server: every primitive, as sent on the wire."""
import threading
import time

import pytest

import lang_client as sgl
from lang_client.api import DTYPE_REGEX
from lang_client.chat_template import CHATML, DEFAULT, LLAMA3
from tests.support.fake_sglang_server import FakeSGLangServer, default_scorer


@pytest.fixture
def server():
    with FakeSGLangServer() as srv:
        yield srv


@pytest.fixture
def backend(server):
    return sgl.RuntimeEndpoint(server.url)


def gen_bodies(server, nonzero_only=False):
    bodies = [r["body"] for r in server.generate_requests()]
    if nonzero_only:
        bodies = [b for b in bodies if b["sampling_params"].get("max_new_tokens", 128) != 0]
    return bodies


def test_gen_sends_native_sampling_params_and_stores_variable(server, backend):
    @sgl.function
    def prog(s):
        s += "Q: hi\nA:" + sgl.gen("a", max_tokens=20, min_tokens=1, stop=["\n", "END"], stop_token_ids=[7],
                                   temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.2,
                                   presence_penalty=0.3, ignore_eos=False)

    s = prog.run(backend=backend)
    (body,) = gen_bodies(server)
    assert body["text"] == "Q: hi\nA:"
    assert body["sampling_params"] == {
        "max_new_tokens": 20, "min_new_tokens": 1, "stop": ["\n", "END"], "stop_token_ids": [7],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.2,
        "presence_penalty": 0.3, "ignore_eos": False}
    assert "return_logprob" not in body and "stream" not in body  # top-level keys only when set
    assert s["a"].startswith(" gen") and "\n" not in s["a"]
    assert s.text() == "Q: hi\nA:" + s["a"]
    assert s.get_meta_info("a")["finish_reason"]["type"] == "stop"


def test_run_level_defaults_apply_to_gens_without_their_own(server, backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a") + sgl.gen("b", max_tokens=3)

    prog.run(backend=backend, max_new_tokens=9, temperature=0)
    a, b = gen_bodies(server)
    assert a["sampling_params"] == {"max_new_tokens": 9, "temperature": 0}
    assert b["sampling_params"] == {"max_new_tokens": 3, "temperature": 0}


def test_regex_json_schema_and_dtype_pass_through(server, backend):
    server.responder = lambda prompt, sp: "12" if sp.get("regex") == DTYPE_REGEX[int] else "ok"

    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen("n", dtype=int) + " r=" + sgl.gen("r", regex=r"(yes|no)")
        s += " j=" + sgl.gen("j", json_schema={"type": "object"})

    s = prog.run(backend=backend)
    n, r, j = gen_bodies(server)
    assert n["sampling_params"]["regex"] == DTYPE_REGEX[int]
    assert r["sampling_params"]["regex"] == "(yes|no)"
    assert j["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert s["n"] == "12"


def test_logprob_options_go_top_level(server, backend):
    @sgl.function
    def prog(s):
        s += "abc" + sgl.gen("a", max_tokens=4, return_logprob=True, top_logprobs_num=2, logprob_start_len=1,
                              return_text_in_logprobs=True)

    s = prog.run(backend=backend)
    (body,) = gen_bodies(server)
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2 and body["logprob_start_len"] == 1
    meta = s.get_meta_info("a")
    assert len(meta["output_token_logprobs"]) == len(s["a"])
    assert meta["input_token_logprobs"][0][0] is None


def test_roles_render_chatml_and_messages(backend):
    @sgl.function
    def prog(s):
        s += sgl.system("sys")
        s += sgl.user_begin() + "hello" + sgl.user_end()
        s += sgl.assistant(sgl.gen("reply", max_tokens=5))
        with s.user():
            s += "again"
        s.assistant("fine")

    s = prog.run(backend=backend)
    reply = s["reply"]
    assert s.text() == (CHATML.prefix("system") + "sys" + CHATML.suffix("system") + CHATML.prefix("user") + "hello"
                        + CHATML.suffix("user") + CHATML.prefix("assistant") + reply + CHATML.suffix("assistant")
                        + CHATML.prefix("user") + "again" + CHATML.suffix("user")
                        + CHATML.prefix("assistant") + "fine" + CHATML.suffix("assistant"))
    assert s.messages() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                            {"role": "assistant", "content": reply.lstrip()},  # stripped, as SGLang does
                            {"role": "user", "content": "again"},
                            {"role": "assistant", "content": "fine"}]


def test_chat_template_follows_model_path():
    with FakeSGLangServer(model_path="meta-llama/Meta-Llama-3.1-8B-Instruct") as srv:
        backend = sgl.RuntimeEndpoint(srv.url)
        assert backend.get_chat_template() is LLAMA3

        @sgl.function
        def prog(s):
            s += sgl.user("hi")

        assert prog.run(backend=backend).text() == "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert sgl.template_for_model("Qwen/Qwen2.5-7B-Instruct") is CHATML
    assert sgl.template_for_model("meta-llama/Llama-2-7b-chat-hf").name == "llama-2"
    # No rule names it (unknown, base models, our tiny-random): SGLang's frontend's "default" template.
    for path in ("some/unknown-model", "tiny-random", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"):
        assert sgl.template_for_model(path) is DEFAULT, path
    assert DEFAULT.prefix("user") == "USER:" and DEFAULT.suffix("assistant") == "\n"


def test_nested_roles_are_an_error(backend):
    @sgl.function
    def prog(s):
        s += sgl.user_begin() + sgl.assistant("x")

    with pytest.raises(sgl.LangError, match="inside role"):
        prog.run(backend=backend)


def test_image_says_not_supported(backend):
    @sgl.function
    def prog(s):
        s += sgl.user(sgl.image("cat.png") + "what is this?")

    with pytest.raises(sgl.NotSupportedError, match="not supported by this model"):
        prog.run(backend=backend)


def test_select_picks_max_token_length_normalized_logprob(server, backend):
    # Make "an elephant" (long, each token likely) beat "a" (short, unlikely) only under normalization.
    def scorer(context, token):
        return -0.5 if "an elephant".startswith(context.split("is ")[-1] + token) else -3.0

    server.scorer = scorer

    @sgl.function
    def prog(s):
        s += "The animal is " + sgl.select("animal", ["a", "an elephant", "a cat"])

    s = prog.run(backend=backend)
    first, batch = gen_bodies(server)
    # step 1: the prompt alone, prefill only
    assert first == {"text": "The animal is ", "sampling_params": {"max_new_tokens": 0}}
    # step 2: one batch, logprobs from two tokens before the choice
    assert batch["text"] == ["The animal is a", "The animal is an elephant", "The animal is a cat"]
    assert batch["sampling_params"]["max_new_tokens"] == 0
    assert batch["return_logprob"] is True and batch["return_text_in_logprobs"] is True
    assert batch["logprob_start_len"] == len("The animal is ") - 2
    assert s["animal"] == "an elephant"
    assert s.text() == "The animal is an elephant"
    scores = s.get_meta_info("animal")["normalized_prompt_logprobs"]
    assert scores.index(max(scores)) == 1
    # the raw sum would have picked the short choice: normalization is what decides
    sums = [sum(e[0] for e in lps if e[0] is not None) for lps in s.get_meta_info("animal")["input_token_logprobs"]]
    assert sums.index(max(sums)) != 1


def test_select_mean_matches_hand_computation(server, backend):
    @sgl.function
    def prog(s):
        s += "pick: " + sgl.select("c", ["xy", "z"])

    s = prog.run(backend=backend)
    prompt = "pick: "
    expected = []
    for c in ("xy", "z"):
        full = prompt + c
        lps = [default_scorer(full[:i], full[i]) for i in range(len(prompt) - 1, len(full))]  # first is null
        expected.append(sum(lps) / len(lps))
    assert s.get_meta_info("c")["normalized_prompt_logprobs"] == pytest.approx(expected)
    assert s["c"] == ["xy", "z"][expected.index(max(expected))]


def test_gen_with_choices_and_greedy_method(server, backend):
    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("g", choices=["yes", "no"]) + " B:" + sgl.select(
            "h", ["yes", "no"], choices_method=sgl.greedy_token_selection)

    s = prog.run(backend=backend)
    assert s["g"] in ("yes", "no") and s["h"] in ("yes", "no")
    assert len(gen_bodies(server)) == 4


def test_variable_read_waits_only_for_its_gen(server, backend):
    server.delay = 0.3

    @sgl.function
    def prog(s):
        t0 = time.monotonic()
        s += "a" + sgl.gen("x", max_tokens=4)
        s += "b" + sgl.gen("y", max_tokens=4)
        s.queued_in = time.monotonic() - t0  # appends returned without waiting for the server
        s.x_value = s["x"]

    s = prog.run(backend=backend)
    assert s.queued_in < 0.2
    assert s.x_value == s["x"] and "x" in s and "nope" not in s
    with pytest.raises(KeyError):
        s["nope"]


def test_set_var_and_ret_value(backend):
    @sgl.function
    def prog(s, n):
        s["given"] = n
        return n * 2

    s = prog.run(3, backend=backend)
    assert s["given"] == 3 and s.ret_value == 6


def test_subprogram_call_inlines_into_callers_stream(backend):
    @sgl.function
    def inner(s, word):
        s += "<" + word + ">"

    @sgl.function
    def outer(s):
        s += "start"
        inner(s, "mid")
        inner.bind(word="end")(s)

    assert outer.run(backend=backend).text() == "start<mid><end>"


def test_fork_sends_prefix_hint_before_children_and_runs_them_concurrently(server, backend):
    server.delay = 0.3

    @sgl.function
    def prog(s):
        s += "shared prefix. "
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"branch {i}:" + sgl.gen("out", max_tokens=8)
        forks.join()

    t0 = time.monotonic()
    s = prog.run(backend=backend)
    elapsed = time.monotonic() - t0
    reqs = server.generate_requests()
    hint, children = reqs[0], reqs[1:]
    assert hint["body"] == {"text": "shared prefix. ", "sampling_params": {"max_new_tokens": 0}}
    assert len(children) == 4
    assert all(c["start"] >= hint["end"] for c in children)  # the prefix was cached before any child asked
    assert all(c["body"]["text"].startswith("shared prefix. branch ") for c in children)
    assert server.max_in_flight >= 2 and elapsed < 4 * 0.3  # the children overlapped
    outs = s["out"]  # gather_variable: a list in fork order
    server.delay = 0
    assert outs == [backend.generate(sgl.backends.Prompt(f"shared prefix. branch {i}:"),
                                     {"max_new_tokens": 8})[0] for i in range(4)]


def test_fork_of_one_sends_no_hint_and_children_see_parent_vars(server, backend):
    @sgl.function
    def prog(s):
        s += "p:" + sgl.gen("x", max_tokens=3)
        (f,) = s.fork(1)
        f += "|" + f["x"]
        s.child = f

    s = prog.run(backend=backend)
    assert len(gen_bodies(server)) == 1
    assert s.child.text() == s.text() + "|" + s["x"]


def test_join_concate_and_append_and_group_append(backend):
    @sgl.function
    def prog(s):
        s += "root;"
        forks = s.fork(2)
        forks += ["L", "R"]
        forks += "!"
        forks.join("concate_and_append")
        s += ";end"

    assert prog.run(backend=backend).text() == "root;L!R!;end"


def test_streaming_text_iter_yields_pieces_in_order(server, backend):
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=30, stop="\n") + "|" + sgl.gen("b", max_tokens=5)

    s = prog.run(backend=backend, stream=True)
    pieces = list(s.text_iter())
    assert len(pieces) > 4  # streamed, not one block
    assert "".join(pieces) == s.text()
    streamed = [r["body"] for r in server.generate_requests()]
    assert all(b.get("stream") is True for b in streamed)
    s2 = prog.run(backend=backend, stream=True)
    assert "".join(s2.text_iter("a")) == s2["a"]


def test_streaming_surfaces_errors_at_the_end(backend):
    @sgl.function
    def prog(s):
        s += "x"
        raise ValueError("boom in program")

    s = prog.run(backend=backend, stream=True)
    with pytest.raises(ValueError, match="boom"):
        list(s.text_iter())


def test_run_batch_warms_long_prefix_once_and_keeps_order(server, backend):
    prefix = "You answer trivia questions briefly and precisely, one line each. " * 2

    @sgl.function
    def prog(s, q):
        s += prefix + "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=12, stop="\n")

    qs = [f"question {i}" for i in range(6)]
    states = prog.run_batch([{"q": q} for q in qs], num_threads=3, temperature=0, backend=backend)
    reqs = gen_bodies(server)
    assert reqs[0] == {"text": prefix + "Q: ", "sampling_params": {"max_new_tokens": 0}}
    assert len(reqs) == 7
    for q, st in zip(qs, states):
        assert st.text().startswith(prefix + "Q: " + q + "\n")
        assert st["a"] == backend.generate(sgl.backends.Prompt(prefix + "Q: " + q + "\nA:"), {})[0].split("\n")[0]
    assert all(r["sampling_params"].get("temperature") == 0 for r in reqs[1:])


def test_run_batch_short_prefix_has_no_hint_and_keeps_errors_per_state(server, backend):
    @sgl.function
    def prog(s, q):
        if q == "bad":
            raise RuntimeError("bad input")
        s += q + sgl.gen("a", max_tokens=3)

    states = prog.run_batch([{"q": "ok"}, {"q": "bad"}], progress_bar=True, backend=backend)
    assert len(gen_bodies(server)) == 1
    assert states[0].error() is None and states[0]["a"]
    assert isinstance(states[1].error(), RuntimeError)


def test_server_errors_raise_backend_error_with_the_servers_message(backend):
    with pytest.raises(sgl.BackendError, match="text is required") as err:
        backend.http.post_json("/generate", {"sampling_params": {}})
    assert err.value.status == 400


def test_api_key_is_sent_as_bearer():
    with FakeSGLangServer(api_key="sekret") as srv:
        with pytest.raises(sgl.BackendError, match="401"):
            sgl.RuntimeEndpoint(srv.url)
        backend = sgl.RuntimeEndpoint(srv.url, api_key="sekret")
        backend.flush_cache()
        assert [r["path"] for r in srv.requests][-1] == "/flush_cache"


def test_default_backend_and_missing_backend():
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        prog.run()
    with FakeSGLangServer() as srv:
        sgl.set_default_backend(sgl.RuntimeEndpoint(srv.url))
        try:
            assert prog().text() == "x"  # calling the function runs it
        finally:
            sgl.set_default_backend(None)


def test_many_programs_do_not_leak_threads(backend):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += "x"

    before = threading.active_count()
    for _ in range(10):
        prog.run(backend=backend)
    time.sleep(0.2)
    assert threading.active_count() <= before + 2
