"""The OpenAI backend and API speculative execution (paper §5), against a fake OpenAI client."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import lang_client as sgl
from lang_client.speculative import SpecBuffer, cut_at_stop


class FakeOpenAIClient:
    """Duck-types `openai.OpenAI`: chat.completions.create and completions.create, answers from a function."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._chat))
        self.completions = SimpleNamespace(create=self._complete)

    def _usage(self):
        return SimpleNamespace(prompt_tokens=10, completion_tokens=5)

    def _chat(self, **req):
        self.requests.append(req)
        text = self.answer(req["messages"], req)
        msg = SimpleNamespace(content=text)
        return SimpleNamespace(choices=[SimpleNamespace(message=msg, finish_reason="stop")], usage=self._usage())

    def _complete(self, **req):
        self.requests.append(req)
        text = self.answer(req["prompt"], req)
        return SimpleNamespace(choices=[SimpleNamespace(text=text, finish_reason="length")], usage=self._usage())


def apply_stop(text, req):
    for stop in req.get("stop") or []:
        if stop in text:
            text = text[:text.index(stop)]
    return text


def profile_program(spec_tokens):
    def body(s, doc):
        s += doc + "\nname:" + sgl.gen("name", max_tokens=16, stop="\n") + "\njob:" + sgl.gen(
            "job", max_tokens=16, stop="\n")
    return sgl.function(body) if spec_tokens is None else sgl.function(num_api_spec_tokens=spec_tokens)(body)


def test_speculation_serves_the_second_gen_from_the_first_call():
    def answer(prompt, req):
        if prompt.endswith("job:"):
            return apply_stop(" mathematician\nborn: 1815", req)
        return apply_stop(" Ada Lovelace\njob: mathematician\nborn: 1815", req)

    client = FakeOpenAIClient(answer)
    backend = sgl.OpenAI("gpt-3.5-turbo-instruct", client=client)

    s = profile_program(64).run(doc="Ada wrote the first program.", backend=backend)
    assert len(client.requests) == 1
    (req,) = client.requests
    assert "stop" not in req and req["max_tokens"] == 64  # asked for more, without the stop
    assert s["name"] == " Ada Lovelace" and s["job"] == " mathematician"
    assert s.text() == "Ada wrote the first program.\nname: Ada Lovelace\njob: mathematician"
    assert s.stream_executor.spec.hits == 1

    plain = FakeOpenAIClient(client.answer)
    s2 = profile_program(None).run(doc="Ada wrote the first program.", backend=sgl.OpenAI(
        "gpt-3.5-turbo-instruct", client=plain))
    assert len(plain.requests) == 2  # what speculation saved
    assert s2.text() == s.text()


def test_a_wrong_guess_falls_back_to_a_real_call():
    def answer(prompt, req):
        if prompt.endswith("job:"):
            return apply_stop(" engineer\n", req)
        return apply_stop(" Grace Hopper\nrank: admiral\n", req)  # the model did not predict "job:"

    client = FakeOpenAIClient(answer)
    s = profile_program(64).run(doc="Grace.", backend=sgl.OpenAI("davinci-instruct", client=client))
    assert len(client.requests) == 2
    assert s["name"] == " Grace Hopper" and s["job"] == " engineer"
    assert client.requests[1]["prompt"].endswith("\nname: Grace Hopper\njob:")
    assert s.stream_executor.spec.misses == 1


def test_chat_speculation_within_one_assistant_turn():
    client = FakeOpenAIClient(lambda messages, req: "Ada\nAge: 36\nother")

    def body(s):
        s += sgl.system("Answer in the given format.")
        s += sgl.user("Who wrote the first program?")
        s += sgl.assistant(sgl.gen("name", stop="\n") + "\nAge: " + sgl.gen("age", stop="\n"))

    s = sgl.function(num_api_spec_tokens=32)(body).run(backend=sgl.OpenAI("gpt-4o", client=client))
    assert len(client.requests) == 1
    assert client.requests[0]["messages"] == [{"role": "system", "content": "Answer in the given format."},
                                              {"role": "user", "content": "Who wrote the first program?"}]
    assert s["name"] == "Ada" and s["age"] == "36"
    assert s.messages()[-1] == {"role": "assistant", "content": "Ada\nAge: 36"}
    # Without speculation a chat API cannot continue text inside an assistant turn: say so clearly.
    with pytest.raises(sgl.NotSupportedError, match="start of an assistant turn"):
        sgl.function(body).run(backend=sgl.OpenAI("gpt-4o", client=FakeOpenAIClient(client.answer)))


def test_openai_backend_maps_params_and_refuses_what_it_cannot_do():
    client = FakeOpenAIClient(lambda messages, req: "Yes, definitely")
    backend = sgl.OpenAI("gpt-4o", client=client)

    @sgl.function
    def prog(s):
        s += sgl.user("Is water wet?")
        s += sgl.assistant(sgl.gen("a", max_tokens=7, temperature=0.2, top_p=0.9, stop=["."]))
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("yn", ["yes", "no", "Yes"]))

    s = prog.run(backend=backend)
    assert client.requests[0] == {"model": "gpt-4o", "messages": [{"role": "user", "content": "Is water wet?"}],
                                  "max_tokens": 7, "temperature": 0.2, "top_p": 0.9, "stop": ["."]}
    assert s["yn"] == "Yes"  # the answer mapped onto the choice it starts with

    @sgl.function
    def regex(s):
        s += sgl.user("n?")
        s += sgl.assistant(sgl.gen("n", regex="[0-9]+"))

    with pytest.raises(sgl.NotSupportedError, match="regex"):
        regex.run(backend=backend)

    @sgl.function
    def schema(s):
        s += sgl.user("json?")
        s += sgl.assistant(sgl.gen("j", json_schema={"type": "object"}))

    schema.run(backend=backend)
    assert client.requests[-1]["response_format"]["json_schema"]["schema"] == {"type": "object"}
    with pytest.raises(sgl.NotSupportedError):
        sgl.OpenAI("gpt-4o", client=client, strict=True)._request({"top_k": 5})


def test_spec_buffer_unit():
    assert cut_at_stop("ab\ncd", ["\n", "c"]) == ("ab", "\ncd")
    assert cut_at_stop("abc", ["\n"]) == ("abc", None)
    buf = SpecBuffer(16)
    buf.keep("\nx: 1\ny: 2")
    buf.feed_literal("\nx:")
    assert buf.take(["\n"]) == " 1"
    buf.feed_literal("\nz:")  # mismatch drops the guess
    assert buf.pending == "" and buf.take(["\n"]) is None
    buf.keep("\nx: 1 without a stop")
    buf.feed_literal("\nx:")
    assert buf.take(["\n"]) is None  # the guess does not show where the gen stops
    assert buf.request({"stop": ["\n"], "max_new_tokens": 4}) == {"max_new_tokens": 16}
    assert not buf.applies({"stop": ["\n"], "regex": "a"}) and not buf.applies({})


def test_sdk_imports_without_torch_or_server_code(tmp_path):
    # Block torch and the server packages: the SDK must import and trace on the standard library alone.
    code = (
        "import sys\n"
        "for m in ('torch', 'shared', 'services', 'openai', 'requests', 'aiohttp'): sys.modules[m] = None\n"
        "import lang_client as sgl\n"
        "from lang_client.examples import tree_of_thought\n"
        "print(len(tree_of_thought.tree_search.trace(question='q')['nodes']))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": root},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0
